"""MXFP4 experts in ONNX exports (issue 14): the checkpoint's bytes in the file, the standard FP4 form against the
ONNX reference evaluator, ONNX Runtime's 9-bit form (rewritten per session, or persisted by ``--genai`` and
checked by `load_export`) against the dequantised fp32 export, bytes by form."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

ort = pytest.importorskip("onnxruntime")

from checkpoint_bytes import mxfp4_bytes  # noqa: E402
from k3export.artifacts import load_export  # noqa: E402
from k3export.converters.checkpoints.mxfp4 import decode_mxfp4  # noqa: E402
from k3export.converters.checkpoints.synthetic import released_tiny_config, write_checkpoint  # noqa: E402
from k3export.converters.onnx import export_onnx  # noqa: E402
from k3export.artifacts.expert_views import Q8_SCALE, q8_from_packed  # noqa: E402
from k3export.converters.onnx.bodies import moe_experts_function  # noqa: E402
from k3export.converters.onnx.mxfp4 import has_mxfp4, ort_model, ort_moe_function, resolve_experts  # noqa: E402
from k3export.converters.onnx.weights import CheckpointSource  # noqa: E402
from k3export.errors import ExportError  # noqa: E402
from onnx_reference_ops import Pad  # noqa: E402
from k3export.info import weight_bytes_by_form  # noqa: E402
from k3export.modeling import K3Config  # noqa: E402
from k3export.runtime.ort_session import ort_session  # noqa: E402

PROMPT, DECODE = [3, 17, 9, 42, 5, 11, 60, 2, 33, 21, 8, 1], 8


def export(src, out: Path, experts: str | None = None, dtype: str = "fp32", weights: bool = True):
    return export_onnx(src, out, dtype=dtype, experts=experts, weights=weights)


def _session_options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 2, 3
    return so


def _greedy(sess, folder: Path, steps: int = DECODE) -> tuple[list[np.ndarray], list[int]]:
    """Prefill PROMPT then `steps` greedy steps, state fed back by the manifest; (logits per call, tokens)."""
    exp = load_export(folder)
    outs = [o.name for o in sess.get_outputs()]
    state = {k: v.astype(np.float32) for k, v in exp.manifest.initial_state(1).items()}  # bf16: emulated in fp32
    ids, logits, tokens = PROMPT, [], []
    for _ in range(steps + 1):
        past = exp.manifest.past_length(state)
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, past + len(ids)), np.int64),
                 **state}
        out = dict(zip(outs, sess.run(None, feeds)))
        state = {s.name: out[s.present] for s in exp.manifest.states}
        logits.append(out["logits"])
        tokens.append(int(out["logits"][0, -1].argmax()))
        ids = [tokens[-1]]
    return logits, tokens


@pytest.fixture(scope="module")
def exports(released_random, tmp_path_factory, monkeypatch_module) -> dict[str, Path]:
    """The released fixture exported with MXFP4 experts (fp32 / bf16 other weights) and dense (fp32 / bf16),
    with building the PyTorch model forbidden: export streams from the checkpoint's headers."""
    from k3export.modeling.modeling_k3 import K3ForCausalLM

    def refuse(*a, **k):
        raise AssertionError("an MXFP4 export must not load the model")

    monkeypatch_module.setattr(K3ForCausalLM, "from_pretrained", classmethod(refuse))
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for name, experts, dtype in (("mxfp4", None, "fp32"), ("mxfp4_bf16", "mxfp4", "bf16"), ("dense", "dense", "fp32"),
                                 ("dense_bf16", "dense", "bf16")):
        export(released_random, root / name, experts, dtype)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def genai_export(released_random, tmp_path_factory) -> Path:
    """The released fixture exported with MXFP4 experts and ``--genai``: model.onnx plus the persisted ORT form."""
    return export_onnx(released_random, tmp_path_factory.mktemp("genai") / "export", genai=True).out_dir


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _initializers(folder: Path) -> dict[str, TensorProto]:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return {t.name: t for t in model.graph.initializer}


