"""Graph forms (`k3export.converters.onnx.forms`) against each ONNX consumer, the PyTorch model as the reference.

The inlined form (k3 functions inlined, no ``If``, no sequences, no ``Unique``) is run by OpenVINO and the ONNX
reference evaluator and parsed by TensorRT-RTX's ONNX parser; the standard form is the same with KDA in the opset-27
ops ``LinearAttention`` and ``CausalConvWithState`` (ONNX Runtime and the reference evaluator); the default form
keeps the k3 functions for ONNX Runtime. The last tests pin down what each consumer fails on, the reasons the forms
are written as they are: if one of them starts to fail, that consumer changed, and `forms.READERS` (who reads what) is to be measured again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from k3export.artifacts.graph_forms import inline_fused
from k3export.converters.onnx import export_onnx
from k3export.converters.onnx.forms import FORMS, FUNCTIONS, INLINED, ORT, READERS, STANDARD, GraphForm, readable
from k3export.errors import K3ExportError
from k3export.runtime import Target, TorchRunner, make_runner, to_numpy
from k3export.validate import make_scenarios, validate

ov = pytest.importorskip("openvino")

#: ops the standard and inlined forms leave out (TensorRT's parser has no sequences and no Unique; OpenVINO mis-runs
#: If)
NOT_STANDARD = {"If", "Unique", "SequenceEmpty", "SequenceInsert", "ConcatFromSequence", "SplitToSequence"}


def _nodes(model: onnx.ModelProto):
    """Every node of `model`: the graph's, its functions', and those of every subgraph in them."""
    def walk(nodes):
        for n in nodes:
            yield n
            for a in n.attribute:
                for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    yield from walk(g.node)

    yield from walk(model.graph.node)
    for f in model.functions:
        yield from walk(f.node)


def _graph(folder: Path) -> onnx.ModelProto:
    return onnx.load(str(folder / "model.onnx"), load_external_data=False)


@pytest.fixture(scope="module")
def dense(tiny_k3, tmp_path_factory) -> dict[str, Path]:
    """The tiny K3's fp32 export in each graph form."""
    root = tmp_path_factory.mktemp("forms")
    for form in FORMS:
        export_onnx(tiny_k3, root / form, dtype="fp32", form=form)
    return {form: root / form for form in FORMS}


@pytest.fixture(scope="module")
def mxfp4(released_random, tmp_path_factory) -> dict[str, Path]:
    """The released-layout tiny checkpoint exported with its MXFP4 experts (other weights fp32), in the forms that
    the tests here hand to a consumer (the standard one has the inlined one's experts)."""
    root = tmp_path_factory.mktemp("forms_mxfp4")
    forms = (FUNCTIONS.name, INLINED.name)
    for form in forms:
        export_onnx(str(released_random), root / form, dtype="fp32", experts="mxfp4", form=form)
    return {form: root / form for form in forms}


@pytest.fixture(scope="module")
def torch_of(tiny_k3):
    """The PyTorch model of each export family the tests here run (MXFP4 experts on OpenVINO:
    tests/runtime/test_openvino_reference.py)."""
    return {"dense": TorchRunner(tiny_k3)}


def _validate(reference, runner, vocab: int, steps: int):
    result = validate(reference, [runner], make_scenarios(vocab, prompt_len=16, steps=steps, which=("decode",)))
    assert result.passed, result.localisation
    (run,) = result.runs
    assert run.steps_run == steps and all(run.greedy)
    return run


