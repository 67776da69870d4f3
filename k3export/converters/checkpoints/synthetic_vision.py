"""Synthetic image + text checkpoints: the tiny K3 with a real (tiny) MoonViT-V2 tower and projector attached.

`write_vision_checkpoint` writes the released ``moonshotai/Kimi-K3`` layout at any size: the text model exactly as
`synthetic.write_checkpoint` writes it (``language_model.*``, MXFP4 routed experts), plus every ``vision_tower.*`` /
``mm_projector.*`` tensor `K3ForConditionalGeneration` has, a ``config.json`` with ``text_config``,
``vision_config`` and ``media_placeholder_token_id``, and a ``preprocessor_config.json`` for the tower.

``style="dev"`` writes the config the way the public development checkpoint
(``inference-optimization/Kimi-K3-0.40B-MXFP4``) does: a ``kimi_linear`` text_config without ``gate_lower_bound``,
one shared expert, a legacy ``head_dim`` beside the MLA head dims, transformers' bookkeeping keys in both sub-configs
and remote-code ``auto_map`` entries. ``a_log`` chooses how the KDA ``A_log`` tensors are stored: ``"config"`` (the
shape the config implies), ``"padded"`` (K3's [max(H, head_dim)]) or ``"heads"`` (Kimi-Linear's [1, 1, H, 1]).

The folder is written under a temporary name and renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .safetensors_io import INDEX_NAME, write_safetensors
from .synthetic import _generator, released_tiny_config, text_config_dict, write_checkpoint

STYLES = ("released", "dev")
A_LOG_FORMS = ("config", "padded", "heads")


def vision_tiny_config(style: str = "released", **text_overrides: Any) -> Any:
    """`K3VLConfig.tiny` on the released-layout text fixture (MXFP4-packable widths); ``style="dev"``: the
    development checkpoint's text choices (softplus KDA gate, one shared expert)."""
    from k3export.modeling.configuration_k3 import K3VLConfig, K3VisionConfig

    if style == "dev":
        text_overrides = {"num_shared_experts": 1, **text_overrides}
        text = released_tiny_config(**text_overrides)
        lac = dict(text.linear_attn_config, gate_lower_bound=None)
        text = released_tiny_config(**{**text_overrides, "linear_attn_config": lac})
    else:
        text = released_tiny_config(**text_overrides)
    return K3VLConfig.tiny(text_config=text, vision_config=K3VisionConfig.tiny(text_hidden_size=text.hidden_size))


def vision_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """`k3export.modeling.vision_weight` drawn from a generator keyed by (seed, name), as `synthetic_weight` is."""
    from k3export.modeling import vision_weight as draw

    return draw(name, shape, _generator(seed, name))


def _dev_text_config(config: Any) -> dict[str, Any]:
    d = text_config_dict(config)
    lac = dict(d["linear_attn_config"])
    if lac.get("gate_lower_bound") is None:
        lac.pop("gate_lower_bound", None)
    d["linear_attn_config"] = lac
    # what transformers and the remote code write beside our fields
    d.update(head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim + 50, rope_theta=10000.0,
             rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
             num_key_value_heads=config.num_attention_heads,
             moe_layer_freq=1, num_nextn_predict_layers=0, use_grouped_topk=True, topk_method="noaux_tc",
             num_expert_group=1, topk_group=1, max_position_embeddings=4096, dtype=None, architectures=None,
             _name_or_path="", chunk_size_feed_forward=0, is_encoder_decoder=False, return_dict=True,
             id2label={"0": "LABEL_0", "1": "LABEL_1"}, label2id={"LABEL_0": 0, "LABEL_1": 1},
             auto_map={"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                       "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                       "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"})
    return d


def _vision_config_dict(config: Any, style: str) -> dict[str, Any]:
    v = config.vision_config
    keys = ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time", "pos_emb_type",
            "pos_emb_interpolation_mode", "vt_hidden_size", "vt_intermediate_size", "vt_num_attention_heads",
            "vt_num_hidden_layers", "qkv_hidden_size", "activation_func", "norm_type", "mlp_type", "attn_bias",
            "linear_bias", "patch_embed_proj_bias", "merge_kernel_size", "merge_type", "mm_projector_type",
            "mm_hidden_size", "projector_hidden_act", "projector_ln_eps", "text_hidden_size")
    d = {k: getattr(v, k) for k in keys}
    d["merge_kernel_size"] = list(d["merge_kernel_size"])
    if style == "dev":
        d.update(model_type="", _name_or_path="", architectures=None, dtype=None, chunk_size_feed_forward=0,
                 is_encoder_decoder=False, return_dict=True, output_attentions=False, output_hidden_states=False,
                 problem_type=None, id2label={"0": "LABEL_0", "1": "LABEL_1"}, label2id={"LABEL_0": 0, "LABEL_1": 1})
    else:
        d["model_type"] = v.model_type
    return d


