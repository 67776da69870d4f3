# Copyright 2026 the k3export authors. Apache-2.0.
"""Block-FP8 weights (NVIDIA's ``FP8_PB_WO`` attention projections) kept FP8 in the export: ``--projections fp8``.

A weight W [out, in] stored as float8_e4m3fn values with one fp32 scale per 128x128 tile becomes two initializers
and one standard node in front of everything that read W:

    W.fp8         FLOAT8E4M3FN [out, in]          the checkpoint's bytes, 1 byte a weight
    W.fp8_scale   FLOAT [out, in / B]             each row's copy of its row tile's scales (`nvfp4.fp8_row_scales`)
    W = DequantizeLinear(W.fp8, W.fp8_scale, axis=1, block_size=B)     (then Cast to a bf16 / fp16 export's dtype)

The standard's blocked ``DequantizeLinear`` takes blocks along one axis, so the tile's scale is repeated down its
128 rows (exact; 32 / B bits a weight more: 0.25 at B = 128). B is `nvfp4.fp8_block_size` (128 where it divides
``in``). The value is ``e4m3 x scale`` rounded once to fp32, as the dense export's `nvfp4.decode_fp8_block`, so a
dense export of the same source computes the same products. Projections of one input that all keep FP8 are joined
as dense ones are (`builder.GraphBuilder.merge_projections`): their rows one after the other, with their scale rows.

Who reads it is `forms.FP8_READERS`; ``--projections dense`` (or ``--quantize``) decodes the weights instead.
"""

from __future__ import annotations

from typing import Any

from onnx import helper

from k3export.dtypes import dtype as as_dtype
from k3export.errors import ExportError

from .builder import WeightSpec

#: ``export --projections``: keep block-FP8 weights FP8 (the default for a source that stores them) or decode them
PROJECTION_FORMATS = ("fp8", "dense")
#: blocked ``DequantizeLinear`` (``block_size``) is in the standard from opset 21
MIN_OPSET = 21


def choose_projections(requested: str | None, stored: frozenset[str], quantize: str | None, opset: int) -> str:
    """The projections' format of an export whose source stores the weights `stored` in block FP8: `requested`, or
    by default ``fp8`` when there are any (and no ``--quantize``, which starts from the decoded weights)."""
    if requested is None:
        return "fp8" if stored and quantize is None else "dense"
    if requested not in PROJECTION_FORMATS:
        raise ExportError(f"unknown projection format {requested!r}; choose one of {', '.join(PROJECTION_FORMATS)}")
    if requested == "fp8" and not stored:
        raise ExportError("--projections fp8 keeps the weights a checkpoint stores in block FP8 (NVIDIA's "
                          "Kimi-K3-NVFP4 attention); this source stores none: use --projections dense")
    if requested == "fp8" and quantize is not None:
        raise ExportError(f"--quantize {quantize} quantizes the decoded projections: export with --projections dense "
                          "(or without --quantize to keep them FP8)")
    if requested == "fp8" and opset < MIN_OPSET:
        raise ExportError(f"--projections fp8 needs blocked DequantizeLinear (opset >= {MIN_OPSET}), not opset {opset}")
    return requested


def keep_fp8(b: Any) -> int:
    """Rewrite each weight of the graph builder `b` (a `graph.K3GraphBuilder`, after `merge_projections`) whose
    parts are all in ``b.fp8`` into its FP8 values and row scales, dequantised by a node in front of the graph under
    its old name (module docstring); returns how many."""
    from k3export.converters.checkpoints.nvfp4 import fp8_block_size

    e4m3, f32 = as_dtype("float8e4m3fn"), as_dtype("float32")
    front: list[Any] = []
    weights: dict[str, WeightSpec] = {}
    for name, spec in b.weights.items():
        if not b.fp8 or not all(p in b.fp8 for p in spec.parts):
            weights[name] = spec
            continue
        if len(spec.shape) != 2:
            raise ExportError(f"weight {name!r} {spec.shape}: block FP8 weights are 2-D [out, in]")
        out_f, in_f = spec.shape
        block = fp8_block_size(in_f)
        values = WeightSpec(f"{name}.fp8", (out_f, in_f), e4m3, [f"{p}.fp8" for p in spec.parts], spec.part_rows)
        scales = WeightSpec(f"{name}.fp8_scale", (out_f, in_f // block), f32, [f"{p}.fp8_scale" for p in spec.parts],
                            spec.part_rows)
        weights[values.name], weights[scales.name] = values, scales
        dense = name if spec.dtype.name == "float32" else b.fresh("fp8_dequantized")
        front.append(helper.make_node("DequantizeLinear", [values.name, scales.name], [dense], axis=1,
                                      block_size=block, name=b.fresh("n_fp8")))
        if dense != name:
            front.append(helper.make_node("Cast", [dense], [name], to=spec.dtype.onnx, name=b.fresh("n_fp8_cast")))
    b.weights = weights
    b.nodes[:0] = front
    return sum(n.op_type == "DequantizeLinear" for n in front)


__all__ = ["MIN_OPSET", "PROJECTION_FORMATS", "choose_projections", "keep_fp8"]