# ---------------------------------------------------------------------------------------------- the forms
def test_each_form_is_written_and_recorded_as_named(dense, tiny_k3, tmp_path):
    for form, folder in dense.items():
        assert json.loads((folder / "runtime_config.json").read_text())["graph_form"] == form
        model = _graph(folder)
        ops = [(n.domain, n.op_type) for n in _nodes(model)]
        loops = [n for n in _nodes(model) if n.op_type == "Loop"]
        # a Loop's optional cond is always given: the reference evaluator runs no iteration without it, and
        # TensorRT's parser rejects the empty input name (test_a_loop_without_cond_..., below)
        assert loops and all(len(n.input) > 1 and n.input[1] for n in loops), form
        kda = sum(t == "kda" for t in tiny_k3.config.attn_types)
        mla = len(tiny_k3.config.attn_types) - kda
        counts = {op: sum(o == op for _, o in ops) for op in ("LinearAttention", "CausalConvWithState", "Attention",
                                                              "GatedDeltaNet")}
        if form in (STANDARD.name, INLINED.name):
            assert not model.functions and {o.domain for o in model.opset_import} == {""}
            assert not {op for _, op in ops} & NOT_STANDARD and all(d == "" for d, _ in ops)
            # the standard form: each KDA layer's recurrence and short convs are one opset-27 op each, each MLA
            # layer's attention one Attention
            want = {"LinearAttention": kda, "CausalConvWithState": kda, "Attention": mla, "GatedDeltaNet": 0}
            assert kda and mla and counts == (want if form == STANDARD.name else dict.fromkeys(want, 0)), (form, counts)
        elif form == ORT.name:
            # ONNX Runtime's ops: each KDA core an If on the call's length, one com.microsoft GatedDeltaNet (its
            # gate K3's) for one token, the k3 kda op (its chunked body) for more; its short convs one
            # com.microsoft CausalConvWithState and its output norm and gate one GatedRMSNorm, each MLA layer's
            # attention one Attention (in the If that takes long prompts in query blocks, both branches); the
            # other k3 ops keep their bodies
            assert counts == {"LinearAttention": 0, "CausalConvWithState": kda, "Attention": 2 * mla,
                              "GatedDeltaNet": kda}, counts
            contrib = [n for n in _nodes(model) if n.op_type in ("GatedDeltaNet", "CausalConvWithState",
                                                                  "GatedRMSNorm")]
            assert len(contrib) == 3 * kda and {n.domain for n in contrib} == {"com.microsoft"}
            assert ("com.microsoft", 1) in {(o.domain, o.version) for o in model.opset_import}
            gdn = [n for n in contrib if n.op_type == "GatedDeltaNet"]
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gdn[0].attribute}
            assert attrs["gate_activation"] == b"kda" and attrs["gate_lower_bound"] == -5.0 and attrs["qk_l2_norm"] == 1
            assert {"moe_experts", "moe_route", "situ_glu"} <= {op for d, op in ops if d == "k3"}
            branch = {n.name: {a.name: [(x.domain, x.op_type) for x in a.g.node] for a in n.attribute if a.g.node}
                      for n in _nodes(model) if n.op_type == "If"}
            kda_ifs = [b for b in branch.values() if ("com.microsoft", "GatedDeltaNet") in b["then_branch"]]
            assert len(kda_ifs) == kda and all([op for op in b["else_branch"] if op[0] == "k3"] == [("k3", "kda")]
                                               for b in kda_ifs)
            # GatedDeltaNet's state is the export's (V-major, as the manifest says): decode transposes nothing
            assert not any(op == ("", "Transpose") for b in kda_ifs for op in b["then_branch"])
            assert sum(op == ("k3", "kda") for op in ops) == kda
        else:
            assert {"kda", "moe_experts", "moe_route", "situ_glu"} <= {f.name for f in model.functions}
            assert ("k3", "kda") in ops and ("", "If") in ops
        recurrent = [s for s in json.loads((folder / "state_manifest.json").read_text())["states"]
                     if s["kind"] == "recurrent_state"]
        assert recurrent and all(s.get("axes") == ([0, 1, 3, 2] if form == ORT.name else None) for s in recurrent)
    with pytest.raises(K3ExportError, match="unknown graph form 'fast'; choose one of functions, standard, inlined, ort"):
        export_onnx(tiny_k3, tmp_path / "x", dtype="fp32", form="fast")
    edited = Path(shutil.copytree(dense["standard"], tmp_path / "edited"))
    rc = json.loads((edited / "runtime_config.json").read_text())
    (edited / "runtime_config.json").write_text(json.dumps({**rc, "graph_form": "fast"}))
    with pytest.raises(K3ExportError, match="graph_form.*'fast'"):
        make_runner("ort", Target(onnx_dir=edited))


