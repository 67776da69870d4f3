# Copyright 2026 the k3export authors. Apache-2.0.
"""The opsets, IR version and activation dtypes every graph of an export is written at (the decoder, `export`, and
the image graphs, `vision`), and their checks."""

from __future__ import annotations

from typing import Any

from k3export.dtypes import DTypeError, export_dtype as _export_dtype
from k3export.errors import ExportError

SUPPORTED_OPSETS = (27, 28)
DEFAULT_OPSET = 27
IR_VERSION = 11


def export_dtype(dtype: Any):
    """The activation `DType` of an export (fp32, bf16, fp16 in any spelling), else `ExportError`."""
    try:
        return _export_dtype(dtype)
    except DTypeError as exc:
        raise ExportError(str(exc)) from None


def check_opset(opset: int) -> int:
    if not isinstance(opset, int) or opset not in SUPPORTED_OPSETS:
        raise ExportError(
            f"unsupported opset {opset!r}: the K3 graph is built and tested at opsets "
            f"{', '.join(map(str, SUPPORTED_OPSETS))} (up to the newest this onnx/onnxruntime pair supports); "
            "choose one of them")
    return opset


__all__ = ["DEFAULT_OPSET", "IR_VERSION", "SUPPORTED_OPSETS", "check_opset", "export_dtype"]
