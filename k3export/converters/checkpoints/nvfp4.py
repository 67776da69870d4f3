"""NVFP4 routed experts and FP8 block weights as NVIDIA Model-Optimizer writes them (``nvidia/Kimi-K3-NVFP4``).

* NVFP4 expert ``<module>``: ``.weight`` uint8 [out, in/2] (two E2M1 nibbles a byte, element 2j low: the MXFP4
  grid and packing), ``.weight_scale`` float8_e4m3fn [out, in/16] (one scale per 16 elements),
  ``.weight_scale_2`` fp32 scalar (shared by an expert's w1 and w3: they feed one fused GEMM), ``.input_scale``
  fp32 scalar (an activation scale for engines that quantize activations; a weight-only reader checks it and
  leaves it). The weight is ``e2m1 * float(weight_scale) * weight_scale_2``.
* FP8 block weight (``FP8_PB_WO``): ``.weight`` float8_e4m3fn [out, in], ``.weight_scale`` fp32, one per 128x128
  tile ([ceil(out/128), ceil(in/128)]); the weight is ``fp8 * scale`` of its tile.

`cast_mxfp4` is the bit-exact MXFP4 -> NVFP4 cast: with ``scale_2 = 2^(k_max - 8)`` (k_max the largest E8M0
exponent over the tensors sharing ``scale_2``) every block whose exponent k_j has ``k_max - k_j <= 17`` takes the
E4M3 scale ``2^(k_j - (k_max - 8))`` (exact: E4M3 holds 2^-9 .. 2^8) and keeps its nibbles byte for byte; a block
further down takes a scale from its amax (`cast_scales`: E4M3's smallest step, 2^-9) and its values are rounded to
nearest (ties to even) on the E2M1 grid. An MXFP4 block of 32 is two NVFP4 blocks of 16; counts are NVFP4 blocks.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from k3export.errors import CheckpointError
from k3export.info import FP8_TILE

from .mxfp4 import E2M1_VALUES, GROUP_SIZE as MXFP4_GROUP, _quad_table

GROUP_SIZE = 16
#: the E4M3 exponents a power-of-two block scale can take: 2^-9 (the smallest subnormal) .. 2^8 (448 = 1.75 * 2^8)
E4M3_MIN_EXP, E4M3_MAX_EXP = -9, 8
#: k_max - k_j up to which a block casts bit-exactly
CAST_RANGE = E4M3_MAX_EXP - E4M3_MIN_EXP


def _where(where: str) -> str:
    return f" in {where}" if where else ""


def check_nvfp4(name: str, weight: tuple[str, tuple[int, ...]], scale: tuple[str, tuple[int, ...]],
                scale_2: tuple[str, tuple[int, ...]], input_scale: tuple[str, tuple[int, ...]] | None,
                where: str = "") -> tuple[int, int]:
    """Check an NVFP4 weight's tensors (each a (safetensors dtype, shape)) against each other; return the
    dequantised [out, in] shape. `name` is the module's stored name (``....experts.3.w1``)."""
    loc = _where(where)
    dtype, shape = weight
    if dtype != "U8":
        raise CheckpointError(f"tensor {name}.weight{loc}: wrong dtype {dtype}, NVFP4 packs two E2M1 values into U8")
    if len(shape) != 2:
        raise CheckpointError(f"tensor {name}.weight{loc}: wrong shape {list(shape)}, expected 2-D [out, in/2]")
    out_f, in_f = shape[0], 2 * shape[1]
    if in_f % GROUP_SIZE:
        raise CheckpointError(f"tensor {name}.weight{loc}: {in_f} input features are not a multiple of the NVFP4 "
                              f"group size {GROUP_SIZE}")
    if scale[0] != "F8_E4M3":
        raise CheckpointError(f"tensor {name}.weight_scale{loc}: wrong dtype {scale[0]}, NVFP4 block scales are "
                              "F8_E4M3")
    if tuple(scale[1]) != (out_f, in_f // GROUP_SIZE):
        raise CheckpointError(f"tensor {name}.weight_scale{loc}: wrong shape {list(scale[1])} for weight "
                              f"{list(shape)}; expected {[out_f, in_f // GROUP_SIZE]} (one per {GROUP_SIZE})")
    for suffix, part in (("weight_scale_2", scale_2), ("input_scale", input_scale)):
        if part is None:
            continue
        if part[0] != "F32":
            raise CheckpointError(f"tensor {name}.{suffix}{loc}: wrong dtype {part[0]}, expected an F32 scalar")
        if tuple(part[1]) not in ((), (1,)):
            raise CheckpointError(f"tensor {name}.{suffix}{loc}: wrong shape {list(part[1])}, expected a scalar")
    return out_f, in_f


def check_fp8_block(name: str, weight: tuple[str, tuple[int, ...]], scale: tuple[str, tuple[int, ...]],
                    where: str = "") -> tuple[int, int]:
    """Check an FP8 block weight and its per-tile scales; return the [out, in] shape."""
    loc = _where(where)
    if weight[0] != "F8_E4M3":
        raise CheckpointError(f"tensor {name}.weight_scale{loc}: {name}.weight is {weight[0]}; only F8_E4M3 "
                              "weights (FP8_PB_WO) or NVFP4 experts take a weight_scale")
    if len(weight[1]) != 2:
        raise CheckpointError(f"tensor {name}.weight{loc}: wrong shape {list(weight[1])}, expected 2-D")
    out_f, in_f = weight[1]
    want = (-(-out_f // FP8_TILE), -(-in_f // FP8_TILE))
    if scale[0] != "F32":
        raise CheckpointError(f"tensor {name}.weight_scale{loc}: wrong dtype {scale[0]}, FP8 block scales are F32")
    if tuple(scale[1]) != want:
        raise CheckpointError(f"tensor {name}.weight_scale{loc}: wrong shape {list(scale[1])} for weight "
                              f"{[out_f, in_f]}; expected {list(want)} (one per {FP8_TILE}x{FP8_TILE} tile)")
    return out_f, in_f


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> float32 [..., n], the E2M1 values (element 2j from the low nibble)."""
    index = packed.contiguous().view(torch.uint16).reshape(-1).to(torch.int32)
    values = _quad_table().index_select(0, index).view(torch.bfloat16)
    return values.float().reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def decode_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16, name: str = "tensor") -> torch.Tensor:
    """Dequantise NVFP4 to ``dtype`` [out, in]: the E2M1 value times its E4M3 block scale (exact in fp32), times
    ``scale_2`` (one fp32 rounding), then cast."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or scale_2.dtype != torch.float32:
        raise CheckpointError(f"{name}: NVFP4 weight, weight_scale, weight_scale_2 must be uint8, float8_e4m3fn, "
                              f"float32; got {packed.dtype}, {scale.dtype}, {scale_2.dtype}")
    out_f, in_f = check_nvfp4(name, ("U8", tuple(packed.shape)), ("F8_E4M3", tuple(scale.shape)),
                              ("F32", tuple(scale_2.shape)), None)
    values = e2m1_values(packed).reshape(out_f, in_f // GROUP_SIZE, GROUP_SIZE)
    values.mul_(scale.float().unsqueeze(-1))
    values.mul_(scale_2.reshape(()))
    values = values.reshape(out_f, in_f)
    return values if dtype == torch.float32 else values.to(dtype)


def decode_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     name: str = "tensor") -> torch.Tensor:
    """Dequantise an FP8 block weight to ``dtype``: each value times its 128x128 tile's scale (one fp32 rounding)."""
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise CheckpointError(f"{name}: FP8 block weight and weight_scale must be float8_e4m3fn and float32, got "
                              f"{weight.dtype} and {scale.dtype}")
    out_f, in_f = check_fp8_block(name, ("F8_E4M3", tuple(weight.shape)), ("F32", tuple(scale.shape)))
    tiles = scale.repeat_interleave(FP8_TILE, 0)[:out_f].repeat_interleave(FP8_TILE, 1)[:, :in_f]
    value = weight.float() * tiles
    return value if dtype == torch.float32 else value.to(dtype)


def fp8_block_size(in_f: int) -> int:
    """The block of ``DequantizeLinear`` (along the input axis) that carries an FP8 block weight of `in_f` input
    features exactly: the tile, 128, when it divides `in_f`; the whole width below 128; else the largest power of
    two dividing both (each block inside one tile). Every block then divides the width, as OpenVINO requires."""
    if in_f % FP8_TILE == 0:
        return FP8_TILE
    return in_f if in_f < FP8_TILE else math.gcd(FP8_TILE, in_f)


def fp8_row_scales(scale: torch.Tensor, out_f: int, in_f: int) -> torch.Tensor:
    """An FP8 block weight's tile scales [ceil(out/128), ceil(in/128)] as the blocked ``DequantizeLinear``'s scale
    [out, in / `fp8_block_size`]: each row takes its row tile's, each block its column tile's (a copy: exact)."""
    block = fp8_block_size(in_f)
    tile_of_block = torch.arange(in_f // block) * block // FP8_TILE
    rows = scale.float().repeat_interleave(FP8_TILE, 0)[:out_f]
    return rows.index_select(1, tile_of_block).contiguous()


# ---------------------------------------------------------------------- the MXFP4 -> NVFP4 cast
_E2M1_GRID = torch.tensor(E2M1_VALUES[:8])  # the magnitudes, codes 0-7


def _e4m3_pow2(exp: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes of 2^exp for integer exponents in [-9, 8] (subnormal below -6)."""
    exp = exp.to(torch.int32)
    normal = (exp + 7) << 3
    subnormal = torch.ones_like(exp) << (exp + 9).clamp(min=0, max=2)
    return torch.where(exp >= -6, normal, subnormal).to(torch.uint8).view(torch.float8_e4m3fn)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nibble codes of float32 `x` rounded to the nearest E2M1 value (ties to the even code), saturating at 6."""
    mag = x.abs().clamp(max=6.0)
    grid = _E2M1_GRID
    idx = (mag.unsqueeze(-1) > grid).sum(-1).clamp(1, len(grid) - 1)  # grid[idx - 1] < mag <= grid[idx]
    lo, hi = grid[idx - 1], grid[idx]
    up = (mag - lo > hi - mag) | ((mag - lo == hi - mag) & (idx % 2 == 0))
    code = torch.where(up, idx, idx - 1).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def cast_exponent(*scales: torch.Tensor) -> int:
    """k_max - 8: the exponent of ``scale_2`` shared by MXFP4 tensors (their E8M0 scale bytes) cast together."""
    k_max = max(int(s.max()) for s in scales if s.numel()) - 127
    return k_max - E4M3_MAX_EXP


def cast_scales(scale: torch.Tensor, exponent_2: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The NVFP4 block scales (float8_e4m3fn [out, in/16]) of an MXFP4 weight's E8M0 scale bytes [out, in/32]
    under ``scale_2 = 2^exponent_2``, and which blocks cast bit-exactly (bool, same shape).

    An exact block's scale is ``2^(k_j - exponent_2)``. A block below the range takes the scale its amax gives,
    ``amax / 6 / scale_2``; that is below 2^(k_j - exponent_2) <= 2^-10 there, under E4M3's smallest step, so it
    takes that step, 2^-9 (never 0: the block keeps what it can), whatever its values."""
    rel = scale.to(torch.int32).repeat_interleave(MXFP4_GROUP // GROUP_SIZE, dim=1) - 127 - exponent_2
    exact = (rel >= E4M3_MIN_EXP) & (rel <= E4M3_MAX_EXP)
    return _e4m3_pow2(rel.clamp(E4M3_MIN_EXP, E4M3_MAX_EXP)), exact


def cast_mxfp4(packed: torch.Tensor, scale: torch.Tensor, exponent_2: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Cast one MXFP4 weight (uint8 packed [out, in/2], E8M0 scale bytes [out, in/32]) to NVFP4 with
    ``scale_2 = 2^exponent_2`` (`cast_exponent` over the tensors sharing it). Returns (weight uint8 [out, in/2],
    weight_scale float8_e4m3fn [out, in/16], weight_scale_2 float32 [], NVFP4 blocks, lossless blocks): a lossless
    block keeps its nibbles byte for byte; another takes `cast_scales`' scale and its values, exact in float64,
    rounded to the nearest E2M1 value (ties to even) under it."""
    block_scale, exact = cast_scales(scale, exponent_2)
    weight = packed.clone()
    if not bool(exact.all()):
        rows, blocks = (~exact).nonzero(as_tuple=True)
        cols = blocks[:, None] * (GROUP_SIZE // 2) + torch.arange(GROUP_SIZE // 2)
        k = scale.to(torch.int64)[rows, blocks // (MXFP4_GROUP // GROUP_SIZE)] - 127
        values = e2m1_values(packed[rows[:, None], cols]).double() * torch.exp2(k.double())[:, None]  # [n, 16]
        step = block_scale[rows, blocks].double() * 2.0 ** exponent_2
        q = _round_e2m1((values / step[:, None]).float())
        weight[rows[:, None], cols] = q[:, 0::2] | (q[:, 1::2] << 4)
    scale_2 = torch.tensor(2.0 ** exponent_2, dtype=torch.float32)
    return weight, block_scale, scale_2, exact.numel(), int(exact.sum())


# ---------------------------------------------------------------------- Model-Optimizer's description
#: the modules NVIDIA's recipe leaves in bf16 (``exclude_modules``)
MODELOPT_EXCLUDED = ["lm_head", "*.block_sparse_moe.gate", "*shared_experts*", "*routed_expert_*", "*.mlp.*",
                     "vision_tower*", "mm_projector*"]


def modelopt_quantization(expert_banks: list[str], fp8_modules: list[str] = ()) -> dict[str, Any]:
    """``hf_quant_config.json``'s ``quantization`` object: each expert bank (``....block_sparse_moe.experts``)
    NVFP4 group 16, each of `fp8_modules` FP8_PB_WO."""
    layers: dict[str, Any] = {bank: {"quant_algo": "NVFP4", "group_size": GROUP_SIZE} for bank in expert_banks}
    layers.update({m: {"quant_algo": "FP8_PB_WO"} for m in fp8_modules})
    return {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": dict(sorted(
        layers.items())), "exclude_modules": list(MODELOPT_EXCLUDED)}


def modelopt_configs(config_json: dict[str, Any], quantization: dict[str, Any], producer: dict[str, str]
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, hf_quant_config.json) of a checkpoint in Model-Optimizer's format, quantized as `quantization`
    says by `producer` ({"name", "version"}), from its unquantized (or MXFP4) `config_json`: any other
    ``quantization_config`` removed (the text config's too), ModelOpt's at the top level (``quant_method:
    modelopt``, which the engines' loaders key on)."""
    cfg = json.loads(json.dumps(config_json))
    cfg.pop("quantization_config", None)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"].pop("quantization_config", None)
    cfg["quantization_config"] = {"quant_method": "modelopt", "producer": dict(producer), **quantization}
    return cfg, {"producer": dict(producer), "quantization": quantization}


# ---------------------------------------------------------------------- packing (fixtures)
def pack_nvfp4(weight: torch.Tensor, scale_2: float | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise a [out, in] weight to NVFP4 by Model-Optimizer's rule: ``scale_2 = amax / (6 * 448)`` (or as
    given), block scale ``amax_block / 6 / scale_2`` in E4M3, values rounded to nearest E2M1. Returns (weight
    uint8 [out, in/2], weight_scale float8_e4m3fn [out, in/16], weight_scale_2 float32 [])."""
    w = weight.detach().float()
    out_f, in_f = w.shape
    if scale_2 is None:
        scale_2 = max(float(w.abs().max()), 1e-30) / (6.0 * 448.0)
    s2 = torch.tensor(scale_2, dtype=torch.float32)
    blocks = w.reshape(out_f, in_f // GROUP_SIZE, GROUP_SIZE)
    s8 = (blocks.abs().amax(-1) / 6.0 / s2).clamp(max=448.0).to(torch.float8_e4m3fn)
    denom = (s8.float() * s2).unsqueeze(-1)
    q = _round_e2m1(torch.where(denom > 0, blocks / denom, torch.zeros_like(blocks))).reshape(out_f, in_f)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), s8.contiguous(), s2


def pack_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a [out, in] weight to FP8 E4M3 with one fp32 scale per 128x128 tile (amax / 448)."""
    w = weight.detach().float()
    out_f, in_f = w.shape
    to, ti = -(-out_f // FP8_TILE), -(-in_f // FP8_TILE)
    padded = torch.zeros(to * FP8_TILE, ti * FP8_TILE)
    padded[:out_f, :in_f] = w
    amax = padded.reshape(to, FP8_TILE, ti, FP8_TILE).abs().amax(dim=(1, 3))
    scale = (amax / 448.0).clamp(min=1e-12)
    tiles = scale.repeat_interleave(FP8_TILE, 0)[:out_f].repeat_interleave(FP8_TILE, 1)[:, :in_f]
    return (w / tiles).to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


__all__ = ["CAST_RANGE", "GROUP_SIZE", "cast_exponent", "cast_mxfp4", "cast_scales", "check_fp8_block",
           "check_nvfp4", "decode_fp8_block", "decode_nvfp4", "e2m1_values", "fp8_block_size", "fp8_row_scales",
           "modelopt_configs", "modelopt_quantization", "pack_fp8_block", "pack_nvfp4"]
