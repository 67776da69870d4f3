"""``convert`` and ``plan`` of a checkpoint with a vision tower: the image + text layout K3ForConditionalGeneration
writes (its logits equal to loading the source itself), ``--text-only`` giving the text model alone, the plan's
vision bytes against the shard headers, resume, a bad vision tensor refused, and the fake-vision text fixture
converting text-only as before."""

from __future__ import annotations

import json
import math
import shutil
import warnings

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from k3export.converters.checkpoints import convert, make_plan
from k3export.converters.checkpoints.convert import ConversionInterrupted
from k3export.converters.checkpoints.layouts import expected_tensors
from k3export.converters.checkpoints.safetensors_io import write_safetensors
from k3export.converters.checkpoints.synthetic import write_checkpoint
from k3export.converters.checkpoints.synthetic_vision import write_vision_checkpoint
from k3export.errors import CheckpointError
from k3export.modeling import K3ForCausalLM, K3ForConditionalGeneration

VISION = ("vision_tower.", "mm_projector.")
INDEX = "model.safetensors.index.json"
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I32": 4}


def _cli(*args):
    from k3export_cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _headers(folder) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor -> (dtype, shape) of every tensor of a folder, from the safetensors headers (safetensors' reader)."""
    out = {}
    for fname in sorted(p.name for p in folder.glob("*.safetensors")):
        with safe_open(str(folder / fname), framework="pt") as f:
            for k in f.keys():
                view = f.get_slice(k)
                out[k] = (view.get_dtype(), tuple(view.get_shape()))
    return out


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for fname in sorted(p.name for p in folder.glob("*.safetensors")):
        with safe_open(str(folder / fname), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _nbytes(dtype_shape) -> int:
    dtype, shape = dtype_shape
    return ITEMSIZE[dtype] * math.prod(shape)


def _image_prompt(config, seed: int = 0):
    v = config.vision_config
    grids = torch.tensor([[1, 4, 6], [2, 2, 2]])  # 6 + 1 merged tokens
    pixels = torch.randn(int(grids.prod(-1).sum()), 3, v.patch_size, v.patch_size,
                         generator=torch.Generator().manual_seed(seed))
    ids = torch.tensor([[5, 6] + [config.media_placeholder_token_id] * 7 + [7, 8]])
    return dict(input_ids=ids, pixel_values=pixels, grid_thws=grids, use_cache=False)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("vlconv") / "released", num_shards=2)


@pytest.fixture(scope="module")
def reference(released):
    """The source loaded by `K3ForConditionalGeneration.from_pretrained` itself (fp32) and its image-prompt logits."""
    model = K3ForConditionalGeneration.from_pretrained(released)
    with torch.no_grad():
        logits = model(**_image_prompt(model.config)).logits
    return model, logits


# ------------------------------------------------------------------------------------------- image + text convert


def test_cli_convert_writes_the_image_text_layout_with_the_source_logits(released, reference, tmp_path):
    out = tmp_path / "vl"
    result = _cli("convert", released, out, "--no-progress")
    assert result.exit_code == 0, result.output
    model, want = reference
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["architectures"] == ["K3ForConditionalGeneration"]
    assert {"text_config", "vision_config"} <= set(cfg) and cfg["media_placeholder_token_id"] == 3
    assert cfg["dtype"] == "bfloat16"
    # the names K3ForConditionalGeneration has (the model, not the plan, is the reference), dense experts
    heads = _headers(out)
    assert set(heads) == set(model.state_dict())
    index = json.loads((out / INDEX).read_text())["weight_map"]
    assert set(index) == set(heads)
    assert not any(k.endswith(("weight_packed", "weight_scale")) for k in heads)
    src = _tensors(released)
    got = _tensors(out)
    for name in (k for k in got if k.startswith(VISION)):  # bf16 source -> bf16: the very bytes
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], src[name]), name
    for name in ("preprocessor_config.json", "processor_config.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (released / name).read_bytes(), name
    for name in ("modeling_k3_vision.py", "image_processing_k3.py", "modeling_k3.py", "configuration_k3.py"):
        assert (out / name).is_file(), name
    assert json.loads((out / "conversion.json").read_text())["skipped"] == {}

    from transformers import AutoModel

    again = K3ForConditionalGeneration.from_pretrained(out)
    remote = AutoModel.from_pretrained(out, trust_remote_code=True)  # the code files that travelled
    assert type(remote).__module__.startswith("transformers_modules")
    with torch.no_grad():
        for other in (again, remote):
            assert torch.equal(other(**_image_prompt(other.config)).logits, want)
    # the text model alone still loads from the image + text folder, as from the source
    text, text_src = K3ForCausalLM.from_pretrained(out), K3ForCausalLM.from_pretrained(released)
    ids = torch.tensor([[1, 5, 9, 17, 4]])
    with torch.no_grad():
        assert torch.equal(text(ids, use_cache=False).logits, text_src(ids, use_cache=False).logits)


@pytest.mark.parametrize("style, dtype, keep_mxfp4", [("released", "fp32", True), ("dev", "fp32", False)])
def test_library_convert_fp32_and_kept_mxfp4_give_the_source_logits(style, dtype, keep_mxfp4, released, reference,
                                                                     tmp_path):
    src = released if style == "released" else write_vision_checkpoint(tmp_path / "dev", style="dev", num_shards=2)
    want = reference[1] if style == "released" else None
    if want is None:
        with torch.no_grad():
            model = K3ForConditionalGeneration.from_pretrained(src)
            want = model(**_image_prompt(model.config)).logits
    out = tmp_path / "out"
    convert(src, out, dtype=dtype, keep_mxfp4=keep_mxfp4)
    heads = _headers(out)
    vision = {k: v for k, v in heads.items() if k.startswith(VISION)}
    assert len(vision) == len(_headers(src).keys() & set(vision)) > 0
    assert all(d == "F32" for d, _ in vision.values())  # cast to --dtype
    packed = [k for k in heads if k.endswith(".weight_packed")]
    assert bool(packed) == keep_mxfp4 and all(k.startswith("language_model.") for k in packed)
    if keep_mxfp4:
        assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    got = K3ForConditionalGeneration.from_pretrained(out)
    with torch.no_grad():  # bf16 -> fp32 and MXFP4 -> fp32 are exact: the same logits, bit for bit
        assert torch.equal(got(**_image_prompt(got.config)).logits, want)


def test_an_interrupted_image_text_convert_resumes_to_the_same_bytes(released, tmp_path):
    whole = tmp_path / "whole"
    convert(released, whole)
    out = tmp_path / "resumed"
    with pytest.raises(ConversionInterrupted):
        convert(released, out, stop_after_shards=1)
    assert not out.exists()
    with pytest.raises(CheckpointError, match="other options"):  # the partial output is image + text
        convert(released, out, text_only=True)
    convert(released, out)
    for name in json.loads((whole / INDEX).read_text())["weight_map"].values():
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name


def test_a_bad_vision_tensor_is_refused_in_one_line_and_text_only_still_converts(released, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(released, src)
    index = json.loads((src / INDEX).read_text())["weight_map"]
    name = "mm_projector.proj.0.weight"
    fname = index[name]
    with safe_open(str(src / fname), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = tensors[name][:, :-1].contiguous()
    write_safetensors(src / fname, tensors, {"format": "pt"})
    result = _cli("convert", src, tmp_path / "out", "--no-progress")
    assert result.exit_code != 0
    lines = [ln for ln in result.output.strip().splitlines() if ln]
    assert len(lines) == 1 and name in lines[0] and "vision_config needs" in lines[0] and "--text-only" in lines[0], \
        result.output
    assert not (tmp_path / "out").exists()
    result = _cli("convert", src, tmp_path / "text", "--no-progress", "--text-only")
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------------------------------- text-only output


def test_text_only_gives_the_text_convert_of_the_same_source(released, tmp_path):
    out = tmp_path / "text"
    result = _cli("convert", released, out, "--no-progress", "--text-only")
    assert result.exit_code == 0, result.output
    # the same source without its vision_config converts through the text path: the reference output
    plain = tmp_path / "plain-src"
    shutil.copytree(released, plain)
    cfg = json.loads((plain / "config.json").read_text())
    del cfg["vision_config"]
    (plain / "config.json").write_text(json.dumps(cfg))
    ref = tmp_path / "plain"
    convert(plain, ref)
    files = {p.name for p in out.iterdir()}
    assert files == {p.name for p in ref.iterdir()}
    assert not files & {"preprocessor_config.json", "processor_config.json", "modeling_k3_vision.py"}
    heads = _headers(out)
    assert set(heads) == set(_headers(ref)) == set(expected_tensors(K3ForCausalLM.from_pretrained(ref).config))
    assert not any(k.startswith(VISION) or k.startswith("language_model.") for k in heads)
    for name in [*json.loads((ref / INDEX).read_text())["weight_map"].values(), "config.json", INDEX]:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    vision = {k for k in _headers(released) if k.startswith(VISION)}
    skipped = json.loads((out / "conversion.json").read_text())["skipped"]
    assert skipped == {g: sum(k.startswith(g + ".") for k in vision) for g in ("mm_projector", "vision_tower")}


def test_the_fake_vision_text_fixture_still_converts_text_only(tmp_path):
    src = write_checkpoint(tmp_path / "src", layout="kimi_k3", num_shards=2)
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = convert(src, out)
    assert any("converting the text model alone" in str(w.message) for w in caught)
    assert manifest["options"]["vision"] is False
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["K3ForCausalLM"] and "vision_config" not in cfg
    heads = _headers(out)
    assert set(heads) == set(expected_tensors(K3ForCausalLM.from_pretrained(out).config))
    vision = [k for k in _headers(src) if k.startswith(VISION)]
    assert vision and not any(k.startswith(VISION) for k in heads)
    assert sum(manifest["skipped"].values()) == len(vision)


# ------------------------------------------------------------------------------------------- plan


@pytest.mark.parametrize("dtype, factor", [("bf16", 1), ("fp32", 2)])
def test_plan_vision_bytes_are_the_headers(released, dtype, factor):
    vision = {k: v for k, v in _headers(released).items() if k.startswith(VISION)}
    assert {d for d, _ in vision.values()} == {"BF16"}
    result = _cli("plan", released, "--json", "--dtype", dtype)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["vision"] is True and plan["skipped"] == {} and plan["skipped_bytes"] == 0
    for group in ("vision_tower", "mm_projector"):
        mine = [v for k, v in vision.items() if k.startswith(group + ".")]
        row = plan["by_kind"][group]
        assert row["tensors"] == len(mine) > 0
        assert row["bytes_in"] == sum(map(_nbytes, mine))
        assert row["bytes_out"] == factor * row["bytes_in"]
    table = _cli("plan", released)
    assert table.exit_code == 0 and "image + text" in table.output and "mm_projector" in table.output


def test_plan_text_only_skips_the_vision_bytes(released):
    vision = {k: v for k, v in _headers(released).items() if k.startswith(VISION)}
    result = _cli("plan", released, "--json", "--text-only")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["vision"] is False and not {"vision_tower", "mm_projector"} & set(plan["by_kind"])
    assert plan["skipped_bytes"] == sum(map(_nbytes, vision.values()))
    assert sum(plan["skipped"].values()) == len(vision)
    full = make_plan(released)
    assert full.bytes_out - make_plan(released, text_only=True).bytes_out == sum(map(_nbytes, vision.values()))


def test_push_carries_a_converted_image_text_checkpoint(released, tmp_path):
    """What `push` uploads from an image + text convert: every shard, the config, the processor files and the code
    files (the folder is ours although its model_type is the released one)."""
    from k3export.hub.detect import CHECKPOINT, detect_artifact

    out = tmp_path / "vl"
    assert _cli("convert", released, out, "--no-progress").exit_code == 0
    art = detect_artifact(out)
    published = {f.path_in_repo for f in art.files}
    assert art.kind == CHECKPOINT
    assert {p.name for p in out.glob("*.safetensors")} <= published
    assert {"config.json", "preprocessor_config.json", "modeling_k3_vision.py", "image_processing_k3.py"} <= published
    with pytest.raises(Exception, match="model_type 'kimi_k3'"):  # the released folder itself is not ours
        detect_artifact(released)