def _bytes(folder: Path, t: TensorProto) -> bytes:
    ext = {e.key: e.value for e in t.external_data}
    with open(folder / ext["location"], "rb") as fh:
        fh.seek(int(ext["offset"]))
        return fh.read(int(ext["length"]))


# ---------------------------------------------------------------------------------------------- the file
def test_expert_bytes_are_the_checkpoints_sha256(released_random, exports):
    ckpt = mxfp4_bytes(released_random)
    inits = _initializers(exports["mxfp4"])
    config = released_tiny_config()
    seen = 0
    for i, kind in enumerate(config.mlp_types):
        if kind != "moe":
            continue
        for w in ("w1", "w2", "w3"):
            for suffix, elem in (("weight_packed", TensorProto.FLOAT4E2M1), ("weight_scale", TensorProto.FLOAT8E8M0)):
                t = inits[f"model.layers.{i}.block_sparse_moe.experts.{w}.{suffix}"]
                assert t.data_type == elem
                want = b"".join(ckpt[f"language_model.model.layers.{i}.block_sparse_moe.experts.{e}.{w}.{suffix}"]
                                for e in range(config.num_experts))
                assert hashlib.sha256(_bytes(exports["mxfp4"], t)).hexdigest() == hashlib.sha256(want).hexdigest()
                seen += config.num_experts
    assert seen == len(ckpt)  # every packed tensor and scale of the checkpoint, exactly once


def test_expert_bits_per_element_against_the_bf16_export(exports):
    def expert_bits(folder: Path) -> float:
        nbytes = numel = 0
        for t in _initializers(folder).values():
            if ".experts." in t.name:
                nbytes += len(_bytes(folder, t))
                numel += int(np.prod(t.dims)) if t.data_type != TensorProto.FLOAT8E8M0 else 0
        return 8 * nbytes / numel

    onnx.checker.check_model(str(exports["mxfp4_bf16"] / "model.onnx"), full_check=True)  # standard ONNX, opset 27
    assert expert_bits(exports["mxfp4_bf16"]) <= 4.5  # 4 + 8/32
    assert expert_bits(exports["dense_bf16"]) == 16
    assert has_mxfp4(onnx.load(str(exports["mxfp4"] / "model.onnx"), load_external_data=False))
    assert not has_mxfp4(onnx.load(str(exports["dense"] / "model.onnx"), load_external_data=False))


def test_kept_mxfp4_layout_exports_the_same_bytes(released_random, exports, tmp_path):
    from k3export.converters.checkpoints.convert import convert

    kept = tmp_path / "kept"
    convert(released_random, kept, keep_mxfp4=True)
    export(kept, tmp_path / "onnx")  # default: MXFP4, since the source keeps it
    a, b = _initializers(exports["mxfp4"]), _initializers(tmp_path / "onnx")
    experts = [n for n in a if ".experts." in n]
    assert experts and all(b[n].data_type == a[n].data_type for n in experts)
    for n in experts:
        assert _bytes(exports["mxfp4"], a[n]) == _bytes(tmp_path / "onnx", b[n])


def test_k3_preset_graph_declares_at_most_1_6_tb(tmp_path):
    k3 = K3Config.k3()
    mx = export(k3, tmp_path / "mx", "mxfp4", dtype="bf16", weights=False)
    dense = export(k3, tmp_path / "bf16", "dense", dtype="bf16", weights=False)
    assert mx.weight_bytes <= 1.6e12 and 5.4e12 <= dense.weight_bytes <= 5.8e12
    forms = weight_bytes_by_form(k3)
    assert (forms.onnx_mxfp4, forms.onnx_bf16) == (mx.weight_bytes, dense.weight_bytes)


