"""NVIDIA's NVFP4 K3 layout (``nvidia/Kimi-K3-NVFP4``) as a source: load, export, plan, and its strict checks.

The reference is independent of the code under test: the shards are read with the safetensors library and every
weight dequantised in float64 numpy from the bit fields (E2M1 nibbles, E4M3 scales, the fp32 global scale, FP8
tiles), then run through a float64 model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from k3export.converters.checkpoints import load_pretrained, make_plan, scan_checkpoint
from k3export.converters.checkpoints.synthetic import released_tiny_config, write_checkpoint
from k3export.errors import CheckpointError
from k3export.modeling import K3ForCausalLM
from nvfp4_ref import PREFIX, reference_model, reference_weights

PROMPT = [3, 17, 9, 42, 5, 11, 60, 2]


@pytest.fixture(scope="module")
def nvfp4_ckpt(tmp_path_factory) -> Path:
    """A tiny checkpoint in NVIDIA's NVFP4 layout (2 shards). Shared: copy it before changing it."""
    return write_checkpoint(tmp_path_factory.mktemp("nvfp4") / "ckpt", released_tiny_config(),
                            layout="kimi_k3_nvfp4", num_shards=2)


@pytest.fixture(scope="module")
def reference(nvfp4_ckpt):
    """(float64 weights by our name, float64 model built from them)."""
    weights = reference_weights(nvfp4_ckpt)
    return weights, reference_model(nvfp4_ckpt, weights)


def _logits(model, ids=PROMPT) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.double().numpy()


