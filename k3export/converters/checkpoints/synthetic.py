"""Synthetic checkpoints in the released K3 layout and in the Kimi-Linear layout, of any size.

The released-layout writer reproduces ``moonshotai/Kimi-K3`` at any scale: tensor names exactly as
released (``language_model.`` prefix), routed experts packed by compressed-tensors' own MXFP4 compressor
(``weight_packed`` + ``weight_scale``), ``vision_tower.*`` / ``mm_projector.*`` tensors, several shards with
an index, and a ``config.json`` with ``text_config``, ``vision_config`` and a compressed-tensors
``quantization_config``. ``expert_mode="random"`` fills the experts with random (valid) MXFP4 bytes instead
of quantizing random weights, which is what a multi-GB benchmark checkpoint needs.

The NVFP4 writer (``layout="kimi_k3_nvfp4"``) reproduces ``nvidia/Kimi-K3-NVFP4`` (Model-Optimizer's
``nvfp4_experts-fp8_pb_attention`` recipe): the released names and config, routed experts in NVFP4 (``weight``,
``weight_scale`` E4M3 per 16, ``weight_scale_2`` shared by an expert's w1 and w3, ``input_scale`` 1.0), attention
projections in FP8 with one fp32 scale per 128x128 tile, everything else bf16; ModelOpt's ``quantization_config``
at the top of config.json (none in the text config) and ``hf_quant_config.json`` beside it.

The Kimi-Linear writer produces the original Kimi-Linear layout (flat config, ``model.*`` names, dense
bf16 experts) that transformers' ``KimiLinearForCausalLM`` loads.
"""

from __future__ import annotations

import base64

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from k3export.info import FP8_PB_PROJECTIONS as _FP8_ATTENTION, FP8_TILE
from k3export.modeling.contract import keeps_fp32

from .layouts import HF_QUANT_CONFIG, expected_tensors, is_expert
from .mxfp4 import GROUP_SIZE, pack_mxfp4
from .nvfp4 import GROUP_SIZE as NVFP4_GROUP, modelopt_configs, pack_fp8_block, pack_nvfp4
from .nvfp4 import modelopt_quantization as nvfp4_quantization
from .safetensors_io import INDEX_NAME, write_safetensors

# text_config fields of the released config.json, in that file's spelling
_TEXT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
    "activation_situ_beta", "activation_situ_linear_beta", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate", "num_experts", "num_experts_per_token",
    "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size", "latent_moe_use_norm",
    "moe_renormalize", "moe_router_activation_func", "routed_scaling_factor", "first_k_dense_replace",
    "attn_res_block_size", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    "linear_attn_config",
)

QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": GROUP_SIZE,
                        "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*\\.mlp\\..*", "re:.*gate$",
               "re:.*routed_expert_(down|up)_proj$", "re:vision_tower.*", "re:mm_projector.*"],
}


def modelopt_quantization(config: Any, prefix: str = "language_model.") -> dict[str, Any]:
    """The ``quantization`` object of a K3 quantized by NVIDIA's recipe: every MoE layer's expert bank NVFP4, every
    `FP8_PB_PROJECTIONS` weight FP8_PB_WO (`nvfp4.modelopt_quantization`)."""
    names = list(expected_tensors(config))
    banks = sorted({prefix + n.split(".experts.", 1)[0] + ".experts" for n in names if is_expert(n)})
    fp8 = [prefix + n.removesuffix(".weight") for n in names if _FP8_ATTENTION.fullmatch(n)]
    return nvfp4_quantization(banks, fp8)