# ---------------------------------------------------------------------------------------------- consumers vs PyTorch
@pytest.mark.parametrize("form", list(FORMS))
def test_reference_evaluator_logits_equal_pytorch(dense, torch_of, tiny_k3, form):
    if form not in readable("onnx-reference"):  # the ort form: com.microsoft's GatedDeltaNet is no standard op
        with pytest.raises(K3ExportError, match=f"onnx-reference cannot read .*graph form '{form}'.*needs graph form"):
            make_runner("onnx-reference", Target(onnx_dir=dense[form]))
        return
    runner = make_runner("onnx-reference", Target(onnx_dir=dense[form]))
    _validate(torch_of["dense"], runner, tiny_k3.config.vocab_size, steps=4)


@pytest.mark.parametrize("form", list(FORMS))
def test_onnx_runtime_runs_each_dense_form_it_is_said_to_read(dense, torch_of, tiny_k3, form):
    """`forms.READERS` against ONNX Runtime on the dense export: every form it claims runs as PyTorch does."""
    from k3export.converters.onnx.forms import readable

    assert form in readable("ort", "dense")  # if a form is dropped from the table, say here why
    runner = make_runner("ort", Target(onnx_dir=dense[form]))
    _validate(torch_of["dense"], runner, tiny_k3.config.vocab_size, steps=8)


#: what a user without k3export runs: a bare ``onnxruntime.InferenceSession(model.onnx)`` (default options, no k3
#: library), fed the manifest's inputs (zero states shaped from its JSON), a prefill and greedy decode steps with the
#: presents fed back; k3export cannot be imported
_BARE_SESSION = """
import importlib.abc, json, sys
from pathlib import Path

class NoK3(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("k3export", "k3export_cli"):
            raise ImportError("k3export is blocked here: " + name)

sys.meta_path.insert(0, NoK3())
import numpy as np
import onnxruntime as ort

folder, ids, steps, out = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
manifest = json.loads((folder / "state_manifest.json").read_text())
session = ort.InferenceSession(str(folder / "model.onnx"))
state = {s["name"]: np.zeros([1 if d == "batch" else 0 if isinstance(d, str) else d for d in s["shape"]], s["dtype"])
         for s in manifest["states"]}
ids = np.asarray([ids], np.int64)
seen, got, fed = ids.shape[1], [], []
for step in range(steps):
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, seen), np.int64), **state}
    logits, *new = session.run(["logits", *[s["present"] for s in manifest["states"]]], feeds)
    got.append(logits[0, -1])
    state = dict(zip(state, new))
    ids = logits[:, -1:].argmax(-1)
    fed.append(int(ids[0, 0]))
    seen += 1
assert not [m for m in sys.modules if m.split(".")[0] == "k3export"]
np.savez(out, logits=np.stack(got), fed=np.asarray(fed))
"""


@pytest.mark.parametrize("form", [STANDARD.name, ORT.name])
def test_a_bare_onnx_runtime_session_without_k3export_gives_the_models_logits(dense, torch_of, tiny_k3, form,
                                                                               tmp_path):
    """`_BARE_SESSION` in a subprocess that cannot import k3export, on the standard and ort forms: PyTorch's logits
    at every step of a prefill and greedy decode."""
    import subprocess
    import sys

    ids = np.random.default_rng(61).integers(3, tiny_k3.config.vocab_size, (1, 12))
    out = tmp_path / "bare.npz"
    done = subprocess.run([sys.executable, "-c", _BARE_SESSION, str(dense[form]), json.dumps(ids[0].tolist()), "5",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = np.load(out)
    want = torch_of["dense"].prefill(ids)
    for step, logits in enumerate(got["logits"]):
        np.testing.assert_allclose(logits, to_numpy(want.logits)[0, -1], atol=1e-4, rtol=0, err_msg=f"step {step}")
        want = torch_of["dense"].prefill(got["fed"][step:step + 1][None], want)


def test_plain_onnx_runtime_runs_the_ort_forms_attention_and_gated_delta_net_as_kernels(dense, tmp_path):
    """The ort form is written at opset 24: ONNX Runtime 1.32's CPU ``Attention`` kernel takes ``Attention-23/24``
    only, and runs ``Attention-25`` (opset >= 25: the standard form) as its function body. Both forms' KDA and MLA
    ops in a decode call, as a plain session runs them (its profiler's kernels)."""
    import onnxruntime as ort

    def kernels(form):
        manifest = json.loads((dense[form] / "state_manifest.json").read_text())
        options = ort.SessionOptions()
        options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / form)
        session = ort.InferenceSession(str(dense[form] / "model.onnx"), options)
        state = {s["name"]: np.zeros([1 if d == "batch" else 0 if isinstance(d, str) else d for d in s["shape"]],
                                     s["dtype"]) for s in manifest["states"]}
        session.run(["logits"], {"input_ids": np.asarray([[5]]), "attention_mask": np.ones((1, 1), np.int64),
                                 **state})  # one token: the ort form's GatedDeltaNet branch
        events = json.loads(Path(session.end_profiling()).read_text())
        return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}

    model = _graph(dense[ORT.name])
    assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {ORT.opset} == {24}
    assert {"Attention", "GatedDeltaNet"} <= kernels(ORT.name)
    standard = kernels(STANDARD.name)
    assert not {"Attention", "LinearAttention", "CausalConvWithState"} & standard and "Scan" in standard