def test_weight_bytes_by_form_match_the_exports(exports):
    forms = weight_bytes_by_form(released_tiny_config())
    rc = {name: load_export(exports[name]).runtime.weight_bytes for name in ("mxfp4_bf16", "dense_bf16")}
    assert (forms.onnx_mxfp4, forms.onnx_bf16) == (rc["mxfp4_bf16"], rc["dense_bf16"])
    d = released_tiny_config().hidden_size  # the checkpoint also holds layer 0's unread AttnRes query and key norm
    assert forms.released_mxfp4 - forms.onnx_mxfp4 == 2 * 2 * d and forms.onnx_mxfp4 < forms.ort_mxfp4 < forms.ort_dense
    assert [r[0] for r in forms.rows()][0].startswith("released")


def test_expert_format_resolution(released_random, tmp_path):
    source = CheckpointSource(released_random)
    assert source.has_mxfp4 and resolve_experts(None, source) == "mxfp4"
    assert resolve_experts("dense", source) == "dense" and resolve_experts(None, None) == "dense"
    assert source.get("model.layers.1.block_sparse_moe.experts.0.w1.weight").dtype == torch.bfloat16  # decoded
    dense = tmp_path / "dense"
    write_checkpoint(dense, released_tiny_config(), layout="kimi_linear", vision=False, tokenizer=False)
    dense_source = CheckpointSource(dense)
    assert not dense_source.has_mxfp4 and resolve_experts(None, dense_source) == "dense"
    with pytest.raises(ExportError, match="MXFP4"):
        resolve_experts("mxfp4", dense_source)
    with pytest.raises(ExportError, match="expert format"):
        resolve_experts("fp4", source)
    graph_only = export(released_random, tmp_path / "graph", weights=False)  # no weights: still MXFP4 by default
    assert has_mxfp4(onnx.load(str(graph_only.model_path), load_external_data=False))


# ---------------------------------------------------------------------------------------------- the standard form


def _raw(name: str, elem: int, dims: list[int], data: torch.Tensor) -> TensorProto:
    t = TensorProto()
    t.name, t.data_type, t.raw_data = name, elem, data.numpy().tobytes()
    t.dims.extend(dims)
    return t


@pytest.mark.filterwarnings("ignore:overflow encountered")  # scale 2^127 times 6: inf, as decode_mxfp4
@pytest.mark.parametrize("opset", [25, 27, 28])
def test_reference_dequantize_linear_equals_decode_mxfp4(opset):
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)          # every byte: every E2M1 pair
    scale = torch.tensor([[0, 1], [100, 127], [130, 200], [126, 254]], dtype=torch.uint8)
    node = helper.make_node("DequantizeLinear", ["w", "s"], ["y"], axis=-1, block_size=32,
                            output_dtype=TensorProto.FLOAT)
    graph = helper.make_graph([node], "dq", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 128])],
                              [_raw("w", TensorProto.FLOAT4E2M1, [4, 128], packed),
                               _raw("s", TensorProto.FLOAT8E8M0, [4, 4], scale.repeat_interleave(2, 1))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)
    onnx.checker.check_model(model, full_check=True)
    (y,) = ReferenceEvaluator(model).run(None, {})
    want = decode_mxfp4(packed, scale.repeat_interleave(2, 1), torch.float32).numpy()
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


def _moe_model(function: onnx.FunctionProto, inits: list[TensorProto], n: int, k: int, d: int) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    node = helper.make_node("moe_experts", list(function.input), ["u"], domain="k3", act="situ", beta1=4.0, beta2=25.0)
    node.input[0:3] = ["z", "weights", "indices"]
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("z", f, [n, d]),
                                              helper.make_tensor_value_info("weights", f, [n, k]),
                                              helper.make_tensor_value_info("indices", TensorProto.INT64, [n, k])],
                              [helper.make_tensor_value_info("u", f, [n, d])], inits)
    opsets = [helper.make_opsetid("", 27), helper.make_opsetid("k3", 1), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=11, functions=[function])


