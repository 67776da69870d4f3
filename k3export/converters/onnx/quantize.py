# Copyright 2026 the k3export authors. Apache-2.0.
"""``export --quantize int8|int4``: the dense projections stored weight-only block-quantized, as ONNX Runtime's
``com.microsoft::MatMulNBits`` reads them (OpenVINO reads the same node, with fp32 inputs).

A projection ``Gemm(x, W, transB=1)`` with W [N, K] (attention, shared experts, dense MLPs, latent MoE
projections, the head; not the router, not the embedding table) becomes ``MatMulNBits(x, B, scales; K, N, bits,
block_size, accuracy_level)`` (`DEFAULT_ACCURACY_LEVEL`): along K every ``block_size`` weights share one fp32
scale and are stored as codes ``q`` with ``W ~ (q - 2**(bits - 1)) * scale`` (no zero-point input: the op's
default, the middle code).

    B       uint8 [N, ceil(K / block_size), block_size * bits / 8]   codes, 4-bit ones two a byte, low nibble first
    scales  float32 [N, ceil(K / block_size)]                         (a K that is not a multiple: zero padding)

The codes follow llama.cpp's Q8_0 and Q4_0 (``ggml-quants.c``), so the two stores compare at the same bits:
int8 ``scale = max|w| / 127``, ``q = round(w / scale)`` in [-127, 127]; int4 ``scale = m / -8`` where m is the
block's weight of largest magnitude (its sign kept), ``q = round(w / scale)`` clipped to [-8, 7]: the largest
weight lands exactly on -8, so all 16 codes are used. Bits per weight: ``bits + 32 / block_size`` (fp32 scales:
9.0 / 5.0 at block 32; llama.cpp's fp16 scales give 8.5 / 4.5).

The weights are quantized as they are streamed into the data shards (`weights.write_weights`), from the checkpoint's
own values, one projection at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from k3export.dtypes import dtype as as_dtype
from k3export.errors import ExportError

from .builder import Quantized, WeightSpec

if TYPE_CHECKING:
    from .builder import GraphBuilder

MS_DOMAIN = "com.microsoft"
QUANTIZE = {"int8": 8, "int4": 4}
DEFAULT_BLOCK_SIZE = 32
#: MatMulNBits' accuracy_level (``export --quantize-activations/--no-quantize-activations``): 4 quantizes each
#: block of activations to int8 before the product, as llama.cpp's Q8_0 / Q4_0 dot products do, and is ONNX
#: Runtime's fast CPU path (bench/quantized.py matmul: int8 4.2x and int4 4.8x faster than at level 0, where int8
#: is 10x slower than the fp32 product); 0 computes with fp32 activations, the stored weights' product to fp32
#: rounding. OpenVINO reads both the same way (fp32 activations).
ACCURACY_LEVELS = (0, 4)
DEFAULT_ACCURACY_LEVEL = 4


def check_quantize(quantize: str | None, block_size: int) -> int | None:
    """The bits of `quantize` (None: not quantized); one line for an unknown name or a block size MatMulNBits
    cannot take (a power of two >= 16)."""
    if quantize is None:
        return None
    if quantize not in QUANTIZE:
        raise ExportError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 or \
            block_size & (block_size - 1):
        raise ExportError(f"--block-size {block_size!r}: MatMulNBits takes a power of two >= 16")
    return QUANTIZE[quantize]


def quantize_blocks(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(B uint8 [N, k_blocks, blob], scales float32 [N, k_blocks]) of the dense weight `w` [N, K] (module
    docstring: llama.cpp's Q8_0 / Q4_0 codes, MatMulNBits' layout)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    kb = -(-k // block_size)
    blocks = np.zeros((n, kb * block_size), np.float32)
    blocks[:, :k] = w
    blocks = blocks.reshape(n, kb, block_size)
    if bits == 8:
        scale = np.abs(blocks).max(-1) / 127.0
        lo, hi = -127, 127
    elif bits == 4:
        at = np.abs(blocks).argmax(-1)
        scale = np.take_along_axis(blocks, at[..., None], -1)[..., 0] / -8.0
        lo, hi = -8, 7
    else:
        raise ExportError(f"{bits}-bit codes: MatMulNBits exports take 8 or 4")
    scale = scale.astype(np.float32)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    codes = (np.clip(np.rint(blocks * inv[..., None]), lo, hi) + (1 << (bits - 1))).astype(np.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(codes), scale


def dequantize_blocks(blocks: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """The float32 [N, k] weight that `quantize_blocks`' codes and scales stand for, as MatMulNBits reads them."""
    codes = np.asarray(blocks, np.uint8)
    if bits == 4:
        codes = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    w = (codes.astype(np.float32) - (1 << (bits - 1))) * np.asarray(scales, np.float32)[..., None]
    return w.reshape(w.shape[0], -1)[:, :k]


