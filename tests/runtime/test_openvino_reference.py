"""OpenVINO and the ONNX reference evaluator as runtimes: in the one registry that `validate` and `generate` read,
through every validation scenario ONNX Runtime passes (prefill, decode steps, chunked prefill, a batch), against
the PyTorch model within the fp32 tolerances, per-layer hidden states included."""

import numpy as np
import pytest

from k3export.runtime import RUNNERS, Decoding, RuntimeUnavailable, Target, TorchRunner, left_pad, make_runner, to_numpy
from k3export.validate import Tolerances, make_scenarios, validate
from k3export.validate.compare import compare

#: decode steps per runtime: the reference evaluator runs numpy one node at a time (slow: few steps)
STEPS = {"openvino": 16, "openvino-stateless": 16, "onnx-reference": 4}


def test_validate_and_generate_take_both_from_the_registry():
    from cli.generate import RUNTIMES as GENERATE
    from k3export.validate.api import RUNTIMES as VALIDATE

    for name in ("openvino", "openvino-stateless", "onnx-reference"):
        assert name in RUNNERS and name in VALIDATE and name in GENERATE


@pytest.mark.parametrize("runtime", list(STEPS))
def test_every_validation_scenario_passes(tiny, make, runtime):
    steps = STEPS[runtime]
    scenarios = make_scenarios(tiny.config.vocab_size, prompt_len=16, steps=steps, batch=2, seed=0)
    assert [s.name for s in scenarios] == ["decode", "chunked_prefill", "batch"]
    runner = make(runtime)
    result = validate(TorchRunner(tiny), [runner], scenarios)
    assert result.passed, result.localisation
    by = {r.scenario: r for r in result.runs}
    assert by["decode"].steps_run == by["batch"].steps_run == steps
    assert all(all(r.greedy) for r in result.runs)
    assert any(rec.kind == "hidden" for rec in by["decode"].records)  # every layer compared, not the logits only
    worst = max(rec.metrics.rms_rel for r in result.runs for rec in r.records)
    assert worst < Tolerances().for_kind("logits").rms_rel / 10  # well inside the fp32 tolerance
    assert runtime in runner.describe()
    if runtime.startswith("openvino"):  # the registry's default is the stateful form
        assert runner.stateful == (runtime == "openvino")


@pytest.fixture(scope="module")
def mxfp4_inlined(released_random, tmp_path_factory):
    """The released-layout tiny checkpoint (MXFP4 experts) exported keeping them, in the inlined form (what
    OpenVINO reads)."""
    from k3export.converters.onnx import export_onnx

    out = tmp_path_factory.mktemp("openvino_mxfp4") / "onnx"
    export_onnx(str(released_random), out, dtype="fp32", experts="mxfp4", form="inlined")
    return out


def test_openvino_runs_mxfp4_experts_as_pytorch_over_32_decode_steps(released_random, mxfp4_inlined):
    """OpenVINO on the MXFP4 experts as the file keeps them (FLOAT4E2M1 / FLOAT8E8M0 ``DequantizeLinear`` of the
    selected experts), against the PyTorch model of the same checkpoint (its experts decoded): greedy tokens over
    prefill + 32 decode steps, logits and hidden states within the fp32 tolerances."""
    pytest.importorskip("openvino")
    import onnx

    from k3export.converters.onnx.forms import has_mxfp4

    folder = mxfp4_inlined
    assert has_mxfp4(onnx.load(str(folder / "model.onnx"), load_external_data=False))
    reference = TorchRunner.from_pretrained(released_random, "float32")
    runner = make_runner("openvino", Target(onnx_dir=folder))
    scenarios = make_scenarios(reference.model.config.vocab_size, prompt_len=16, steps=32, which=("decode",))
    result = validate(reference, [runner], scenarios)
    assert result.passed, result.localisation
    (run,) = result.runs
    assert run.steps_run == 32 and all(run.greedy)
    assert max(rec.metrics.rms_rel for rec in run.records) < Tolerances().for_kind("logits").rms_rel / 10


def test_the_reference_evaluator_takes_small_exports_only(export_dir, monkeypatch):
    from k3export.runtime import reference_runner

    monkeypatch.setattr(reference_runner, "REFERENCE_MAX_WEIGHT_BYTES", 1 << 20)
    with pytest.raises(RuntimeUnavailable, match=r"onnx-reference: .* GiB of weights; the ONNX reference evaluator "
                                                 r"runs exports of at most"):
        make_runner("onnx-reference", Target(onnx_dir=export_dir))