#: the most nodes a plain session may run in a decode step of the tiny model's ort form (482 on ONNX Runtime 1.32;
#: 498 before the state was kept V-major, 682 before its contrib norms, convs and aggregates and the bodies'
#: few-token path; big_cfg: 631, docs/speed.md)
ORT_FORM_DECODE_NODES = 490


def test_a_plain_session_decodes_the_ort_form_in_few_nodes_with_the_models_logits(dense, torch_of, tiny_k3, tmp_path):
    """A bare ``InferenceSession`` (default options) on the ort form: the nodes its profiler shows in one decode
    step (an ``If``'s taken branch counted as well as the ``If``) stay within `ORT_FORM_DECODE_NODES`, and the
    step's logits are PyTorch's."""
    import onnxruntime as ort

    folder = dense[ORT.name]
    manifest = json.loads((folder / "state_manifest.json").read_text())
    options = ort.SessionOptions()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "ort-form")
    session = ort.InferenceSession(str(folder / "model.onnx"), options)
    state = {s["name"]: np.zeros([1 if d == "batch" else 0 if isinstance(d, str) else d for d in s["shape"]],
                                 s["dtype"]) for s in manifest["states"]}
    ids = np.random.default_rng(63).integers(3, tiny_k3.config.vocab_size, (1, 9))
    presents = [s["present"] for s in manifest["states"]]
    for past, part in ((0, ids[:, :8]), (8, ids[:, 8:])):  # a prefill, then one decode step
        logits, *new = session.run(["logits", *presents], {"input_ids": part, "attention_mask": np.ones(
            (1, past + part.shape[1]), np.int64), **state})
        state = dict(zip(state, new))
    events = json.loads(Path(session.end_profiling()).read_text())
    step = [e for e in events if e.get("name") == "model_run"][-1]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
             and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
    assert 100 < len(nodes) <= ORT_FORM_DECODE_NODES, len(nodes)
    want = torch_of["dense"].prefill(ids)
    np.testing.assert_allclose(logits[0, -1], to_numpy(want.logits)[0, -1], atol=1e-4, rtol=0)


def _as_contract(entry: dict, x: np.ndarray) -> np.ndarray:
    """A state as the export keeps it, read in the contract's order through its manifest entry's ``axes``."""
    return x if entry.get("axes") is None else x.transpose(np.argsort(entry["axes"]))