# ---------------------------------------------------------------------- load
def test_from_pretrained_equals_the_float64_dequantisation(nvfp4_ckpt, reference):
    weights, model64 = reference
    model = K3ForCausalLM.from_pretrained(nvfp4_ckpt)
    params = dict(model.named_parameters())
    kinds = {t.name: t.kind for t in scan_checkpoint(nvfp4_ckpt).tensors.values()}
    assert sorted(set(kinds.values())) == ["dense", "fp8_block", "nvfp4"]
    for name, p in params.items():
        want = weights[name]
        want = want.reshape(-1)[: p.numel()].reshape(p.shape) if want.shape != tuple(p.shape) else want
        # one fp32 rounding of the float64 value (2^-24 relative), nothing more
        np.testing.assert_allclose(p.detach().double().numpy(), want, rtol=2.0 ** -23, atol=0, err_msg=name)
    got, want = _logits(model), _logits(model64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("experts", ["nvfp4", "dense"])
def test_onnx_export_on_ort_equals_the_float64_model(nvfp4_ckpt, reference, tmp_path, experts):
    """The default export keeps the experts NVFP4 (the checkpoint's bytes, FLOAT4E2M1 / FLOAT8E4M3FN / fp32 global
    scales; ORT runs its 8-bit form, and with the k3 library its ``moe_experts_nvfp4`` on those bytes) and the
    attention FP8; ``--experts dense --projections dense`` dequantises both: each equals the float64 model."""
    ort = pytest.importorskip("onnxruntime")
    import onnx

    from k3export.artifacts import load_export
    from k3export.converters.onnx import export_onnx
    from k3export.runtime.ort_session import ort_session

    out = export_onnx(nvfp4_ckpt, tmp_path / "export", dtype="fp32",
                      **({} if experts == "nvfp4" else {"experts": "dense", "projections": "dense"})).out_dir
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    w1 = "model.layers.1.block_sparse_moe.experts.w1"
    assert any(t.endswith(".fp8") for t in types) == (experts == "nvfp4")
    if experts == "nvfp4":
        assert (types[w1 + ".weight_packed"], types[w1 + ".weight_scale"], types[w1 + ".weight_scale_2"]) == (
            onnx.TensorProto.FLOAT4E2M1, onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT)
        # the checkpoint's bytes, stacked over the experts
        ckpt = {}
        for f in nvfp4_ckpt.glob("*.safetensors"):
            ckpt.update(load_file(f))
        inits = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer}
        for suffix, stored in (("weight_packed", "weight"), ("weight_scale", "weight_scale")):
            want = b"".join(ckpt[f"{PREFIX}model.layers.1.block_sparse_moe.experts.{e}.w1.{stored}"].view(
                torch.uint8).numpy().tobytes() for e in range(released_tiny_config().num_experts))
            ext = inits[f"{w1}.{suffix}"]
            with open(out / ext["location"], "rb") as fh:
                fh.seek(int(ext["offset"]))
                assert fh.read(int(ext["length"])) == want
    else:
        assert not any(t in (onnx.TensorProto.FLOAT4E2M1, onnx.TensorProto.FLOAT8E4M3FN) for t in types.values())
    exp = load_export(out)
    feeds = {"input_ids": np.array([PROMPT], np.int64), "attention_mask": np.ones((1, len(PROMPT)), np.int64),
             **{k: v.astype(np.float32) for k, v in exp.manifest.initial_state(1).items()}}
    want = _logits(reference[1])
    from k3export.runtime import ort_ops

    for library in (False, True) if experts == "nvfp4" else (False,):
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = 2, 3
        if library:
            from k3export.artifacts.expert_views import packed_view

            assert ort_ops.takes(model)
            # the library's form: the export's own bytes retyped uint8 (4 + 0.5 bits a weight), nothing converted
            packed = {t.name: t for t in packed_view(model).graph.initializer}
            orig = {t.name: t for t in model.graph.initializer}
            n_weights = int(np.prod(orig[f"{w1}.weight_packed"].dims))
            for suffix, bits in (("weight_packed", 4), ("weight_scale", 0.5)):
                t, o = packed[f"{w1}.{suffix}"], orig[f"{w1}.{suffix}"]
                assert t.data_type == onnx.TensorProto.UINT8 and t.external_data == o.external_data
                assert int(np.prod(t.dims)) * 8 == bits * n_weights
            if not ort_ops.register(so):
                pytest.skip("the k3 ORT library is not built here")
        sess = ort_session(out / "model.onnx", so, k3_ops=library)
        names = [o.name for o in sess.get_outputs()]
        got = dict(zip(names, sess.run(None, feeds)))["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"library={library}")


# ---------------------------------------------------------------------- FP8 attention kept FP8
def _stored(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def _external(out: Path, init) -> bytes:
    ext = {e.key: e.value for e in init.external_data}
    with open(out / ext["location"], "rb") as fh:
        fh.seek(int(ext["offset"]))
        return fh.read(int(ext["length"]))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fp8_projections_keep_their_bytes_and_dequantise_exactly(nvfp4_ckpt, tmp_path, dtype):
    """``--projections fp8`` (the default for this source): each FP8 block weight is the checkpoint's E4M3 bytes
    (1 byte a weight) plus fp32 scales, one a row and block of 64 here (a 64-wide tile), dequantised by a blocked
    ``DequantizeLinear``. ONNX Runtime, the reference evaluator and OpenVINO each give, from the export's own
    initializers, the float64 numpy dequantisation of the bit fields rounded once to fp32, bit for bit. The
    products of one input are joined in FP8 as in the dense export (as many products)."""
    import onnx
    import onnx.external_data_helper
    import onnx.reference
    from onnx import TensorProto, helper

    from k3export.converters.onnx import export_onnx
    from nvfp4_ref import e4m3

    out = export_onnx(nvfp4_ckpt, tmp_path / "fp8", dtype=dtype).out_dir
    dense = export_onnx(nvfp4_ckpt, tmp_path / "dense", dtype=dtype, projections="dense").out_dir
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    gemms = [sum(n.op_type == "Gemm" for n in onnx.load(str(f / "model.onnx"), load_external_data=False).graph.node)
             for f in (out, dense)]
    assert gemms[0] == gemms[1]
    inits = {t.name: t for t in model.graph.initializer}
    stored = _stored(nvfp4_ckpt)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) >= 8
    fp8_params = sum(int(np.prod(t.dims)) for t in inits.values() if t.name.endswith(".fp8"))
    tile_weights = sum(int(np.prod(v.shape)) for k, v in stored.items()
                       if v.dtype == torch.float8_e4m3fn and ".experts." not in k)
    assert fp8_params == tile_weights  # every FP8 block weight of the checkpoint, once
    # `info`'s bytes by part: the same projections, each FP8 weight 1 byte (not 4 or 2) plus its row scales
    from k3export.info import PARTS, export_bits_by_part

    parts = [{p: (n, b) for p, n, b in export_bits_by_part(f / "model.onnx")} for f in (out, dense)]
    scale_bytes = sum(4 * int(np.prod(t.dims)) for t in inits.values() if t.name.endswith(".fp8_scale"))
    assert parts[0][PARTS[0]][0] == parts[1][PARTS[0]][0]
    itemsize = 4 if dtype == "fp32" else 2
    assert parts[1][PARTS[0]][1] - parts[0][PARTS[0]][1] == fp8_params * (itemsize - 1) - scale_bytes
    assert parts[0][PARTS[1]] == parts[1][PARTS[1]] and parts[0][PARTS[2]] == parts[1][PARTS[2]]
    checked = 0
    for node in dq:
        values, scales = inits[node.input[0]], inits[node.input[1]]
        assert values.data_type == TensorProto.FLOAT8E4M3FN and scales.data_type == TensorProto.FLOAT
        raw = _external(out, values)
        assert len(raw) == int(np.prod(values.dims))  # 1 byte a weight
        name = node.input[0].removesuffix(".fp8")
        if "+" in name:  # a joined product: its parts' bytes, checked through the logits
            continue
        weight = stored[PREFIX + name]
        tile = stored[PREFIX + name + "_scale"].double().numpy()
        assert raw == weight.view(torch.uint8).numpy().tobytes()
        bits = weight.view(torch.uint8).numpy()
        o, i = bits.shape
        want = (e4m3(bits) * np.repeat(np.repeat(tile, 128, 0), 128, 1)[:o, :i]).astype(np.float32)
        # the DequantizeLinear node alone, on the export's own initializers
        graph = helper.make_graph([helper.make_node("DequantizeLinear", list(node.input), ["w"],
                                                    axis=1, block_size=[a.i for a in node.attribute
                                                                        if a.name == "block_size"][0])],
                                  "dq", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [o, i])],
                                  [values, scales])
        one = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
        onnx.external_data_helper.load_external_data_for_model(one, str(out))
        got = {"ort": ort_run(one), "reference": onnx.reference.ReferenceEvaluator(one).run(None, {})[0]}
        ov = pytest.importorskip("openvino")
        got["openvino"] = ov.Core().compile_model(ov.Core().read_model(one.SerializeToString(), b""),
                                                  "CPU")({})[0]
        for runtime, w in got.items():
            np.testing.assert_array_equal(w, want, err_msg=f"{runtime} {name}")
        checked += 1
    assert checked >= 4