def test_moe_experts_mxfp4_body_equals_dense_body():
    """The standard MXFP4 body (onnx.reference) and ORT's 8-bit body equal the dense body on decoded weights."""
    E, D, I, k, n = 5, 64, 32, 2, 3
    gen = torch.Generator().manual_seed(0)
    mats = {w: (torch.randint(0, 256, (E, o, i // 2), generator=gen, dtype=torch.int32).to(torch.uint8),
                torch.randint(122, 128, (E, o, i // 32), generator=gen, dtype=torch.int32).to(torch.uint8))
            for w, (o, i) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items()}
    fp4, dense, q8 = [], [], []
    for w, (p, s) in mats.items():
        fp4 += [_raw(w, TensorProto.FLOAT4E2M1, [E, p.shape[1], 2 * p.shape[2]], p),
                _raw(w + "_scale", TensorProto.FLOAT8E8M0, list(s.shape), s)]
        dense.append(numpy_helper.from_array(
            np.stack([decode_mxfp4(p[e], s[e], torch.float32).numpy() for e in range(E)]), w))
        q8 += [numpy_helper.from_array(q8_from_packed(p.numpy()), w),
               numpy_helper.from_array(np.take(Q8_SCALE, s.numpy()), w + "_scale")]
    rng = np.random.default_rng(0)
    feeds = {"z": rng.standard_normal((n, D)).astype(np.float32), "weights": rng.random((n, k)).astype(np.float32),
             "indices": np.array([[0, 3], [3, 4], [1, 0]], np.int64)}
    standard = _moe_model(moe_experts_function("k3", "situ", 4.0, 25.0, 27, mxfp4=True), fp4, n, k, D)
    onnx.checker.check_model(standard, full_check=True)
    (u_fp4,) = ReferenceEvaluator(onnx.inliner.inline_local_functions(standard), new_ops=[Pad]).run(None, feeds)
    dense_model = _moe_model(moe_experts_function("k3", "situ", 4.0, 25.0, 27), dense, n, k, D)
    (u_ref,) = ReferenceEvaluator(dense_model).run(None, feeds)
    # the standard form runs one expert per loop iteration, the dense one a block of them: the same products,
    # batched differently by numpy's matmul, so equal to rounding (|u| reaches ~600 here)
    np.testing.assert_allclose(u_fp4, u_ref, rtol=1e-6, atol=1e-4)
    assert np.abs(u_ref).max() > 1
    ort_model_ = _moe_model(ort_moe_function("situ", 4.0, 25.0, 27), q8, n, k, D)
    (u_q8,) = ort.InferenceSession(ort_model_.SerializeToString()).run(None, feeds)
    (u_dense,) = ort.InferenceSession(dense_model.SerializeToString()).run(None, feeds)
    np.testing.assert_array_equal(u_q8, u_dense)


# ---------------------------------------------------------------------------------------------- ONNX Runtime
def _like_the_dequantised_export(session, folder: Path, exports) -> None:
    """`session` (of export `folder`) over prefill + decode = a plain ORT session of the dequantised fp32 export:
    logits within 1e-5, every greedy token equal."""
    got, got_tokens = _greedy(session, folder)
    plain = ort.InferenceSession(str(exports["dense"] / "model.onnx"), _session_options(),
                                 providers=["CPUExecutionProvider"])
    want, want_tokens = _greedy(plain, exports["dense"])
    assert got_tokens == want_tokens
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_ort_runs_the_mxfp4_export_like_the_dequantised_fp32_export(exports):
    _like_the_dequantised_export(ort_session(exports["mxfp4"] / "model.onnx", _session_options()), exports["mxfp4"],
                                 exports)


def test_the_export_carries_the_8bit_function_and_plain_ort_needs_it(exports, tmp_path, caplog):
    """The file holds, beside the 4-bit experts' functions, their ``q8`` overloads (ONNX Runtime's 8-bit form), so
    a session converts bytes and runs functions the exporter wrote; an export without them (written before) is
    refused in one line that names the file and says to re-export, before anything is written."""
    from k3export.artifacts import ArtifactError
    from k3export.artifacts.expert_views import Q8_OVERLOAD, q8_tensors, q8_view

    path = exports["mxfp4"] / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    q8 = {f.name for f in model.functions if f.overload == Q8_OVERLOAD}
    assert q8 == {"moe_experts", "moe_route_experts"}  # the router fused with its MXFP4 experts too
    assert b"GatherBlockQuantized" in next(f for f in model.functions
                                           if f.name == "moe_experts" and f.overload == Q8_OVERLOAD).SerializeToString()
    view, _ = q8_view(model, path.parent, tmp_path, [("x", 0)] * len(q8_tensors(model)))
    assert not any(f.name in q8 and f.overload for f in view.functions)  # the 8-bit ones now the functions
    assert not any(t.data_type in (TensorProto.FLOAT4E2M1, TensorProto.FLOAT8E8M0) for t in view.graph.initializer)
    old = onnx.ModelProto()
    old.CopyFrom(model)
    kept = [f for f in old.functions if f.overload != Q8_OVERLOAD]
    del old.functions[:]
    old.functions.extend(kept)
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(ArtifactError, match="re-export it") as err:
        ort_session(path, _session_options(), model=old, cache_dir=cache)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert not any(cache.iterdir())


def test_ort_holds_experts_at_9_bits_in_a_file_it_maps(exports, tmp_path):
    folder = exports["mxfp4"]
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    out, root = ort_model(model, folder, tmp_path, "experts.q8.")
    before = {t.name: t for t in model.graph.initializer}
    nbytes = numel = 0
    for t in out.graph.initializer:
        if before[t.name].data_type == TensorProto.FLOAT4E2M1:
            assert t.data_type == TensorProto.UINT8
            numel += int(np.prod(t.dims))
        elif before[t.name].data_type == TensorProto.FLOAT8E8M0:
            assert t.data_type == TensorProto.FLOAT
        else:
            continue
        ext = {e.key: e.value for e in t.external_data}
        assert root / ext["location"] == (tmp_path / "experts.q8.00000").resolve()
        nbytes += int(ext["length"])
    assert numel and 8 * nbytes / numel == 9
    assert not has_mxfp4(out) and any(o.domain == "com.microsoft" for o in out.opset_import)
    cache = tmp_path / "cache"
    cache.mkdir()
    ort_session(folder / "model.onnx", _session_options(), cache_dir=cache)
    assert not any(cache.iterdir())  # the 8-bit file is unlinked once the session maps it


def test_ort_runs_the_mxfp4_bf16_export_like_the_bf16_export(exports):
    """bf16 exports on ORT CPU run through the bf16 emulation; MXFP4 experts decode to the same bf16 values."""
    from k3export.converters.onnx.lowp import emulate_low_precision

    def run(name: str, mxfp4: bool):
        path = exports[name] / "model.onnx"
        emulated = emulate_low_precision(onnx.load(str(path), load_external_data=False))
        return _greedy(ort_session(path, _session_options(), model=emulated), exports[name], steps=3)

    (a, ta), (b, tb) = run("mxfp4_bf16", True), run("dense_bf16", False)
    assert ta == tb
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)


def test_validation_scenarios_mxfp4_export_against_the_dequantised_export(exports):
    """The harness's scenarios with the dequantised fp32 export as the reference (the k3 ops library reads the 4-bit
    experts, the dense export's experts run the library's dense kernel): prefill + decode and a batch within 1e-4
    rms_rel and 2e-4 of the largest value on every logit and state (the MXFP4 kernel sums each 32-feature chunk's
    even features before its odd ones: ~3e-6 rms_rel apart where the library is built for AVX-512, 3.05e-5 in the
    logits for its AVX2 build; a wrong nibble or scale is ~1e-1 apart); the chunked prefill (which differs from the
    one-shot reference by chunking alone) within the fp32 defaults; every greedy token equal."""
    from k3export.runtime import OrtRunner
    from k3export.validate.compare import Tolerances
    from k3export.validate.core import validate
    from k3export.validate.scenarios import make_scenarios

    vocab = released_tiny_config().vocab_size
    reference, mxfp4 = OrtRunner(exports["dense"]), OrtRunner(exports["mxfp4"], name="ort-mxfp4")
    tight = validate(reference, [mxfp4], make_scenarios(vocab, prompt_len=12, steps=DECODE, which=("decode", "batch")),
                     Tolerances.parse({"*.rms_rel": 1e-4, "*.max_abs_rel": 2e-4}))
    chunked = validate(reference, [mxfp4], make_scenarios(vocab, prompt_len=12, steps=2, which=("chunked_prefill",)))
    for result in (tight, chunked):
        assert result.passed, result.localisation
        assert all(all(run.greedy) for run in result.runs)


# ---------------------------------------------------------------------------------------------- the persisted ORT form
def test_ort_runner_opens_the_persisted_ort_form_and_converts_nothing(exports, genai_export, monkeypatch, tmp_path):
    """On a ``--genai`` export the runner opens model.genai.onnx by path: no 8-bit rewrite, nothing in the
    temporary folder; its logits over prefill + decode equal the dequantised fp32 export's (a plain ORT session)
    within 1e-5, every greedy token equal. An explicit `model_path` still takes the rewrite. (With the k3 ops
    library, the default, the runner reads the 4-bit experts themselves: tests/runtime/test_ort_ops_experts.py.)"""
    monkeypatch.setenv("K3EXPORT_ORT_OPS", "0")
    import tempfile

    from k3export.runtime import OrtRunner, ort_session as session_module

    def refuse(*a, **k):
        raise AssertionError("the persisted ORT form must not be rewritten again")

    monkeypatch.setattr(session_module, "_q8_model", refuse)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    runner = OrtRunner(genai_export)
    assert runner.graph_path == load_export(genai_export).ort_form_path == genai_export / "model.genai.onnx"
    assert "model.genai.onnx" in runner.describe()
    _like_the_dequantised_export(runner.ort.session, genai_export, exports)
    assert not any((tmp_path / "tmp").iterdir())
    with pytest.raises(AssertionError, match="rewritten again"):
        OrtRunner(genai_export, model_path=genai_export / "model.onnx")
    assert load_export(exports["mxfp4"]).ort_form_path is None


def _q8_tensor(model: onnx.ModelProto) -> TensorProto:
    return next(t for t in model.graph.initializer if t.data_type == TensorProto.UINT8)


def _point_outside(model: onnx.ModelProto) -> None:
    next(e for e in _q8_tensor(model).external_data if e.key == "location").value = "../model.genai.experts.q8.00000"


def _shift_a_dense_weight(model: onnx.ModelProto) -> None:
    """Point a weight that is not an expert's at the first bytes of its data file: in range, but not model.onnx's."""
    offsets = (e for t in model.graph.initializer if ".experts." not in t.name for e in t.external_data
               if e.key == "offset" and e.value != "0")
    next(offsets).value = "0"


@pytest.mark.parametrize("damage, words", [
    ("truncate", ["model.genai.onnx", "offset", "past the end of model.genai.experts.q8.00000"]),
    (_point_outside, ["model.genai.onnx", "location", "leaves the folder"]),
    (_shift_a_dense_weight, ["model.genai.onnx", "differs from model.onnx"]),
])
def test_load_export_refuses_a_damaged_ort_form(genai_export, tmp_path, damage, words):
    import shutil

    from k3export.artifacts import ArtifactError

    folder = tmp_path / "export"
    shutil.copytree(genai_export, folder)
    if damage == "truncate":
        data = folder / "model.genai.experts.q8.00000"
        data.write_bytes(data.read_bytes()[:-1])
    else:
        model = onnx.load(str(folder / "model.genai.onnx"), load_external_data=False)
        damage(model)
        (folder / "model.genai.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ArtifactError) as info:
        load_export(folder)
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), str(info.value)


def test_the_8bit_form_is_sharded_like_the_data(released_random, exports, tmp_path, monkeypatch):
    """The persisted 8-bit experts are cut into shards by the data shards' rule (K3's form is ~3.1 TB, past any
    single file a Hub repository takes): with a 64 KiB limit each shard holds one tensor or stays within it, every
    shard is digested and published, and the runner on them equals the dequantised fp32 export within 1e-5
    (the runner without the k3 ops library, which would read the 4-bit experts instead)."""
    monkeypatch.setenv("K3EXPORT_ORT_OPS", "0")
    from k3export.genai import export_files
    from k3export.runtime import OrtRunner

    limit = 1 << 16
    out = export_onnx(released_random, tmp_path / "export", genai=True, max_shard_bytes=limit).out_dir
    exp = load_export(out)
    shards = exp.ort_form_data
    assert len(shards) > 2 and shards == tuple(f"model.genai.experts.q8.{i:05d}" for i in range(len(shards)))
    q8 = [t for t in onnx.load(str(exp.ort_form_path), load_external_data=False).graph.initializer
          if any(e.key == "location" and e.value in shards for e in t.external_data)]
    per_shard: dict[str, list[int]] = {}
    for t in q8:
        ext = {e.key: e.value for e in t.external_data}
        per_shard.setdefault(ext["location"], []).append(int(ext["length"]))
    for name, lengths in per_shard.items():
        assert len(lengths) == 1 or (out / name).stat().st_size <= limit, name
    assert set(shards) <= set(exp.file_digests()) and set(shards) <= set(export_files(out))
    _like_the_dequantised_export(OrtRunner(out).ort.session, out, exports)


def test_progress_follows_the_weights_then_the_8bit_copy(released_random, tmp_path):
    """``export --genai`` of MXFP4 experts reports one run of bytes: the weights, then the 8-bit copy of the experts
    (one byte per packed value, four per scale), monotonic, ending at the total it announced."""
    calls: list[tuple[int, int]] = []
    res = export_onnx(released_random, tmp_path / "export", genai=True, progress=lambda d, t: calls.append((d, t)))
    model = onnx.load(str(res.model_path), load_external_data=False)
    q8 = sum(int(np.prod(t.dims)) * (4 if t.data_type == TensorProto.FLOAT8E8M0 else 1)
             for t in model.graph.initializer if t.data_type in (TensorProto.FLOAT4E2M1, TensorProto.FLOAT8E8M0))
    totals = {t for _, t in calls}
    assert totals == {res.weight_bytes + q8}
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == res.weight_bytes + q8
    assert any(d == res.weight_bytes for d in done)  # the weights end where the 8-bit copy starts


def test_file_digests_cover_the_ort_form(exports, genai_export):
    digests = load_export(genai_export).file_digests()
    for name in ("model.genai.onnx", "model.genai.experts.q8.00000"):
        assert digests[name] == hashlib.sha256((genai_export / name).read_bytes()).hexdigest()
    assert "model.genai.onnx" not in load_export(exports["mxfp4"]).file_digests()


# ---------------------------------------------------------------------------------------------- onnxruntime-genai
def test_genai_runs_the_mxfp4_export_with_genai_like_the_dequantised_export(exports, genai_export, monkeypatch):
    """``export --genai`` of MXFP4 experts adds the 8-bit graph genai runs (the export's own ``model.onnx`` and
    expert bytes untouched); genai's generator then gives the dequantised fp32 export's logits and states within
    1e-5 over prefill + decode, every greedy token equal. Without ``--genai`` no genai config is written, and genai
    is refused with the reason. The dequantised export runs ORT's function bodies, as genai does."""
    monkeypatch.setenv("K3EXPORT_ORT_OPS", "0")
    pytest.importorskip("onnxruntime_genai")
    from k3export.genai import GENAI_CONFIG_FILE, GENAI_MODEL_FILE, GenaiError, export_files
    from k3export.runtime import OrtRunner
    from k3export.runtime.genai_runner import GenaiRunner
    from k3export.validate.compare import Tolerances
    from k3export.validate.core import validate
    from k3export.validate.scenarios import make_scenarios

    from typer.testing import CliRunner

    from k3export_cli.main import app

    assert not (exports["mxfp4"] / GENAI_CONFIG_FILE).exists()
    with pytest.raises(GenaiError, match="export again with --genai"):
        GenaiRunner(exports["mxfp4"])
    res = CliRunner().invoke(app, ["generate", str(exports["mxfp4"]), "hi", "--runtime", "genai"])
    assert res.exit_code == 2 and "export again with --genai" in res.output and "Traceback" not in res.output

    with_genai = genai_export
    for name in ("model.onnx", *load_export(with_genai).runtime.data_files):
        assert (with_genai / name).read_bytes() == (exports["mxfp4"] / name).read_bytes(), name
    shards = load_export(with_genai).ort_form_data
    assert shards and {GENAI_CONFIG_FILE, GENAI_MODEL_FILE, *shards} <= set(export_files(with_genai))
    packed = [int(np.prod(t.dims)) for t in _initializers(with_genai).values() if t.data_type == TensorProto.FLOAT4E2M1]
    # 8 bits a value + a float scale per 32 (9 bits), each of the 2 x len(packed) tensors aligned to 4 KiB
    assert sum((with_genai / n).stat().st_size for n in shards) <= sum(packed) * 9 // 8 + 2 * len(packed) * 4096

    vocab = released_tiny_config().vocab_size
    result = validate(OrtRunner(exports["dense"]), [GenaiRunner(with_genai)],
                      make_scenarios(vocab, prompt_len=12, steps=DECODE, which=("decode",)),
                      Tolerances.parse({"*.rms_rel": 1e-4, "*.max_abs_rel": 2e-4}))
    assert result.passed, result.localisation
    assert result.runs and all(all(run.greedy) for run in result.runs)


def test_genai_form_needs_weights_and_a_whole_decoder(released_random, tmp_path):
    with pytest.raises(ExportError, match="graph-only export"):
        export_onnx(released_random, tmp_path / "a", genai=True, weights=False)
    with pytest.raises(ExportError, match="runs whole decoders"):
        export_onnx(released_random, tmp_path / "b", genai=True, layers=range(0, 3))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


_KILLED_WHILE_CONVERTING = """
import os, signal, sys
from k3export.artifacts import expert_views
convert = expert_views.write_q8_tensor
def convert_then_die(*a, **k):
    convert(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 halfway through the 8-bit file
expert_views.write_q8_tensor = convert_then_die
from k3export.runtime.ort_session import ort_session
ort_session(sys.argv[1], cache_dir=sys.argv[2])
"""


def test_a_session_killed_while_converting_leaves_nothing_after_the_next(exports, tmp_path):
    """The 8-bit form of a session killed while it was being written (K3: terabytes) is removed by the next session
    that uses the folder; a folder whose build is alive (its lock held) is left alone."""
    import fcntl
    import subprocess
    import sys

    cache = tmp_path / "cache"
    cache.mkdir()
    proc = subprocess.run([sys.executable, "-c", _KILLED_WHILE_CONVERTING, str(exports["mxfp4"] / "model.onnx"),
                           str(cache)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    (left,) = cache.iterdir()
    assert (left / "experts.q8").stat().st_size > 0
    live = cache / "k3export-mxfp4-live"
    live.mkdir()
    with open(live / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        ort_session(exports["mxfp4"] / "model.onnx", _session_options(), cache_dir=cache)
        assert list(cache.iterdir()) == [live]