@pytest.mark.parametrize("form", [STANDARD.name, ORT.name, "functions"])
def test_the_standard_forms_kda_states_skip_right_padding(dense, torch_of, tiny_k3, form):
    """A right-padded row (onnxruntime-genai's batches): its conv and recurrent states after the call are PyTorch's
    for the row without its padding (the conv state is the window at the last real token, not the op's own
    present, which ends at the padding; the ort form gets gate and beta logits of -1e30 there). fp32 through four
    layers: the chunked kda body (the functions form; the ort form's prefill) ends 1-2e-5 from PyTorch's states,
    LinearAttention-27's recurrence 7.5e-6; the states of the row with its padding are 1-6 off."""
    import onnxruntime as ort

    folder = dense[form]
    manifest = json.loads((folder / "state_manifest.json").read_text())
    session = ort.InferenceSession(str(folder / "model.onnx"))
    kda = [s for s in manifest["states"] if s["kind"] in ("conv_state", "recurrent_state")]
    state = {s["name"]: np.zeros([2 if d == "batch" else 0 if isinstance(d, str) else d for d in s["shape"]],
                                 s["dtype"]) for s in manifest["states"]}
    ids = np.random.default_rng(62).integers(3, tiny_k3.config.vocab_size, (2, 7))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0  # row 1: four real tokens, then three of padding
    got = dict(zip([s["present"] for s in kda], session.run([s["present"] for s in kda],
                                                            {"input_ids": ids, "attention_mask": mask, **state})))
    want = torch_of["dense"].prefill(ids[1:, :4]).state
    assert len(kda) == 2 * sum(t == "kda" for t in tiny_k3.config.attn_types)
    for s in kda:
        np.testing.assert_allclose(_as_contract(s, got[s["present"]][1:]), to_numpy(want[s["name"]]), atol=5e-5,
                                   rtol=0, err_msg=s["name"])


@pytest.mark.parametrize("form", [STANDARD.name, ORT.name, "functions"])
def test_a_padded_decode_token_leaves_the_kda_states_alone(dense, torch_of, tiny_k3, form):
    """A one-token call (the ort form's decode path: GatedDeltaNet, the conv op's own present) in which row 1's
    token is padding: row 1's conv and recurrent states come out as they went in, row 0's are PyTorch's after its
    five tokens."""
    import onnxruntime as ort

    folder = dense[form]
    manifest = json.loads((folder / "state_manifest.json").read_text())
    session = ort.InferenceSession(str(folder / "model.onnx"))
    presents = [s["present"] for s in manifest["states"]]
    state = {s["name"]: np.zeros([2 if d == "batch" else 0 if isinstance(d, str) else d for d in s["shape"]],
                                 s["dtype"]) for s in manifest["states"]}
    ids = np.random.default_rng(64).integers(3, tiny_k3.config.vocab_size, (2, 5))
    mask = np.ones_like(ids)
    state = dict(zip(state, session.run(presents, {"input_ids": ids[:, :4], "attention_mask": mask[:, :4], **state})))
    mask[1, 4] = 0
    got = dict(zip(state, session.run(presents, {"input_ids": ids[:, 4:], "attention_mask": mask, **state})))
    want = torch_of["dense"].prefill(ids[:1]).state
    kda = [s for s in manifest["states"] if s["kind"] in ("conv_state", "recurrent_state")]
    assert kda
    for s in kda:
        name = s["name"]
        np.testing.assert_array_equal(got[name][1], state[name][1], err_msg=name)
        np.testing.assert_allclose(_as_contract(s, got[name][:1]), to_numpy(want[name]), atol=5e-5, rtol=0,
                                   err_msg=name)


@pytest.mark.parametrize("form,consumer", [(STANDARD.name, "ort"), (STANDARD.name, "onnx-reference"),
                                           (ORT.name, "ort")])