def ort_run(model) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {})[0]


def test_projections_option_is_checked_in_one_line(nvfp4_ckpt, tmp_path):
    from k3export.converters.checkpoints.synthetic import write_checkpoint as write
    from k3export.converters.onnx import export_onnx
    from k3export.errors import ExportError, K3ExportError

    with pytest.raises(ExportError, match="--quantize int8 quantizes the decoded projections"):
        export_onnx(nvfp4_ckpt, tmp_path / "q", projections="fp8", quantize="int8")
    with pytest.raises(ExportError, match="unknown projection format 'int8'"):
        export_onnx(nvfp4_ckpt, tmp_path / "q", projections="int8")
    # a consumer not known to read FP8 projections is refused in one line, before it loads anything
    from k3export.artifacts import load_export
    from k3export.converters.onnx.forms import FP8_READERS, READERS, check_export

    out = export_onnx(nvfp4_ckpt, tmp_path / "fp8", experts="dense", weights=False).out_dir
    for consumer in sorted(set(READERS) - FP8_READERS):
        with pytest.raises(K3ExportError) as info:
            check_export(consumer, load_export(out))
        assert "block FP8" in str(info.value) and "--projections dense" in str(info.value)
        assert "\n" not in str(info.value)
    for consumer in ("ort", "genai"):
        check_export(consumer, load_export(out))
    bf16 = write(tmp_path / "bf16", released_tiny_config(), layout="kimi_k3", num_shards=1)
    with pytest.raises(ExportError, match="stores none: use --projections dense"):
        export_onnx(bf16, tmp_path / "q", projections="fp8")