def quantized_param_names(config: Any) -> list[str]:
    """The model's parameters an export with ``--quantize`` stores quantized (the parts of every `quantizable`
    projection of its graph), in graph order."""
    from .graph import K3GraphBuilder

    b = K3GraphBuilder(config, "fp32", quantize=True)
    b.build()
    return [p for node in b.nodes if quantizable(b, node) for p in b.weights[node.input[1]].parts]


def fake_quantized(model: Any, bits: int, block_size: int) -> Any:
    """A copy of the `K3ForCausalLM` `model` whose `quantized_param_names` hold what an export quantized at `bits`
    and `block_size` computes with (`quantize_blocks` then `dequantize_blocks`, row by row): the reference that an
    export's elementwise checks compare with."""
    import copy

    import torch

    out = copy.deepcopy(model)
    params = dict(out.named_parameters())
    with torch.no_grad():
        for name in quantized_param_names(out.config):
            p = params[name]
            w = p.detach().float().cpu().numpy().reshape(-1, p.shape[-1])
            deq = dequantize_blocks(*quantize_blocks(w, bits, block_size), bits, w.shape[1])
            p.copy_(torch.from_numpy(deq).reshape(p.shape).to(p.dtype))
    return out


def _float32(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):  # torch, bf16 included
        t = t.detach().to("cpu").float().numpy()
    return np.asarray(t, np.float32)


def dense_weight(spec: WeightSpec, get: Any) -> np.ndarray:
    """The dense float32 [n, k] weight a quantized spec is made of: its source parts (`get(name)` each, a tensor)
    joined along the rows, as the dense spec would have stored them."""
    assert spec.quant is not None
    dense = spec.quant.dense
    parts = [_float32(get(p)) for p in dense.parts]
    for i, (name, a) in enumerate(zip(dense.parts, parts)):
        if tuple(a.shape) != tuple(dense.part_shape(i)):
            raise ExportError(f"tensor {name!r} has shape {tuple(a.shape)}, the config implies "
                              f"{tuple(dense.part_shape(i))}")
    return np.concatenate([a.reshape(-1, dense.shape[1]) for a in parts])


def quantizable(b: GraphBuilder, node: onnx.NodeProto) -> bool:
    """Whether `node` of the builder `b` is a projection `quantize_projections` stores quantized: ``Gemm(x, W,
    transB=1)`` reading a 2-D fp32 weight of its own that is not the router's."""
    if node.op_type != "Gemm" or len(node.input) != 2 or [(a.name, a.i) for a in node.attribute] != [("transB", 1)]:
        return False
    spec = b.weights.get(node.input[1])
    return (spec is not None and len(spec.shape) == 2 and spec.dtype.name == "float32"
            and not any(p.endswith(".gate.weight") for p in spec.parts))


def quantize_projections(b: GraphBuilder, bits: int, block_size: int,
                         accuracy_level: int = DEFAULT_ACCURACY_LEVEL) -> int:
    """Rewrite every `quantizable` projection of the builder `b` (a `builder.GraphBuilder`, after
    `merge_projections`) into ``MatMulNBits`` over two quantized weight specs (``{W}.int{bits}`` and
    ``{W}.int{bits}_scales``, the source parts of W); returns how many."""
    uses: dict[str, int] = {}
    for node in b.nodes:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    count = 0
    nodes: list[onnx.NodeProto] = []
    replaced: dict[str, list[WeightSpec]] = {}
    for node in b.nodes:
        if not quantizable(b, node) or uses[node.input[1]] != 1:
            nodes.append(node)
            continue
        spec = b.weights[node.input[1]]
        n, k = spec.shape
        pair = []
        for role, suffix, dt in (("blocks", "", "uint8"), ("scales", "_scales", "float32")):
            q = Quantized(role, bits, block_size, spec)
            pair.append(WeightSpec(f"{spec.name}.int{bits}{suffix}", q.shape, as_dtype(dt), list(spec.parts),
                                   quant=q))
        replaced[spec.name] = pair
        names = [s.name for s in pair]
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], *names], list(node.output), name=node.name,
                                      domain=MS_DOMAIN, K=k, N=n, bits=bits, block_size=block_size,
                                      accuracy_level=accuracy_level))
        count += 1
    b.nodes = nodes
    # in declaration order, each pair where its dense weight was (the data shards keep the graph's order)
    b.weights = {s.name: s for name, spec in b.weights.items() for s in replaced.get(name, [spec])}
    return count


__all__ = ["ACCURACY_LEVELS", "DEFAULT_ACCURACY_LEVEL", "DEFAULT_BLOCK_SIZE", "MS_DOMAIN", "QUANTIZE", "check_quantize",
           "dense_weight", "dequantize_blocks", "fake_quantized", "quantizable", "quantized_param_names",
           "quantize_blocks", "quantize_projections"]