def test_the_standard_forms_mla_attention_hides_padding(dense, torch_of, tiny_k3, form, consumer):
    """``Attention`` under the padding mask, with a past: a left-padded row (its padding rows see no key at all) and
    a right-padded one give, at their last real token, PyTorch's logits for the row without its padding, in the
    prefill and in a decode step after it (the mask then aligned to the past, not the top left)."""
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    folder = dense[form]
    manifest = json.loads((folder / "state_manifest.json").read_text())
    if consumer == "ort":
        session = ort.InferenceSession(str(folder / "model.onnx"))
        run = session.run
    else:
        run = ReferenceEvaluator(onnx.load(str(folder / "model.onnx"))).run
    presents = [s["present"] for s in manifest["states"]]
    state = {s["name"]: np.zeros([2 if d == "batch" else 0 if isinstance(d, str) else d for d in s["shape"]],
                                 s["dtype"]) for s in manifest["states"]}
    ids = np.random.default_rng(63).integers(3, tiny_k3.config.vocab_size, (2, 9))
    mask = np.ones_like(ids)
    mask[0, :3] = 0  # row 0: three padding tokens, then six real ones
    mask[1, 5:] = 0  # row 1: five real tokens, then four of padding
    logits, *new = run(["logits", *presents], {"input_ids": ids, "attention_mask": mask, **state})
    want = [torch_of["dense"].prefill(ids[:1, 3:]), torch_of["dense"].prefill(ids[1:, :5])]
    np.testing.assert_allclose(logits[0, -1], to_numpy(want[0].logits)[0, -1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[1, 4], to_numpy(want[1].logits)[0, -1], atol=1e-4, rtol=0)
    # row 0 decodes on; row 1's step is padding too (its state must carry through unchanged for the next)
    step = np.asarray([[7], [7]])
    mask = np.concatenate([mask, [[1], [0]]], axis=1)
    logits, *_ = run(["logits", *presents], {"input_ids": step, "attention_mask": mask,
                                             **dict(zip(state, new))})
    np.testing.assert_allclose(logits[0, -1], to_numpy(torch_of["dense"].prefill(step[:1], want[0]).logits)[0, -1],
                               atol=1e-4, rtol=0)


def test_openvino_greedy_tokens_over_32_steps_equal_pytorch(dense, torch_of):
    """The dense export; MXFP4 experts: tests/runtime/test_openvino_reference.py."""
    runner = make_runner("openvino", Target(onnx_dir=dense["inlined"]))
    _validate(torch_of["dense"], runner, torch_of["dense"].model.config.vocab_size, steps=32)


def _trt_parse(folder: Path, edit=None):
    """(parsed, network layers, network outputs, the parser's errors) of TensorRT-RTX's ONNX parser on `folder`
    (`edit`: on its graph edited by `edit`, weights still read from the folder)."""
    from k3export.plugins.flavour import TensorRTUnavailable, load_flavour

    try:  # through the flavour, which loads the parser where it finds the plugin registry (tests/engines builds)
        trt = load_flavour("tensorrt_rtx").trt
    except TensorRTUnavailable as exc:
        pytest.skip(str(exc))
    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    network = trt.Builder(logger).create_network(0)
    parser = trt.OnnxParser(network, logger)
    path = folder / "model.onnx"
    if edit is None:
        ok = parser.parse_from_file(str(path))
    else:
        ok = parser.parse(edit(onnx.load(str(path), load_external_data=False)).SerializeToString(), str(path))
    errors = [f"{parser.get_error(i).node_operator()}: {parser.get_error(i).desc()}" for i in range(parser.num_errors)]
    return ok, network.num_layers, network.num_outputs, errors


def test_tensorrt_rtx_parser_reads_the_inlined_form(dense, mxfp4):
    ok, layers, outputs, errors = _trt_parse(dense["inlined"])
    assert ok and not errors and layers > 1000
    assert outputs == len(_graph(dense["inlined"]).graph.output)
    # the functions form, its fused ops' bodies inlined as TensorRT's build does first (`inline_fused`; no plugin of
    # theirs): the parser expands the k3 functions itself (no plugins registered here) and stops at the routed
    # experts' tensor sequence, which the inlined form carries in a tensor. As written, it fails sooner (a body it
    # expands inside another's).
    ok, _, _, errors = _trt_parse(dense["functions"], inline_fused)
    assert not ok and any(e.startswith(("ConcatFromSequence", "SequenceEmpty", "Unique")) for e in errors), errors
    assert not _trt_parse(dense["functions"])[0]
    # MXFP4 experts: the parser imports no FLOAT8E8M0 initializer (TensorRT runs them through the k3 plugin)
    ok, _, _, errors = _trt_parse(mxfp4["inlined"])
    assert not ok and "weight_scale" in " ".join(errors), errors
    # the standard form: the parser has no native CausalConvWithState / LinearAttention layer and looks for a
    # plugin of that name (TensorRT keeps the k3 plugins of the functions form)
    ok, _, _, errors = _trt_parse(dense["standard"])
    assert not ok and errors[0].startswith(("CausalConvWithState", "LinearAttention")) and "plugin" in errors[0], errors
    # read, not built: TensorRT-RTX's builder stops on this graph (tests/engines, which builds each form)
    assert READERS["trt"] == (("functions",), ("functions",), ("functions",))


# ---------------------------------------------------------------------------------------------- refusals
def _cli(*args) -> tuple[int, str]:
    from typer.testing import CliRunner

    from k3export_cli.main import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


def test_validate_refuses_a_form_the_runtime_cannot_read(dense, mxfp4, tiny_k3, released_random, tmp_path,
                                                         monkeypatch):
    from k3export.modeling import save_pretrained

    monkeypatch.setenv("K3EXPORT_OV_EXT", "0")  # OpenVINO without its k3 extension library (with it: both forms)

    save_pretrained(tiny_k3, tmp_path / "m")
    cases = [(released_random, mxfp4["functions"], "openvino", "openvino-inlined cannot read .*MXFP4 experts.*needs "
                                                               "graph form 'inlined'.*--form inlined"
                                                               ".*K3EXPORT_OV_EXT=0"),
             (released_random, mxfp4["inlined"], "ort", "ort cannot read .*MXFP4 experts.*needs graph form "
                                                        "'functions'"),
             (tmp_path / "m", dense["standard"], "openvino", "openvino cannot read .*graph form 'standard'.*needs "
                                                             "graph form 'inlined'; export again with --form inlined"),
             (released_random, mxfp4["functions"], "onnx-reference", "onnx-reference cannot read .*reads MXFP4 "
                                                                     "experts in no graph form; export with "
                                                                     "--experts dense")]
    for model, export, runtime, words in cases:
        code, out = _cli("validate", model, "--onnx", export, "--runtimes", runtime, "--steps", "1")
        lines = [line for line in out.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (runtime, out)
        assert __import__("re").search(words, lines[0]), (runtime, lines[0])


def test_export_refuses_a_form_and_experts_no_runtime_reads(released_random, tmp_path):
    """MXFP4 experts in the standard form: ORT needs functions for them, OpenVINO the inlined form, the reference
    evaluator dense experts, so the export is refused before it writes anything."""
    code, out = _cli("export", released_random, tmp_path / "x", "--form", "standard", "--experts", "mxfp4")
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, out
    assert "no runtime reads graph form 'standard' with mxfp4 experts: export with --form functions or --form " \
           "inlined" in lines[0], lines[0]
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------- what consumers fail on
def test_openvino_expands_no_model_local_function(dense):
    with pytest.raises(RuntimeError, match="No conversion rule found for operations: k3.attn_res_aggregate"):
        ov.Core().read_model(str(dense["functions"] / "model.onnx"))


def test_openvino_reads_neither_opset_27_op_of_the_standard_form(dense):
    """OpenVINO 2026.4 converts neither ``LinearAttention-27`` nor ``CausalConvWithState-27`` (so it reads the
    inlined form, `forms.READERS`); when it does, this fails and the table is to be measured again."""
    with pytest.raises(RuntimeError, match="No conversion rule found for operations: .*(CausalConvWithState-27, "
                                           "LinearAttention-27|LinearAttention-27, CausalConvWithState-27)"):
        ov.Core().read_model(str(dense["standard"] / "model.onnx"))
    assert STANDARD.name not in READERS["openvino"][0] + READERS["openvino-k3ext"][0]


def test_openvino_mis_runs_if_unless_its_output_is_a_graph_output(tiny_k3, torch_of, tmp_path):
    """The functions inlined, ``If`` kept (no sequences, no Unique, which OpenVINO runs): every logit of a 16-token
    prefill is wrong; the same graph with each ``If``'s outputs also made graph outputs is right. So the inlined
    form has no ``If``."""
    from k3export.artifacts import load_export
    from k3export.runtime import SessionRunner
    from k3export.runtime.openvino_session import OpenVinoSession

    form = GraphForm("inlined", functions=False, branches=True, sequences=False, unique=False, summary="")
    folder = tmp_path / "branches"
    export_onnx(tiny_k3, folder, dtype="fp32", form=form)
    model = _graph(folder)
    ifs = [o for n in model.graph.node if n.op_type == "If" for o in n.output]
    assert ifs
    model.graph.output.extend(onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in ifs)
    onnx.save(model, str(folder / "exposed.onnx"))

    class Session(OpenVinoSession):  # the manifest's outputs only
        def __init__(self, path):
            super().__init__(path)
            self.output_names = [o for o in self.output_names if o not in ifs]

    ids = np.random.default_rng(16).integers(3, tiny_k3.config.vocab_size, (1, 16))
    want = to_numpy(torch_of["dense"].prefill(ids).logits)
    export = load_export(folder)
    wrong = to_numpy(SessionRunner(export, OpenVinoSession(export.model_path)).prefill(ids).logits)
    right = to_numpy(SessionRunner(export, Session(folder / "exposed.onnx")).prefill(ids).logits)
    assert not np.allclose(wrong, want, atol=1e-2)  # NaN here (OpenVINO 2026.4)
    np.testing.assert_allclose(right, want, atol=1e-4, rtol=0)


def test_openvino_dequantises_no_dynamically_shaped_mxfp4_block(released_random, tmp_path, monkeypatch):
    """An expert cropped from its 4-bit stack by ``Pad`` and squeezed (dynamic shape) is refused; the graph's
    ``Reshape`` to the stack's own [out, in] (`bodies.mxfp4_expert`) is what OpenVINO reads."""
    from k3export.converters.onnx import bodies

    def dynamic_crop(b, weight, e, like):
        packed, scale = weight
        e1 = b.op("Unsqueeze", [e, b.const([0])])
        n = b.op("Slice", [b.op("Shape", [packed]), b.const([0]), b.const([1])])
        pads = b.op("Concat", [b.op("Neg", [e1]), b.op("Sub", [b.op("Add", [e1, b.const([1])]), n])], axis=0)
        w, s = (b.op("Squeeze", [b.op("Pad", [x, pads, "", b.const([0])]), b.const([0])]) for x in (packed, scale))
        return b.op("CastLike", [b.op("DequantizeLinear", [w, s], axis=-1, block_size=32,
                                      output_dtype=onnx.TensorProto.FLOAT), like])

    monkeypatch.setattr(bodies, "mxfp4_expert", dynamic_crop)
    export_onnx(str(released_random), tmp_path / "dyn", dtype="fp32", experts="mxfp4", form="inlined")
    with pytest.raises(RuntimeError, match="Conversion is failed for: DequantizeLinear"):
        ov.Core().read_model(str(tmp_path / "dyn" / "model.onnx"))


def test_mxfp4_inlined_form_is_read_by_neither_ort_nor_the_reference_evaluator(mxfp4):
    """ONNX Runtime's CPU ``Pad`` takes no FLOAT4E2M1 (its sessions rewrite the k3 ``moe_experts`` function into
    8 bits instead, which the inlined form has inlined); the reference evaluator's ``Pad`` takes no negative
    pads (the crop of one expert)."""
    import onnxruntime as ort

    from k3export.artifacts import load_export
    from k3export.runtime import SessionRunner
    from k3export.runtime.reference_runner import ReferenceSession

    with pytest.raises(Exception, match="Pad"):
        ort.InferenceSession(str(mxfp4["inlined"] / "model.onnx"), providers=["CPUExecutionProvider"])
    export = load_export(mxfp4["inlined"])
    runner = SessionRunner(export, ReferenceSession(export.model_path))
    with pytest.raises(ValueError, match="negative"):
        runner.prefill(np.array([[5, 6, 7]]))
    assert READERS["ort"][1] == ("functions",) and READERS["onnx-reference"][1] == ()


def test_a_loop_without_cond_is_what_the_reference_evaluator_and_tensorrt_fail_on(dense, tmp_path):
    """The Loops of the inlined form with their optional cond left out (as the graph had them before): the
    reference evaluator runs no iteration and fails concatenating none, TensorRT's parser finds the empty name
    unregistered. Both read the same graph with cond given (tests above)."""
    from k3export.artifacts import load_export
    from k3export.runtime import SessionRunner
    from k3export.runtime.reference_runner import ReferenceSession

    folder = Path(shutil.copytree(dense["inlined"], tmp_path / "no_cond"))
    model = _graph(folder)
    for n in _nodes(model):
        if n.op_type == "Loop":
            n.input[1] = ""
    onnx.save(model, str(folder / "model.onnx"))
    export = load_export(folder)
    with pytest.raises(ValueError, match="need at least one array to concatenate"):
        SessionRunner(export, ReferenceSession(export.model_path)).prefill(np.array([[5, 6, 7]]))
    ok, _, _, errors = _trt_parse(folder)
    assert not ok and any("Node input was not registered" in e for e in errors), errors