# ---------------------------------------------------------------------- plan / info
def test_plan_counts_the_nvfp4_and_fp8_bytes(nvfp4_ckpt):
    from cli.main import app

    plan = make_plan(nvfp4_ckpt)
    kinds = plan.summary()["by_kind"]
    cfg = released_tiny_config()
    moe_layers = sum(t == "moe" for t in cfg.mlp_types)
    n = cfg.num_experts * moe_layers * 3
    numel = 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size * cfg.num_experts * moe_layers
    assert kinds["expert_nvfp4 -> dense"]["tensors"] == n
    # weight + E4M3 scales + weight_scale_2 + input_scale, per matrix
    assert kinds["expert_nvfp4 -> dense"]["bytes_in"] == numel // 2 + numel // 16 + 8 * n
    assert kinds["fp8_block -> dense"]["tensors"] > 0
    result = CliRunner().invoke(app, ["plan", str(nvfp4_ckpt), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["layout"] == "kimi_k3_nvfp4"
    stored = 0
    for f in nvfp4_ckpt.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            for name in h.keys():
                if name.startswith(PREFIX):
                    part = h.get_slice(name)
                    stored += int(np.prod(part.get_shape())) * {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}[
                        part.get_dtype()]
    assert data["weight_bytes_by_form"]["NVIDIA NVFP4 checkpoint (NVFP4 experts, FP8 attention)"] == stored


# ---------------------------------------------------------------------- strict checks
EXPERT = PREFIX + "model.layers.1.block_sparse_moe.experts.0"
ATTN = PREFIX + "model.layers.0.self_attn.q_proj"


def _mutated(src: Path, dst: Path, mutate) -> Path:
    """A copy of `src` whose shards' tensors went through `mutate(dict)` (the index rewritten to match)."""
    shutil.copytree(src, dst)
    weight_map = {}
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(f)
        mutate(tensors)
        save_file(tensors, f)
        weight_map.update({n: f.name for n in tensors})
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"] = weight_map
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _drop(name: str):
    return lambda t: t.pop(name, None)


def _set(name: str, fn):
    return lambda t: t.__setitem__(name, fn(t[name])) if name in t else None


@pytest.mark.parametrize("mutate, message", [
    (_drop(EXPERT + ".w1.weight_scale"), f"missing tensor {EXPERT}.w1.weight_scale"),
    (_drop(EXPERT + ".w2.weight_scale_2"), f"missing tensor {EXPERT}.w2.weight_scale_2"),
    (_drop(EXPERT + ".w3.input_scale"), f"missing tensor {EXPERT}.w3.input_scale"),
    (_set(EXPERT + ".w3.weight_scale_2", lambda v: v * 2), f"{EXPERT}.w3.weight_scale_2"),
    (_set(EXPERT + ".w1.weight_scale", lambda v: v.to(torch.bfloat16)),
     f"tensor {EXPERT}.w1.weight_scale in"),
    (_set(EXPERT + ".w2.weight_scale", lambda v: v[:, :-1].contiguous()), f"tensor {EXPERT}.w2.weight_scale in"),
    (_set(EXPERT + ".w2.weight_scale_2", lambda v: v.reshape(1, 1)), f"tensor {EXPERT}.w2.weight_scale_2 in"),
    (_set(EXPERT + ".w1.weight_scale_2", lambda v: -v), f"{EXPERT}.w1.weight_scale_2"),
    (_drop(ATTN + ".weight_scale"), f"missing tensor {ATTN}.weight_scale"),
    (_set(ATTN + ".weight_scale", lambda v: v.to(torch.bfloat16)), f"tensor {ATTN}.weight_scale in"),
    (_set(ATTN + ".weight_scale", lambda v: v[:, :0].contiguous()), f"tensor {ATTN}.weight_scale in"),
])
def test_bad_scales_are_refused_in_one_line_naming_the_tensor(nvfp4_ckpt, tmp_path, mutate, message):
    bad = _mutated(nvfp4_ckpt, tmp_path / "bad", mutate)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(bad)
    text = str(info.value)
    assert message in text and "\n" not in text, text


def test_w1_w3_with_different_global_scales_name_both(nvfp4_ckpt, tmp_path):
    bad = _mutated(nvfp4_ckpt, tmp_path / "bad", _set(EXPERT + ".w3.weight_scale_2", lambda v: v * 2))
    from cli.main import app

    result = CliRunner().invoke(app, ["plan", str(bad)])
    assert result.exit_code == 2
    line = result.output.strip()
    assert line.startswith("error:") and "\n" not in line
    assert f"{EXPERT}.w3.weight_scale_2" in line and f"{EXPERT}.w1.weight_scale_2" in line and "share" in line


def test_modelopt_config_is_checked(nvfp4_ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(nvfp4_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    layer = next(iter(cfg["quantization_config"]["quantized_layers"]))
    cfg["quantization_config"]["quantized_layers"][layer] = {"quant_algo": "W4A8_AWQ"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"module '{layer}' has quant_algo 'W4A8_AWQ'"):
        scan_checkpoint(bad)
    # without a quantization_config, hf_quant_config.json alone says it is ModelOpt's
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    assert scan_checkpoint(bad).quant == "nvfp4"


def test_convert_decodes_to_the_float64_dequantisation(nvfp4_ckpt, reference, tmp_path):
    from k3export.converters.checkpoints import convert

    manifest = convert(nvfp4_ckpt, tmp_path / "out", dtype="fp32", text_only=True, progress=False)
    assert manifest["source"]["layout"] == "kimi_k3_nvfp4"
    got = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(f))
    weights = reference[0]
    assert set(got) == set(weights)
    for name, value in got.items():
        want = weights[name]
        if want.shape != tuple(value.shape):  # A_log: stored padded, converted to our shape
            want = want.reshape(-1)[: value.numel()].reshape(tuple(value.shape))
        np.testing.assert_allclose(value.double().numpy(), want, rtol=2.0 ** -23, atol=0, err_msg=name)


def test_deploy_plan_prices_nvfp4_experts(nvfp4_ckpt):
    from cli.main import app

    rows = {}
    for experts in ("auto", "nvfp4", "mxfp4", "dense"):
        result = CliRunner().invoke(app, ["deploy-plan", str(nvfp4_ckpt), "--devices", "1", "--device-memory", "1GB",
                                          "--reserve", "0", "--experts", experts, "--json", "--text-only"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.output)
        rows[experts] = (data["nvfp4_experts"], sum(s["weight_bytes"] for s in data["stages"]))
    cfg = released_tiny_config()
    moe = sum(t == "moe" for t in cfg.mlp_types)
    numel = 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size * cfg.num_experts * moe
    assert rows["auto"] == rows["nvfp4"] and rows["nvfp4"][0] and not rows["mxfp4"][0]
    # 4.5 bits and two fp32 scalars a matrix, against MXFP4's 4.25 bits
    assert rows["nvfp4"][1] - rows["mxfp4"][1] == numel // 32 + 8 * 3 * cfg.num_experts * moe