def text_config_dict(config: Any, model_type: str = "kimi_linear") -> dict[str, Any]:
    d = {"model_type": model_type}
    for name in _TEXT_FIELDS:
        value = getattr(config, name)
        d[name] = dict(value) if isinstance(value, dict) else value
    if not config.use_latent_moe:
        for name in ("routed_expert_hidden_size", "latent_moe_use_norm"):
            d.pop(name)
    if not config.use_attn_res:
        d.pop("attn_res_block_size")
    return d


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def synthetic_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A float32 tensor with the statistics of a trained one (activations stay O(1) in a tiny model)."""
    g = _generator(seed, name)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
        return dt + torch.log(-torch.expm1(-dt))
    randn = torch.randn(shape, generator=g)
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if name.endswith("e_score_correction_bias"):
        return randn * 0.1
    if name.endswith("_res_proj.weight"):
        return randn * (4.0 / math.sqrt(shape[-1]))
    if "norm" in leaf:
        return 1.0 + 0.1 * randn
    if name.endswith("conv1d.weight"):
        return randn * 0.5
    if name.endswith("embed_tokens.weight"):
        return randn
    if len(shape) == 2:
        return randn / math.sqrt(shape[1])
    return randn * 0.02


def _random_mxfp4(name: str, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _generator(seed, name)
    out_f, in_f = shape
    packed = torch.randint(0, 256, (out_f, in_f // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    # scales near 2^-5..2^-3: values of the size a fan-in-scaled weight has
    scale = torch.randint(122, 125, (out_f, in_f // GROUP_SIZE), generator=g, dtype=torch.int32).to(torch.uint8)
    return packed, scale


def _vision_tensors(config: Any) -> dict[str, tuple[int, ...]]:
    d, v = config.hidden_size, 32
    return {
        "vision_tower.patch_embed.proj.weight": (v, 3, 2, 2),
        "vision_tower.encoder.blocks.0.attn.qkv.weight": (3 * v, v),
        "vision_tower.encoder.blocks.0.attn.proj.weight": (v, v),
        "vision_tower.encoder.blocks.0.norm0.weight": (v,),
        "vision_tower.encoder.final_layernorm.weight": (v,),
        "mm_projector.pre_norm.weight": (v,),
        "mm_projector.proj.0.weight": (d, v * 4),
        "mm_projector.proj.2.weight": (d, d),
    }


def _nvfp4_expert(name: str, shape: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """An expert weight in NVFP4 by Model-Optimizer's rule, w1 and w3 with one ``weight_scale_2`` (from both)."""
    weight = synthetic_weight(name, shape, seed)
    amax = float(weight.abs().max())
    for a, b in ((".w1.", ".w3."), (".w3.", ".w1.")):
        if a in name:
            amax = max(amax, float(synthetic_weight(name.replace(a, b), shape, seed).abs().max()))
    packed, scale, scale_2 = pack_nvfp4(weight, amax / (6.0 * 448.0))
    return {".weight": packed, ".weight_scale": scale, ".weight_scale_2": scale_2,
            ".input_scale": torch.tensor(1.0, dtype=torch.float32)}


def _stored_tensors(config: Any, layout: str, seed: int, expert_mode: str, dtype: torch.dtype,
                    vision: bool) -> Iterator[tuple[str, Any]]:
    """(stored name, tensor or lazy maker) in checkpoint order; an MXFP4 expert expands to its packed pair, an
    NVFP4 expert or FP8 weight to {suffix: tensor}."""
    prefix = "language_model." if layout.startswith("kimi_k3") else ""
    quantized = layout == "kimi_k3"
    nvfp4 = layout == "kimi_k3_nvfp4"
    if vision:
        for name, shape in _vision_tensors(config).items():
            yield name, (lambda n=name, s=shape: synthetic_weight(n, s, seed).to(torch.bfloat16))
    for name, shape in expected_tensors(config).items():
        if nvfp4 and is_expert(name):
            yield prefix + name.removesuffix(".weight"), (lambda n=name, s=shape: _nvfp4_expert(n, s, seed))
            continue
        if nvfp4 and _FP8_ATTENTION.fullmatch(name):
            yield prefix + name, (lambda n=name, s=shape: dict(zip(("", "_scale"),
                                                                 pack_fp8_block(synthetic_weight(n, s, seed)))))
            continue
        if quantized and is_expert(name):
            base = prefix + name.removesuffix(".weight")

            def make(n: str = name, s: tuple[int, ...] = shape) -> tuple[torch.Tensor, torch.Tensor]:
                if expert_mode == "random":
                    return _random_mxfp4(n, s, seed)
                return pack_mxfp4(synthetic_weight(n, s, seed))

            yield base, make
            continue
        out_dtype = torch.float32 if keeps_fp32(name) else dtype

        def make_dense(n: str = name, s: tuple[int, ...] = shape, dt: torch.dtype = out_dtype) -> torch.Tensor:
            return synthetic_weight(n, s, seed).to(dt)

        yield prefix + name, make_dense


