"""MXFP4 (OCP microscaling FP4) as packed by compressed-tensors' ``mxfp4-pack-quantized`` format.

* ``weight_packed``: uint8 [out, in/2]; byte j of a row holds element 2j in its low nibble and element
  2j+1 in its high nibble. A nibble is E2M1: bit 3 sign, bits 0-2 index into
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
* ``weight_scale``: uint8 [out, in/32], E8M0: the scale of a group of 32 is 2^(byte - 127).

`decode_mxfp4` is a table-driven decoder: one gather over a 256-entry table that expands a byte into
its two values, then one multiply by the group scale. Every product of an E2M1 value and a power of two
is exact in bfloat16 and float32 (bytes 0..254), so the result is bit-identical to compressed-tensors'
``MXFP4PackedCompressor.decompress`` (the tests prove it, signed zeros included). Byte 255 gives
2^128 = inf, as compressed-tensors does; ``--check-finite`` reports it.
"""

from __future__ import annotations

import torch

from k3export.errors import CheckpointError

GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_PAIR_TABLES: dict[torch.dtype, torch.Tensor] = {}


def _pair_table(dtype: torch.dtype) -> torch.Tensor:
    """[256, 2] table: byte -> (low-nibble value, high-nibble value)."""
    table = _PAIR_TABLES.get(dtype)
    if table is None:
        nib = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        byte = torch.arange(256)
        table = torch.stack((nib[byte & 0xF], nib[byte >> 4]), dim=1).to(dtype).contiguous()
        _PAIR_TABLES[dtype] = table
    return table


def e8m0_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2^(byte - 127) for uint8 E8M0 bytes, built from the float32 bit pattern (exact; 255 -> inf)."""
    bits = scale.to(torch.int32) << 23
    bits = torch.where(scale == 0, torch.tensor(0x00400000, dtype=torch.int32), bits)  # 2^-127, subnormal
    return bits.view(torch.float32).to(dtype)


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
    work = torch.bfloat16 if dtype in (torch.bfloat16, torch.float16) else torch.float32
    # Gather both nibbles of each byte at once: [out, in/2, 2] -> [out, in].
    values = _pair_table(work)[packed.to(torch.int32)].reshape(out_f, in_f // group_size, group_size)
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