def _store_a_log(name: str, value: torch.Tensor, form: str, config: Any) -> torch.Tensor:
    heads, head_dim = config.kda_num_heads, config.kda_head_dim
    if form == "config":
        return value
    per_head = value.reshape(-1)[:heads]
    if form == "heads":
        return per_head.reshape(1, 1, heads, 1).contiguous()
    out = torch.zeros(max(heads, head_dim), dtype=value.dtype)
    out[:heads] = per_head
    return out


def write_vision_checkpoint(out_dir: str | Path, config: Any = None, style: str = "released", num_shards: int = 3,
                            seed: int = 0, expert_mode: str = "compressor", dtype: torch.dtype = torch.bfloat16,
                            a_log: str = "config", processor: dict[str, Any] | None = None) -> Path:
    """Write a synthetic image + text checkpoint (see the module docstring) to `out_dir` (which must not exist or
    be empty); return its path. ``processor``: `K3ImageProcessor` arguments (default: the tower's patch and merge
    sizes, a 256-patch budget)."""
    from k3export.modeling.image_processing_k3 import K3ImageProcessor, K3Processor
    from k3export.modeling.modeling_k3_vision import expected_vision_tensors

    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if a_log not in A_LOG_FORMS:
        raise ValueError(f"a_log must be one of {A_LOG_FORMS}, got {a_log!r}")
    if config is None:
        config = vision_tiny_config(style)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    text = config.text_config
    write_checkpoint(tmp, text, layout="kimi_k3", num_shards=num_shards, seed=seed, expert_mode=expert_mode,
                     dtype=dtype, vision=False)

    # the vision shard first, then the text shards renumbered after it
    index = json.loads((tmp / INDEX_NAME).read_text())
    old = sorted(set(index["weight_map"].values()))
    total = len(old) + 1
    names = [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
    weight_map: dict[str, str] = {}
    for src, dst in zip(old, names[1:]):  # "-of-{total}" never names an old shard
        os.replace(tmp / src, tmp / dst)
    for tensor, src in index["weight_map"].items():
        weight_map[tensor] = names[1 + old.index(src)]
    vision = [(n, vision_weight(n, s, seed).to(dtype)) for n, s in expected_vision_tensors(config).items()]
    write_safetensors(tmp / names[0], vision, {"format": "pt"})
    weight_map.update({n: names[0] for n, _ in vision})
    size = index["metadata"]["total_size"] + sum(t.numel() * t.element_size() for _, t in vision)

    if a_log != "config":  # rewrite the A_log tensors in the form asked for, in their shards
        _restore_a_log(tmp, weight_map, a_log, text)

    (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": size},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["text_config"] = _dev_text_config(text) if style == "dev" else text_config_dict(text)
    cfg["vision_config"] = _vision_config_dict(config, style)
    cfg["media_placeholder_token_id"] = config.media_placeholder_token_id
    if style == "dev":
        cfg.update(dtype="bfloat16", ignore_index=-100, use_cache=False, transformers_version="5.15.0.dev0",
                   auto_map={"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                             "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                             "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"})
        cfg.pop("torch_dtype", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    v = config.vision_config
    image_processor = K3ImageProcessor(**{
        "patch_size": v.patch_size, "merge_kernel_size": list(v.merge_kernel_size), "in_patch_limit": 256,
        "patch_limit_on_one_side": 32, "max_frames_per_chunk": v.init_pos_emb_time, **(processor or {})})
    K3Processor(image_processor, media_placeholder_token_id=config.media_placeholder_token_id).save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out


def _restore_a_log(folder: Path, weight_map: dict[str, str], form: str, config: Any) -> None:
    from safetensors import safe_open

    shards = sorted({f for n, f in weight_map.items() if n.endswith("A_log")})
    for fname in shards:
        with safe_open(str(folder / fname), framework="pt") as f:
            tensors = [(n, f.get_tensor(n)) for n in f.keys()]
        tensors = [(n, _store_a_log(n, t, form, config) if n.endswith("A_log") else t) for n, t in tensors]
        write_safetensors(folder / fname, tensors, {"format": "pt"})


__all__ = ["A_LOG_FORMS", "STYLES", "vision_tiny_config", "vision_weight", "write_vision_checkpoint"]
