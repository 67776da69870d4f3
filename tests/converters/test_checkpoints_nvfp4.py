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
from k3export.converters.checkpoints.loader import build_empty_model
from k3export.converters.checkpoints.synthetic import released_tiny_config, write_checkpoint
from k3export.errors import CheckpointError
from k3export.modeling import K3ForCausalLM
from nvfp4_ref import PREFIX, reference_weights

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
    config = scan_checkpoint(nvfp4_ckpt).config
    model = build_empty_model(config, torch.float64)
    state = {}
    for name, p in model.named_parameters():
        w = torch.from_numpy(weights[name])
        state[name] = w.reshape(-1)[: p.numel()].reshape(p.shape) if w.shape != p.shape else w
    model.load_state_dict(state, strict=True)
    return weights, model.eval()


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
    scales; ORT runs its 8-bit form, and with the k3 library its ``moe_experts_nvfp4`` on those bytes),
    ``--experts dense`` dequantises them: each equals the float64 model."""
    ort = pytest.importorskip("onnxruntime")
    import onnx

    from k3export.artifacts import load_export
    from k3export.converters.onnx import export_onnx
    from k3export.runtime.ort_session import ort_session

    out = export_onnx(nvfp4_ckpt, tmp_path / "export", dtype="fp32",
                      experts=None if experts == "nvfp4" else experts).out_dir
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    w1 = "model.layers.1.block_sparse_moe.experts.w1"
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
            from k3export.converters.onnx.mxfp4 import packed_model

            assert ort_ops.takes(model)
            # the library's form: the export's own bytes retyped uint8 (4 + 0.5 bits a weight), nothing converted
            packed = {t.name: t for t in packed_model(model).graph.initializer}
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
