"""MXFP4 (OCP microscaling FP4) as packed by compressed-tensors' ``mxfp4-pack-quantized`` format.

* ``weight_packed``: uint8 [out, in/2]; byte j of a row holds element 2j in its low nibble and element
  2j+1 in its high nibble. A nibble is E2M1: bit 3 sign, bits 0-2 index into
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
* ``weight_scale``: uint8 [out, in/32], E8M0: the scale of a group of 32 is 2^(byte - 127).

`decode_mxfp4` is a table-driven decoder: one gather over a 65536-entry table that expands two bytes
into their four bfloat16 values, then one multiply by the group scale. Every product of an E2M1 value and a power of two
is exact in bfloat16 (bytes 0..254), so the result is bit-identical to compressed-tensors'
``MXFP4PackedCompressor.decompress`` (the tests prove it for every byte and scale, signed zeros and NaN
patterns included); other dtypes are the bfloat16 result widened. Byte 255 gives
2^128 = inf, as compressed-tensors does; ``--check-finite`` reports it.
"""

from __future__ import annotations

import torch

from k3export.dtypes import E2M1_VALUES
from k3export.errors import CheckpointError

GROUP_SIZE = 32

_QUAD_TABLE: torch.Tensor | None = None


def _quad_table() -> torch.Tensor:
    """int64[65536]: two packed bytes (little-endian uint16) -> their four bfloat16 values' bit patterns."""
    global _QUAD_TABLE
    if _QUAD_TABLE is None:
        nib = torch.tensor(E2M1_VALUES, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)
        nib = nib.to(torch.int64) & 0xFFFF
        w = torch.arange(65536, dtype=torch.int64)
        _QUAD_TABLE = (nib[w & 0xF] | (nib[(w >> 4) & 0xF] << 16) | (nib[(w >> 8) & 0xF] << 32)
                       | (nib[(w >> 12) & 0xF] << 48))
    return _QUAD_TABLE


_E8M0_TABLE = torch.cat([torch.tensor([0x00400000], dtype=torch.int32),  # byte 0: 2^-127, subnormal
                         torch.arange(1, 256, dtype=torch.int32) << 23]).view(torch.float32)  # 255 -> inf


def e8m0_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2^(byte - 127) for uint8 E8M0 bytes, from the float32 bit pattern (exact; 255 -> inf)."""
    table = _E8M0_TABLE if dtype == torch.float32 else _E8M0_TABLE.to(dtype)
    return table.index_select(0, scale.reshape(-1).to(torch.int32)).reshape(scale.shape)


def check_mxfp4_pair(name: str, packed_shape: tuple[int, ...], packed_dtype: str, scale_shape: tuple[int, ...],
                     scale_dtype: str, where: str = "", group_size: int = GROUP_SIZE) -> tuple[int, int]:
    """Check that a packed weight and its scales belong together; return the decoded [out, in] shape."""
    loc = f" in {where}" if where else ""
    if packed_dtype != "U8":
        raise CheckpointError(f"tensor {name}.weight_packed{loc}: wrong dtype {packed_dtype}, MXFP4 packs into U8")
    if scale_dtype != "U8":
        raise CheckpointError(f"tensor {name}.weight_scale{loc}: wrong dtype {scale_dtype}, E8M0 scales are U8")
    if len(packed_shape) != 2:
        raise CheckpointError(f"tensor {name}.weight_packed{loc}: wrong shape {list(packed_shape)}, expected 2-D")
    out_f, half_in = packed_shape
    in_f = 2 * half_in
    if in_f % group_size:
        raise CheckpointError(f"tensor {name}.weight_packed{loc}: {in_f} input features are not a multiple of "
                              f"the MXFP4 group size {group_size}")
    expected = (out_f, in_f // group_size)
    if tuple(scale_shape) != expected:
        raise CheckpointError(f"tensor {name}.weight_scale{loc}: scales {list(scale_shape)} do not match packed "
                              f"weights {list(packed_shape)} (expected {list(expected)} for group size {group_size})")
    return out_f, in_f


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                 group_size: int = GROUP_SIZE, name: str = "tensor") -> torch.Tensor:
    """Dequantise MXFP4 to ``dtype`` ([out, in]); bit-identical to compressed-tensors' decompression."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise CheckpointError(f"{name}: MXFP4 weight_packed and weight_scale must be uint8, got "
                              f"{packed.dtype} and {scale.dtype}")
    out_f, in_f = check_mxfp4_pair(name, tuple(packed.shape), "U8", tuple(scale.shape), "U8", group_size=group_size)
    # Every value is exact in bfloat16, so decode there and widen afterwards (also keeps compressed-tensors'
    # NaN bit pattern for byte 255 times a zero nibble).
    work = torch.bfloat16
    # Gather both nibbles of each byte at once: [out, in/2, 2] -> [out, in].
    # One gather per two bytes (four values) from a 64K-entry table, then one multiply by the group scale.
    index = packed.contiguous().view(torch.uint16).reshape(-1).to(torch.int32)
    values = _quad_table().index_select(0, index).view(work).reshape(out_f, in_f // group_size, group_size)
    del index
    values.mul_(e8m0_to_float(scale, work).unsqueeze(-1))
    values = values.reshape(out_f, in_f)
    return values if values.dtype == dtype else values.to(dtype)


# ---------------------------------------------------------------------- packing (fixtures, via compressed-tensors)
def _mxfp4_scheme():  # noqa: ANN202 - compressed-tensors types are imported lazily
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=GROUP_SIZE, symmetric=True,
                            scale_dtype=torch.uint8)
    return QuantizationScheme(targets=["Linear"], weights=args)


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a [out, in] weight to MXFP4 with compressed-tensors' own scale rule and compressor.

    Returns (weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32]).
    """
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    w = weight.detach().to(torch.bfloat16)
    out_f, in_f = w.shape
    amax = w.float().abs().reshape(out_f, in_f // GROUP_SIZE, GROUP_SIZE).amax(-1)
    amax = amax.clamp_min(2.0 ** -100).to(torch.bfloat16)
    exponent = generate_mx_scales(amax).float()
    scale = torch.pow(2.0, exponent - 127).to(torch.bfloat16)
    packed = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, _mxfp4_scheme())
    return packed["weight_packed"].contiguous(), packed["weight_scale"].contiguous()


def reference_decompress(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own MXFP4 decompression (bfloat16), the reference `decode_mxfp4` must match."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor

    out = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, _mxfp4_scheme())
    return out["weight"]
