"""Loading K3 with its vision tower: the released layout and the development checkpoint's, round trips through
save_pretrained and trust_remote_code, tensors read by shape (A_log), and a bad vision tensor refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from k3export.converters.checkpoints.layouts import accepted_shapes, check_stored_shape, fit_stored
from k3export.converters.checkpoints.safetensors_io import write_safetensors
from k3export.converters.checkpoints.synthetic_vision import vision_tiny_config, write_vision_checkpoint
from k3export.errors import CheckpointError
from k3export.modeling import K3ForCausalLM, K3ForConditionalGeneration
from k3export.modeling.modeling_k3 import K3CheckpointError

VISION = ("vision_tower.", "mm_projector.")


def _stored(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, read with safetensors itself."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in sorted(set(index.values())):
        with safe_open(str(folder / fname), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("vl") / "released", num_shards=2)


def _image_prompt(model, seed: int = 0):
    cfg = model.config.vision_config
    grids = torch.tensor([[1, 4, 6], [2, 2, 2]])
    pixels = torch.randn(int(grids.prod(-1).sum()), 3, cfg.patch_size, cfg.patch_size,
                         generator=torch.Generator().manual_seed(seed))
    n = 6 + 1
    ids = torch.tensor([[5, 6] + [model.config.media_placeholder_token_id] * n + [7, 8]])
    return dict(input_ids=ids, pixel_values=pixels, grid_thws=grids, use_cache=False)


def test_released_layout_keeps_every_vision_tensor(released):
    model = K3ForConditionalGeneration.from_pretrained(released)
    stored = _stored(released)
    params = dict(model.named_parameters())
    vision = {k: v for k, v in stored.items() if k.startswith(VISION)}
    assert set(vision) == {k for k in params if k.startswith(VISION)} and len(vision) == 18
    for name, value in vision.items():
        assert torch.equal(params[name].detach(), value.float()), name
    text = K3ForCausalLM.from_pretrained(released)  # the text-only load of the same folder, unchanged
    for name, value in text.state_dict().items():
        assert torch.equal(model.language_model.state_dict()[name], value), name
    half = K3ForConditionalGeneration.from_pretrained(released, torch_dtype="bfloat16")
    assert half.vision_tower.encoder.blocks[0].wqkv.weight.dtype == torch.bfloat16
    prompt = _image_prompt(model)
    with torch.no_grad():
        assert torch.isfinite(model(**prompt).logits).all()
        full = model.get_image_features(prompt["pixel_values"], prompt["grid_thws"])
        low = half.get_image_features(prompt["pixel_values"], prompt["grid_thws"])
    assert low.dtype == torch.bfloat16 and (low.float() - full).abs().max() < 0.03 * full.abs().max()


def test_development_layout_loads_end_to_end(tmp_path):
    folder = write_vision_checkpoint(tmp_path / "dev", style="dev", num_shards=2)
    cfg = json.loads((folder / "config.json").read_text())
    assert "gate_lower_bound" not in cfg["text_config"]["linear_attn_config"]
    assert cfg["vision_config"]["model_type"] == ""
    assert cfg["text_config"]["head_dim"] not in (cfg["text_config"]["qk_nope_head_dim"],
                                                  cfg["text_config"]["qk_rope_head_dim"])
    model = K3ForConditionalGeneration.from_pretrained(folder)
    text = model.config.text_config
    assert text.linear_attn_config["gate_lower_bound"] is None and text.num_shared_experts == 1
    assert model.config.vision_config.vt_num_hidden_layers == 2
    stored = _stored(folder)
    for name, p in model.named_parameters():
        if name.startswith(VISION):
            assert torch.equal(p.detach(), stored[name].float()), name
    with torch.no_grad():
        assert torch.isfinite(model(**_image_prompt(model)).logits).all()


def test_save_pretrained_round_trip_and_remote_code(released, tmp_path):
    from transformers import AutoModel

    model = K3ForConditionalGeneration.from_pretrained(released)
    model.save_pretrained(tmp_path / "saved")
    for name in ("modeling_k3_vision.py", "modeling_k3.py", "configuration_k3.py", "contract.py"):
        assert (tmp_path / "saved" / name).is_file()
    again = K3ForConditionalGeneration.from_pretrained(tmp_path / "saved")
    remote = AutoModel.from_pretrained(tmp_path / "saved", trust_remote_code=True)
    assert type(remote).__module__.startswith("transformers_modules")
    prompt = _image_prompt(model, seed=1)
    with torch.no_grad():
        want = model(**prompt).logits
        for other in (again, remote):
            assert torch.equal(other(**prompt).logits, want)


# ------------------------------------------------------------------------------------------- bad vision tensors


def _rewrite(folder, name: str, value: torch.Tensor | None, extra: tuple[str, torch.Tensor] | None = None) -> None:
    """Replace (or, with None, drop) tensor `name` in its shard, optionally adding `extra`; the index follows."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    fname = index["weight_map"][name]
    with safe_open(str(folder / fname), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if value is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = value
    if extra is not None:
        tensors[extra[0]] = extra[1]
        index["weight_map"][extra[0]] = fname
    write_safetensors(folder / fname, tensors, {"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("edit, phrase", [
    ("shape", r"model-00001-of-00003\.safetensors: tensor 'vision_tower\.encoder\.blocks\.1\.wqkv\.weight' has "
              r"shape \[144, 16\]; vision_config needs \[144, 32\]"),
    ("missing", r"missing vision tensor 'mm_projector\.post_norm\.weight' \[64\] required by vision_config"),
    ("unexpected", r"unexpected vision tensor 'mm_projector\.rot_proj\.weight' \[64, 64\]"),
    ("dtype", r"tensor 'vision_tower\.patch_embed\.pos_emb\.weight' has dtype I32; expected a float dtype"),
])
def test_a_bad_vision_tensor_is_refused_in_one_line(tmp_path, edit, phrase):
    folder = write_vision_checkpoint(tmp_path / "bad", num_shards=2)
    if edit == "shape":
        _rewrite(folder, "vision_tower.encoder.blocks.1.wqkv.weight", torch.zeros(144, 16, dtype=torch.bfloat16))
    elif edit == "missing":
        _rewrite(folder, "mm_projector.post_norm.weight", None)
    elif edit == "unexpected":
        _rewrite(folder, "mm_projector.proj.0.weight", torch.zeros(128, 128, dtype=torch.bfloat16),
                 extra=("mm_projector.rot_proj.weight", torch.zeros(64, 64, dtype=torch.bfloat16)))
    else:
        _rewrite(folder, "vision_tower.patch_embed.pos_emb.weight", torch.zeros(6, 6, 32, dtype=torch.int32))
    with pytest.raises(K3CheckpointError, match=phrase) as info:
        K3ForConditionalGeneration.from_pretrained(folder)
    assert "\n" not in str(info.value)


def test_a_corrupt_vision_shard_and_a_text_only_folder_are_refused(tmp_path, released):
    from k3export.converters.checkpoints.synthetic import write_checkpoint

    folder = write_vision_checkpoint(tmp_path / "corrupt", num_shards=1)
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(K3CheckpointError, match="not a readable safetensors file"):
        K3ForConditionalGeneration.from_pretrained(folder)
    text_only = write_checkpoint(tmp_path / "text", layout="kimi_linear")
    with pytest.raises(K3CheckpointError, match="model_type 'kimi_linear'; a K3 with a vision tower has 'kimi_k3'"):
        K3ForConditionalGeneration.from_pretrained(text_only)


# ------------------------------------------------------------------------------------------- read by shape


def test_a_log_is_read_by_its_shape():
    k3 = vision_tiny_config("released").text_config  # bounded gate: A_log stored [max(H, head_dim)] = [16]
    dev = vision_tiny_config("dev").text_config  # softplus gate: [1, 1, H, 1]
    name = "model.layers.0.self_attn.A_log"
    assert accepted_shapes(name, (16,), k3) == ((16,), (1, 1, 4, 1))
    assert accepted_shapes(name, (1, 1, 4, 1), dev) == ((1, 1, 4, 1), (16,))
    assert accepted_shapes("model.layers.0.self_attn.dt_bias", (64,), k3) == ((64,),)
    heads = torch.tensor([0.5, 1.0, 1.5, 2.0])
    padded = torch.cat([heads, torch.full((12,), 9.0)])  # what follows the H values is unused padding
    assert torch.equal(fit_stored(name, padded, (1, 1, 4, 1)), heads.view(1, 1, 4, 1))
    assert torch.equal(fit_stored(name, heads.view(1, 1, 4, 1), (16,)), torch.cat([heads, torch.zeros(12)]))
    assert fit_stored(name, padded, (16,)) is padded
    with pytest.raises(CheckpointError, match=r"shard\.safetensors: tensor 'language_model\.model\.layers\.0\."
                                              r"self_attn\.A_log' has wrong shape \[8\]; config\.json needs \[16\] "
                                              r"\(or, in another checkpoint layout, \[1, 1, 4, 1\]\)"):
        check_stored_shape(name, "language_model." + name, (8,), (16,), k3, "shard.safetensors")