def test_the_reference_evaluator_prefills_200_tokens_at_once_as_ort_and_pytorch(tiny, make):
    """One prefill of 200 tokens (and a left-padded row of 137 beside it) on the reference evaluator, against ONNX
    Runtime and the PyTorch model: the logits of every real position and every state the prefill hands on. onnx's
    own GatherElements took at most 63 entries along its axis, and the short conv's window gathers along the
    [conv state | prompt] axis, so a prefill of 61 tokens or more failed; the conv states check that gather."""
    rng = np.random.default_rng(0)
    ids, mask = left_pad([rng.integers(3, tiny.config.vocab_size, n).tolist() for n in (200, 137)],
                         pad_id=tiny.config.pad_token_id)
    real = mask.astype(bool)
    out = {rt: Decoding(make(rt)).feed(ids, mask) for rt in ("onnx-reference", "ort", "torch")}
    tol = Tolerances().for_kind("logits")
    got = out["onnx-reference"]
    for against in ("ort", "torch"):
        ref = out[against]
        logits = compare(to_numpy(got.logits)[real], to_numpy(ref.logits)[real], "logits", tol)
        assert logits.passed and logits.top1 == 1.0, (against, logits.reason)
        assert logits.max_abs < 1e-4, against
        assert set(got.state) == set(ref.state)
        for name, value in ref.state.items():
            m = compare(to_numpy(got.state[name]), to_numpy(value), name, tol)
            assert m.passed and m.max_abs < 1e-4, (against, name, m.reason)


def test_the_reference_gather_elements_is_the_standards(tmp_path):
    """The evaluator's own GatherElements against the standard's definition written as a loop, on axes past onnx's
    63-entry limit, negative indices and axis, an index tensor smaller than the data off its axis, inside a
    model-local function (whose body the evaluator builds itself), and against onnx's own op within its limit."""
    import onnx
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    from k3export.runtime.reference_runner import _evaluator_class

    def by_definition(data, idx, axis):
        out = np.empty(idx.shape, data.dtype)
        for pos in np.ndindex(idx.shape):
            src = list(pos)
            src[axis] = idx[pos] % data.shape[axis]
            out[pos] = data[tuple(src)]
        return out

    def model(axis, rank, in_function):
        x, i = (helper.make_tensor_value_info(n, t, [None] * rank) for n, t in
                (("x", TensorProto.FLOAT), ("i", TensorProto.INT64)))
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * rank)
        opsets = [helper.make_opsetid("", 18)]
        if not in_function:
            node = helper.make_node("GatherElements", ["x", "i"], ["y"], axis=axis)
            return helper.make_model(helper.make_graph([node], "g", [x, i], [y]), opset_imports=opsets)
        body = helper.make_function("local", "gather", ["x", "i"], ["y"],
                                    [helper.make_node("GatherElements", ["x", "i"], ["y"], axis=axis)], opsets)
        node = helper.make_node("gather", ["x", "i"], ["y"], domain="local")
        return helper.make_model(helper.make_graph([node], "g", [x, i], [y]), functions=[body],
                                 opset_imports=[*opsets, helper.make_opsetid("local", 1)])

    rng = np.random.default_rng(0)
    cases = [((2, 203, 12), (2, 3, 12), 1), ((2, 203, 12), (2, 3, 12), -2), ((150, 5), (150, 16), 1),
             ((4, 70, 9), (3, 70, 5), 0), ((5, 7), (5, 20), -1)]
    for shape, ishape, axis in cases:
        data = rng.standard_normal(shape).astype(np.float32)
        n = shape[axis]
        idx = rng.integers(-n, n, ishape)
        want = by_definition(data, idx, axis)
        for in_function in (False, True):
            m = model(axis, len(shape), in_function)
            onnx.checker.check_model(m)
            (got,) = _evaluator_class()(m).run(None, {"x": data, "i": idx})
            np.testing.assert_array_equal(got, want, err_msg=f"{shape} {ishape} axis {axis} fn {in_function}")
    data, idx = rng.standard_normal((3, 40, 6)).astype(np.float32), rng.integers(-40, 40, (3, 4, 6))
    (theirs,) = ReferenceEvaluator(model(1, 3, False)).run(None, {"x": data, "i": idx})
    (ours,) = _evaluator_class()(model(1, 3, False)).run(None, {"x": data, "i": idx})
    np.testing.assert_array_equal(ours, theirs)
