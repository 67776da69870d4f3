"""Released-layout and Kimi-Linear fixtures: loading, converting, resuming, and every bad input's error."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from k3export.converters.checkpoints import ConversionInterrupted, convert, load_pretrained, make_plan
from k3export.converters.checkpoints.convert import partial_path
from k3export.converters.checkpoints.mxfp4 import reference_decompress
from k3export.converters.checkpoints.synthetic import write_checkpoint
from k3export.errors import CheckpointError
from k3export.modeling import K3Config, K3ForCausalLM

SHARD = 150_000  # tiny output shards so that every fixture converts into several
IDS = torch.randint(0, 512, (2, 19), generator=torch.Generator().manual_seed(0))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _reference_state_dict(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Independent of k3export's readers: safetensors' own reader + compressed-tensors' decompression."""
    cfg = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    raw: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index.values())):
        with safe_open(str(src / fname), framework="pt") as f:
            for k in f.keys():
                raw[k] = f.get_tensor(k)
    sd: dict[str, torch.Tensor] = {}
    for k, v in raw.items():
        if k.startswith(("vision_tower.", "mm_projector.")) or k.endswith(".weight_scale"):
            continue
        name = k.removeprefix("language_model.")
        if k.endswith(".weight_packed"):
            v = reference_decompress(v, raw[k.replace("weight_packed", "weight_scale")])
            name = name.replace(".weight_packed", ".weight")
        sd[name] = v.float()
    return cfg, sd


def _reference_logits(src: Path) -> torch.Tensor:
    cfg, sd = _reference_state_dict(src)
    model = K3ForCausalLM(K3Config.from_released_dict(cfg)).float().eval()
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return model(IDS).logits


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("released") / "Kimi-K3-tiny", num_shards=3)


@pytest.fixture(scope="module")
def reference_logits(released) -> torch.Tensor:
    return _reference_logits(released)