def _nbytes_estimate(config: Any, layout: str, vision: bool) -> list[tuple[str, int]]:
    out = []
    prefix = "language_model." if layout.startswith("kimi_k3") else ""
    if vision:
        out += [(n, 2 * math.prod(s)) for n, s in _vision_tensors(config).items()]
    for name, shape in expected_tensors(config).items():
        n = math.prod(shape)
        if layout == "kimi_k3_nvfp4" and is_expert(name):
            out.append((prefix + name.removesuffix(".weight"), n // 2 + n // NVFP4_GROUP + 8))
        elif layout == "kimi_k3_nvfp4" and _FP8_ATTENTION.fullmatch(name):
            out.append((prefix + name, n + 4 * math.prod(-(-d // FP8_TILE) for d in shape)))
        elif layout == "kimi_k3" and is_expert(name):
            out.append((prefix + name.removesuffix(".weight"), n // 2 + n // GROUP_SIZE))
        else:
            out.append((prefix + name, n * (4 if keeps_fp32(name) else 2)))
    return out


def write_checkpoint(out_dir: str | Path, config: Any = None, layout: str = "kimi_k3", num_shards: int = 3,
                     seed: int = 0, expert_mode: str = "compressor", dtype: torch.dtype = torch.bfloat16,
                     vision: bool | None = None, tokenizer: bool = True) -> Path:
    """Write a synthetic checkpoint (see the module docstring); return its folder.

    ``layout``: ``"kimi_k3"`` (released K3: prefix, MXFP4 experts, vision tensors, nested config),
    ``"kimi_k3_nvfp4"`` (NVIDIA's NVFP4 release: NVFP4 experts, FP8 attention, ModelOpt's quantization config;
    `expert_mode` does not apply) or ``"kimi_linear"`` (flat config, dense experts). Shards are cut by bytes so
    each holds about the same.
    """
    from k3export.modeling.configuration_k3 import K3Config

    if layout not in ("kimi_k3", "kimi_k3_nvfp4", "kimi_linear"):
        raise ValueError(f"layout must be 'kimi_k3', 'kimi_k3_nvfp4' or 'kimi_linear', got {layout!r}")
    released = layout.startswith("kimi_k3")
    if config is None:
        config = released_tiny_config() if released else K3Config.tiny_kimi_linear()
    if released and (config.expert_input_size % GROUP_SIZE or config.moe_intermediate_size % GROUP_SIZE):
        raise ValueError(f"MXFP4 experts need expert widths that are multiples of {GROUP_SIZE}; got "
                         f"{config.expert_input_size} and {config.moe_intermediate_size}")
    if vision is None:
        vision = released
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    sizes = _nbytes_estimate(config, layout, vision)
    total = sum(s for _, s in sizes)
    per_shard = total / max(1, num_shards)
    shard_of: dict[str, int] = {}
    acc = 0
    for name, size in sizes:  # keyed like `_stored_tensors` yields them (experts without ".weight")
        shard_of[name] = min(num_shards - 1, int(acc // per_shard)) if per_shard else 0
        acc += size

    shard_names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map: dict[str, str] = {}
    current: list[tuple[str, torch.Tensor]] = []
    current_idx = 0
    total_size = 0

    def flush() -> None:
        nonlocal current, total_size
        write_safetensors(out / shard_names[current_idx], current, {"format": "pt"})
        for n, t in current:
            weight_map[n] = shard_names[current_idx]
            total_size += t.numel() * t.element_size()
        current = []

    for stored, make in _stored_tensors(config, layout, seed, expert_mode, dtype, vision):
        idx = shard_of[stored]
        while idx > current_idx:
            flush()
            current_idx += 1
        value = make()
        if isinstance(value, tuple):
            current.append((stored + ".weight_packed", value[0]))
            current.append((stored + ".weight_scale", value[1]))
        elif isinstance(value, dict):
            current.extend((stored + suffix, t) for suffix, t in value.items())
        else:
            current.append((stored, value))
    flush()
    while current_idx < num_shards - 1:  # shards that got nothing (more shards than tensors)
        current_idx += 1
        flush()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    text = text_config_dict(config)
    if released:
        cfg: dict[str, Any] = {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text,
            "vision_config": {"model_type": "moonvit", "hidden_size": 32, "num_hidden_layers": 1, "patch_size": 2},
            "quantization_config": json.loads(json.dumps(QUANTIZATION_CONFIG)),
            "torch_dtype": "bfloat16",
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
        }
        if layout == "kimi_k3_nvfp4":
            cfg, hf_quant = modelopt_configs(cfg, modelopt_quantization(config), {"name": "modelopt",
                                                                                  "version": "0.39.0"})
            (out / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2) + "\n")
    else:
        cfg = dict(text, architectures=["KimiLinearForCausalLM"], torch_dtype="bfloat16", num_expert_group=1,
                   topk_group=1, model_max_length=1048576, use_cache=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer:
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
             "pad_token_id": config.pad_token_id, "max_new_tokens": 32}, indent=2) + "\n")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576,
             "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}, indent=2) + "\n")
        # a real (tiny) tiktoken BPE: the 256 bytes, then 26 merges "aa".."zz"; lines are "base64(token) rank"
        tokens = [bytes([b]) for b in range(256)] + [bytes([c, c]) for c in range(97, 123)]
        (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
        (out / "tokenization_kimi.py").write_text('"""Placeholder tokenizer module of a synthetic checkpoint."""\n')
    return out


def released_tiny_config(**overrides: Any) -> Any:
    """`K3Config.tiny()` with expert widths MXFP4 can pack (multiples of 32): the released-layout fixture."""
    from k3export.modeling.configuration_k3 import K3Config

    return K3Config.tiny(**{"routed_expert_hidden_size": 64, "moe_intermediate_size": 32, **overrides})


def bench_config(target_bytes: int, layers: int = 4) -> Any:
    """A K3-structured config whose released-layout checkpoint is about `target_bytes` (experts dominate)."""
    from k3export.modeling.configuration_k3 import K3Config

    d, mid, latent = 1024, 1024, 512
    per_expert = 3 * (mid * latent // 2 + mid * latent // GROUP_SIZE)
    moe_layers = layers - 1
    other = 40 * 2**20  # embeddings, attention, shared experts... (rough)
    experts = max(8, int((target_bytes - other) / (per_expert * moe_layers)))
    full = [layers]
    return K3Config.tiny(
        vocab_size=8192, hidden_size=d, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=8,
        q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        num_experts=experts, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=mid,
        routed_expert_hidden_size=latent, attn_res_block_size=2,
        linear_attn_config=dict(head_dim=64, num_heads=8, short_conv_kernel_size=4, use_full_rank_gate=True,
                                gate_lower_bound=-5.0, full_attn_layers=full,
                                kda_layers=[i for i in range(1, layers + 1) if i not in full]),
    )


__all__ = ["QUANTIZATION_CONFIG", "bench_config", "modelopt_quantization", "released_tiny_config", "synthetic_weight", "text_config_dict", "write_checkpoint"]
