"""OpenVINO and the ONNX reference evaluator as runtimes: in the one registry that `validate` and `generate` read,
through every validation scenario ONNX Runtime passes (prefill, decode steps, chunked prefill, a batch), against
the PyTorch model within the fp32 tolerances, per-layer hidden states included."""

import pytest

from k3export.runtime import RUNNERS, RuntimeUnavailable, Target, TorchRunner, make_runner
from k3export.validate import Tolerances, make_scenarios, validate

#: decode steps per runtime: the reference evaluator runs numpy one node at a time (slow: few steps)
STEPS = {"openvino": 16, "onnx-reference": 4}


def test_validate_and_generate_take_both_from_the_registry():
    from cli.generate import RUNTIMES as GENERATE
    from k3export.validate.api import RUNTIMES as VALIDATE

    for name in ("openvino", "onnx-reference"):
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


@pytest.fixture(scope="module")
def mxfp4_standard(released_random, tmp_path_factory):
    """The released-layout tiny checkpoint (MXFP4 experts) exported keeping them, in the standard form."""
    from k3export.converters.onnx import export_onnx

    out = tmp_path_factory.mktemp("openvino_mxfp4") / "onnx"
    export_onnx(str(released_random), out, dtype="fp32", experts="mxfp4", form="standard")
    return out


def test_openvino_runs_mxfp4_experts_as_pytorch_over_32_decode_steps(released_random, mxfp4_standard):
    """OpenVINO on the MXFP4 experts as the file keeps them (FLOAT4E2M1 / FLOAT8E8M0 ``DequantizeLinear`` of the
    selected experts), against the PyTorch model of the same checkpoint (its experts decoded): greedy tokens over
    prefill + 32 decode steps, logits and hidden states within the fp32 tolerances."""
    pytest.importorskip("openvino")
    import onnx

    from k3export.converters.onnx.forms import has_mxfp4

    folder = mxfp4_standard
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