@pytest.fixture(scope="module")
def converted(released, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("converted") / "out"
    manifest = convert(released, out, max_shard_bytes=SHARD)
    return out, manifest


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    return dst


def _cli(*args: str):
    from k3export_cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _assert_not_complete(out: Path) -> None:
    for marker in ("config.json", "model.safetensors.index.json", "conversion.json"):
        assert not (out / marker).exists(), f"{marker} written although the conversion failed"


# ---------------------------------------------------------------------- the fixture itself
def test_fixture_is_in_the_released_layout(released):
    cfg = json.loads((released / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["model_type"] == "kimi_linear"
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    index = json.loads((released / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3
    names = set(index)
    assert "language_model.model.embed_tokens.weight" in names
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in names
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale" in names
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("mm_projector.") for n in names)
    assert not any(n.endswith("experts.0.w1.weight") for n in names)
    with safe_open(str(released / index["language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_packed"]),
                   framework="pt") as f:
        p = f.get_tensor("language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_packed")
        s = f.get_tensor("language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_scale")
    assert p.dtype == torch.uint8 and s.dtype == torch.uint8 and s.shape[1] * 16 == p.shape[1]


# ---------------------------------------------------------------------- loading
def test_from_pretrained_on_released_layout(released, reference_logits):
    model = K3ForCausalLM.from_pretrained(released, torch_dtype=torch.float32)
    assert (_logits(model) - reference_logits).abs().max() < 1e-5
    direct = load_pretrained(released, torch_dtype=torch.float32)
    assert (_logits(direct) - reference_logits).abs().max() < 1e-5


@pytest.mark.parametrize("spelling, expected", [("bf16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
                                                ("fp32", torch.float32), ("float16", torch.float16)])
def test_load_pretrained_takes_every_spelling_of_a_model_dtype(released, spelling, expected):
    assert load_pretrained(released, torch_dtype=spelling).model.embed_tokens.weight.dtype == expected


@pytest.mark.parametrize("spelling", ["int8", "float64", "fp8", "nonsense"])
def test_load_pretrained_refuses_other_dtypes_in_one_line(released, spelling):
    with pytest.raises(CheckpointError, match=rf"unsupported torch_dtype '{spelling}'; use float32, bfloat16, float16"):
        load_pretrained(released, torch_dtype=spelling)


@pytest.mark.parametrize("spelling, short", [("bf16", "bf16"), ("bfloat16", "bf16"), ("fp32", "fp32"),
                                             ("float32", "fp32")])
def test_convert_output_dtype_spellings(released, spelling, short):
    assert make_plan(released, dtype=spelling).options["dtype"] == short


@pytest.mark.parametrize("spelling", ["fp16", "int8", "nonsense"])
def test_convert_refuses_other_output_dtypes(released, spelling):
    with pytest.raises(CheckpointError, match=rf"unknown output dtype '{spelling}'; use one of bf16, fp32"):
        make_plan(released, dtype=spelling)


def test_load_pretrained_bf16_decodes_experts_bit_identically(released):
    model = load_pretrained(released, torch_dtype=torch.bfloat16)
    _, sd = _reference_state_dict(released)
    state = model.state_dict()
    for name in ("model.layers.1.block_sparse_moe.experts.7.w3.weight", "model.layers.5.block_sparse_moe.experts.0.w2.weight"):
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name].float(), sd[name])
    assert state["model.layers.0.self_attn.A_log"].dtype == torch.float32


def test_converted_output_loads_with_equal_logits(converted, reference_logits):
    out, _ = converted
    model = K3ForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    assert (_logits(model) - reference_logits).abs().max() < 1e-5


def test_converted_layout_manifest_and_sharding(converted, released):
    out, manifest = converted
    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) >= 4
    for name in ("config.json", "model.safetensors.index.json", "conversion.json", "generation_config.json",
                 "configuration_k3.py", "modeling_k3.py", "tokenizer_config.json", "tiktoken.model",
                 "tokenization_kimi.py"):
        assert name in files
    assert not (out / ".k3export-partial").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "k3" and "AutoModelForCausalLM" in cfg["auto_map"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(shards)
    assert not any(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in index)
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in index
    on_disk = json.loads((out / "conversion.json").read_text())
    assert on_disk == manifest
    assert set(manifest) >= {"tool", "tool_version", "created", "source", "options", "outputs", "skipped"}
    assert manifest["tool"] == "k3export"
    assert set(manifest["source"]) >= {"name", "repo_id", "revision", "files"}
    assert manifest["skipped"] == {"mm_projector": 3, "vision_tower": 5}
    assert manifest["options"]["dtype"] == "bf16" and manifest["options"]["keep_mxfp4"] is False
    for o in manifest["outputs"]:
        assert o["sha256"] == _sha(out / o["name"]) and o["bytes"] == (out / o["name"]).stat().st_size
    src_files = {f["name"]: f for f in manifest["source"]["files"]}
    for f in json.loads((released / "model.safetensors.index.json").read_text())["weight_map"].values():
        assert src_files[f]["sha256"] == _sha(released / f)
    for o in manifest["outputs"]:
        assert o["bytes"] <= SHARD + 4096  # header + one tensor may exceed only if a tensor is bigger
    # dense weights: bf16 output; fp32-kept parameters stay fp32
    with safe_open(str(out / index["model.layers.0.self_attn.A_log"]), framework="pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.A_log").dtype == torch.float32
    with safe_open(str(out / index["model.embed_tokens.weight"]), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_fp32_output_and_workers_give_deterministic_shards(released, converted, reference_logits, tmp_path):
    out, manifest = converted
    result = _cli("convert", released, tmp_path / "w2", "--workers", "2", "--max-shard-size", str(SHARD),
                  "--no-progress")
    assert result.exit_code == 0, result.output
    m2 = json.loads((tmp_path / "w2" / "conversion.json").read_text())
    assert [(o["name"], o["sha256"]) for o in m2["outputs"]] == [(o["name"], o["sha256"]) for o in manifest["outputs"]]
    convert(released, tmp_path / "f32", dtype="fp32", max_shard_bytes=SHARD)
    model = K3ForCausalLM.from_pretrained(tmp_path / "f32", torch_dtype=torch.float32)
    # fp32 sums in another order (experts stacked on first use vs the reference's per-expert parameters): 3e-5 seen
    assert (_logits(model) - reference_logits).abs().max() < 1e-4


def test_keep_mxfp4_keeps_bytes_and_loads(released, reference_logits, tmp_path):
    out = tmp_path / "kept"
    convert(released, out, keep_mxfp4=True, max_shard_bytes=SHARD)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.3.block_sparse_moe.experts.2.w1.weight_packed"
    with safe_open(str(out / index[name]), framework="pt") as f:
        kept = f.get_tensor(name)
    src_index = json.loads((released / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(released / src_index["language_model." + name]), framework="pt") as f:
        assert torch.equal(kept, f.get_tensor("language_model." + name))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    model = load_pretrained(out, torch_dtype=torch.float32)
    assert (_logits(model) - reference_logits).abs().max() < 1e-5
    # K3ForCausalLM.from_pretrained routes a kept-MXFP4 folder through the same reader.
    model = K3ForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    assert (_logits(model) - reference_logits).abs().max() < 1e-5


def test_kimi_linear_fixture_against_transformers_peer(tmp_path):
    from transformers import KimiLinearForCausalLM

    src = write_checkpoint(tmp_path / "kimi-linear", layout="kimi_linear", num_shards=2)
    peer = KimiLinearForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ours = K3ForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    ref = _reference_logits(src)
    assert (_logits(ours) - ref).abs().max() < 1e-5
    assert (_logits(peer) - _logits(ours)).abs().max() < 1e-4
    convert(src, tmp_path / "out", max_shard_bytes=SHARD)
    again = K3ForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    assert (_logits(again) - ref).abs().max() < 1e-5


# ---------------------------------------------------------------------- plan
def test_plan_cli_and_api(released):
    plan = make_plan(released, max_shard_bytes=SHARD)
    s = plan.summary()
    assert s["by_kind"]["expert_mxfp4 -> dense"]["tensors"] == 5 * 8 * 3
    assert s["by_kind"]["expert_mxfp4 -> dense"]["bytes_out"] == 5 * 8 * 3 * 32 * 64 * 2
    assert s["skipped"] == {"mm_projector": 3, "vision_tower": 5}
    assert s["bytes_in"] == sum(p.stat().st_size for p in released.glob("*.safetensors"))
    assert s["peak_memory_bytes"] > 0 and s["disk_bytes"] == plan.bytes_out
    result = _cli("plan", released, "--max-shard-size", str(SHARD))
    assert result.exit_code == 0, result.output
    assert "expert_mxfp4 -> dense" in result.output and "vision_tower" in result.output
    assert "peak memory" in result.output
    assert "weight bytes by form" in result.output and "ONNX Runtime resident, MXFP4 export" in result.output
    result = _cli("plan", released, "--json", "--max-shard-size", str(SHARD))
    data = json.loads(result.output)
    assert data["output_shards"] == len(plan.shards) and data["skipped"] == s["skipped"]
    # the released form priced from the config equals the text tensors' bytes the files' headers declare
    itemsize = {"BF16": 2, "F32": 4, "U8": 1}
    stored = 0
    for f in released.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            for name in h.keys():
                if not name.startswith(("vision_tower", "mm_projector")):
                    part = h.get_slice(name)
                    stored += math.prod(part.get_shape()) * itemsize[part.get_dtype()]
    assert data["weight_bytes_by_form"]["released checkpoint (MXFP4 experts)"] == stored


# ---------------------------------------------------------------------- resume
def test_resume_after_interruption_gives_identical_output(released, converted, tmp_path):
    ref_out, manifest = converted
    out = tmp_path / "out"
    with pytest.raises(ConversionInterrupted):
        convert(released, out, max_shard_bytes=SHARD, stop_after_shards=3)
    _assert_not_complete(out)
    assert not out.exists()  # the work is in the marked partial folder beside it
    first = {p.name: p.stat().st_mtime_ns for p in partial_path(out).glob("model-*.safetensors")}
    assert len(first) == 3
    m2 = convert(released, out, max_shard_bytes=SHARD)
    assert [(o["name"], o["sha256"]) for o in m2["outputs"]] == [(o["name"], o["sha256"]) for o in manifest["outputs"]]
    for name, mtime in first.items():  # verified, not rewritten
        assert (out / name).stat().st_mtime_ns == mtime
    assert not partial_path(out).exists()
    # a damaged shard of an interrupted conversion is detected by its sha256 and rewritten
    out2 = tmp_path / "out2"
    with pytest.raises(ConversionInterrupted):
        convert(released, out2, max_shard_bytes=SHARD, stop_after_shards=3)
    victim = partial_path(out2) / manifest["outputs"][1]["name"]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    m3 = convert(released, out2, max_shard_bytes=SHARD)
    assert m3["outputs"] == manifest["outputs"]


def test_a_conversion_stopped_while_writing_its_plan_starts_over(released, converted, tmp_path):
    """A signal at once can leave the partial folder with its state folder and no plan in it yet: nothing to keep,
    so the next run converts from the start (the same bytes) instead of refusing the folder as another source's."""
    from k3export.converters.checkpoints.convert import STATE_DIR

    _, manifest = converted
    out = tmp_path / "out"
    with pytest.raises(ConversionInterrupted):
        convert(released, out, max_shard_bytes=SHARD, stop_after_shards=1)
    work = partial_path(out)
    for p in work.iterdir():  # back to the moment the plan was being written
        if p.name == STATE_DIR:
            shutil.rmtree(p)
            p.mkdir()
            (p / ".tmp-plan.json").write_text("{")
        elif p.name != ".k3export":
            p.unlink()
    m = convert(released, out, max_shard_bytes=SHARD)
    assert [(o["name"], o["sha256"]) for o in m["outputs"]] == [(o["name"], o["sha256"]) for o in manifest["outputs"]]


_KILLER = """
import os, sys
import k3export.converters.checkpoints
conv = sys.modules["k3export.converters.checkpoints.convert"]
real = conv.SafetensorsWriter.finish
count = 0
def dying_finish(self, before_rename=None):
    def record_then_die(nbytes, sha):  # the shard's record written, the shard not yet renamed into place
        global count
        before_rename(nbytes, sha)
        count += 1
        if count == int(sys.argv[3]):
            os._exit(9)  # as a SIGKILL would: no cleanup, no exception handling
    return real(self, before_rename=record_then_die)
conv.SafetensorsWriter.finish = dying_finish
conv.convert(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[4]))
"""


def test_resume_after_killed_process(released, converted, tmp_path):
    _, manifest = converted
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _KILLER, str(released), str(out), "4", str(SHARD)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr
    _assert_not_complete(out)
    assert len(list(partial_path(out).glob("model-*.safetensors"))) == 3  # the 4th is recorded, not in place
    result = _cli("convert", released, out, "--max-shard-size", str(SHARD), "--no-progress")
    assert result.exit_code == 0, result.output
    m2 = json.loads((out / "conversion.json").read_text())
    assert [(o["name"], o["sha256"]) for o in m2["outputs"]] == [(o["name"], o["sha256"]) for o in manifest["outputs"]]


# ---------------------------------------------------------------------- bad input: one clear error each
def _shard_of(src: Path, name: str) -> Path:
    return src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]


def _edit_shard(src: Path, name: str, edit) -> Path:
    """Rewrite the shard holding `name` with safetensors' own writer, after `edit(tensors)`; keep the index in sync."""
    path = _shard_of(src, name)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != path.name or k in tensors}
    for k in tensors:
        index["weight_map"][k] = path.name
    index_path.write_text(json.dumps(index))
    return path


EMBED = "language_model.model.embed_tokens.weight"
EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.4.w1"


def _truncate(src):
    p = _shard_of(src, EMBED)
    p.write_bytes(p.read_bytes()[:-100])
    return p.name


def _corrupt_header(src):
    p = _shard_of(src, EMBED)
    raw = bytearray(p.read_bytes())
    raw[8:12] = b"\x00\xff]]"
    p.write_bytes(bytes(raw))
    return p.name


def _offsets_past_end(src):
    p = _shard_of(src, EMBED)
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    begin = header[EMBED]["data_offsets"][0]
    header[EMBED]["data_offsets"] = [begin + 10**9, begin + 10**9 + 512 * 64 * 2]
    new = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    return EMBED


def _missing_shard(src):
    p = _shard_of(src, EMBED)
    p.unlink()
    return p.name


def _missing_tensor(src):
    _edit_shard(src, EMBED, lambda t: t.pop(EMBED))
    return EMBED


def _wrong_shape(src):
    name = "language_model.model.layers.0.self_attn.o_proj.weight"
    _edit_shard(src, name, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    return name


def _wrong_dtype(src):
    name = "language_model.model.norm.weight"
    _edit_shard(src, name, lambda t: t.__setitem__(name, t[name].to(torch.int32)))
    return name


def _scales_mismatch(src):
    name = EXPERT + ".weight_scale"
    _edit_shard(src, name, lambda t: t.__setitem__(name, t[name][:, :1].contiguous()))
    return name


def _unknown_quant_method(src):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (src / "config.json").write_text(json.dumps(cfg))
    return "gptq"


def _unknown_format(src):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["format"] = "nvfp4-pack-quantized"
    cfg["quantization_config"]["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    (src / "config.json").write_text(json.dumps(cfg))
    return "nvfp4-pack-quantized"


def _foreign_model_type(src):
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    return "'llama'"


def _config_not_an_object(src):
    (src / "config.json").write_text("[1, 2]")
    return "config.json"


def _symlink_escape(src):
    p = _shard_of(src, EMBED)
    outside = src.parent / "elsewhere.safetensors"
    shutil.move(p, outside)
    os.symlink(outside, p)
    return p.name


BAD_INPUTS = {
    "truncated shard": (_truncate, "truncated"),
    "corrupted header": (_corrupt_header, "corrupted header"),
    "offsets past end": (_offsets_past_end, "past"),
    "index naming missing shard": (_missing_shard, "missing"),
    "missing tensor": (_missing_tensor, "missing tensor"),
    "wrong shape": (_wrong_shape, "wrong shape"),
    "wrong dtype": (_wrong_dtype, "wrong dtype"),
    "scales not matching packed": (_scales_mismatch, "do not match packed"),
    "unknown quant_method": (_unknown_quant_method, "unknown quant_method"),
    "unknown format": (_unknown_format, "unknown quantization format"),
    "symlink escaping source": (_symlink_escape, "symlink escapes"),
    "foreign model_type": (_foreign_model_type, "not a K3 / Kimi-Linear model folder"),
    "config.json not an object": (_config_not_an_object, "not a JSON object"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gives_one_clear_error(case, released, tmp_path):
    src = _copy(released, tmp_path)
    damage, phrase = BAD_INPUTS[case]
    named = damage(src)
    out = tmp_path / "out"
    result = _cli("convert", src, out, "--max-shard-size", str(SHARD), "--no-progress")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert phrase in result.output and named in result.output.replace("\n", ""), result.output
    _assert_not_complete(out)
    with pytest.raises(CheckpointError):
        load_pretrained(src)


def test_nan_refused_unless_allowed(released, tmp_path):
    src = _copy(released, tmp_path)
    name = "language_model.model.layers.4.self_attn.q_proj.weight"

    def poison(t):
        t[name][1, 2] = float("nan")

    _edit_shard(src, name, poison)
    result = _cli("convert", src, tmp_path / "checked", "--max-shard-size", str(SHARD), "--no-progress")
    assert result.exit_code == 2, result.output
    assert "NaN/Inf" in result.output and name in result.output.replace("\n", "")
    _assert_not_complete(tmp_path / "checked")
    assert _cli("convert", src, tmp_path / "unchecked", "--allow-nonfinite", "--max-shard-size", str(SHARD),
                "--no-progress").exit_code == 0
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        load_pretrained(src, check_finite=True)


def test_nan_expert_scale_refused_unless_allowed(released, tmp_path):
    src = _copy(released, tmp_path)
    name = EXPERT + ".weight_scale"

    def poison(t):
        t[name][0, 0] = 255

    _edit_shard(src, name, poison)
    with pytest.raises(CheckpointError, match=r"experts\.4\.w1\.weight_scale.*0xFF"):
        convert(src, tmp_path / "out", max_shard_bytes=SHARD)
    with pytest.raises(CheckpointError, match=r"weight_scale.*0xFF"):
        convert(src, tmp_path / "kept", keep_mxfp4=True, max_shard_bytes=SHARD)
    convert(src, tmp_path / "allowed", allow_nonfinite=True, keep_mxfp4=True, max_shard_bytes=SHARD)


# ---------------------------------------------------------------------- the unit pipeline (reader / decode / writer)
def test_pipeline_with_tiny_queues_gives_identical_output(released, converted, tmp_path, monkeypatch):
    """Queues that hold one item at a time make every stage wait on the others; the bytes do not change."""
    conv = sys.modules["k3export.converters.checkpoints.convert"]

    _, manifest = converted
    monkeypatch.setattr(conv, "_QUEUE_BYTES", 1)
    m2 = convert(released, tmp_path / "out", max_shard_bytes=SHARD)
    assert m2["outputs"] == manifest["outputs"]
    assert m2["source"]["files"] == manifest["source"]["files"]
    # one output shard per source shard: streamed tensor by tensor, same tensors
    big = convert(released, tmp_path / "one-shard", max_shard_bytes=10**12)
    assert len(big["outputs"]) < len(m2["outputs"])

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        out = {}
        for f in sorted(folder.glob("model-*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
        return out

    a, b = tensors(tmp_path / "out"), tensors(tmp_path / "one-shard")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_writer_failure_stops_every_stage_and_resumes(released, converted, tmp_path, monkeypatch):
    """A failing write (e.g. disk full) in the writer thread surfaces as that error; no thread or temp file
    is left behind, the shards already in place are kept and a re-run completes them."""
    import threading

    conv = sys.modules["k3export.converters.checkpoints.convert"]

    _, manifest = converted
    real = conv.SafetensorsWriter.write
    calls = {"n": 0}

    def failing_write(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 40:
            raise OSError(28, "No space left on device")
        return real(self, name, tensor)

    threads = threading.active_count()
    monkeypatch.setattr(conv.SafetensorsWriter, "write", failing_write)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        convert(released, out, max_shard_bytes=SHARD)
    assert threading.active_count() == threads
    assert not list(partial_path(out).glob("*.tmp-*"))
    _assert_not_complete(out)
    kept = list(partial_path(out).glob("model-*.safetensors"))
    assert 0 < len(kept) < len(manifest["outputs"])
    monkeypatch.setattr(conv.SafetensorsWriter, "write", real)
    m2 = convert(released, out, max_shard_bytes=SHARD)
    assert m2["outputs"] == manifest["outputs"]


# ---------------------------------------------------------------------- config.json: one reader, read once
def test_every_model_type_k3export_reads_has_its_layout():
    from k3export.converters.checkpoints.layouts import LAYOUTS
    from k3export.modeling.configuration_k3 import MODEL_TYPES

    assert sorted(LAYOUTS) == sorted(MODEL_TYPES)


def test_a_config_handed_to_scan_checkpoint_is_checked_as_the_reader_checks_it(released):
    from k3export.converters.checkpoints.plan import scan_checkpoint

    cfg = json.loads((released / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"not a K3 / Kimi-Linear model folder: config.json has model_type "
                                              r"'llama' \(k3export reads 'k3', 'kimi_k3' or 'kimi_linear'\)"):
        scan_checkpoint(released, config_json=dict(cfg, model_type="llama"))
    with pytest.raises(CheckpointError, match="config.json is not a JSON object"):
        scan_checkpoint(released, config_json=[cfg])  # type: ignore[arg-type]


@pytest.mark.parametrize("weights", [False, True])
def test_an_export_parses_config_json_once(released, tmp_path, monkeypatch, weights):
    """Every open of a config.json is counted, whoever opens it."""
    import builtins
    import io

    from k3export.converters.onnx import export_onnx

    opened = []
    real_open = io.open

    def counting(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).name == "config.json":
            opened.append(Path(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    export_onnx(released, tmp_path / "out", weights=weights)
    assert opened == [released / "config.json"]
