"""TensorRT <-> torch glue for the JIT (``@trtp.impl``) debug path and dtype names.

Imported only from inside ``define(trtp, trt)`` of the plugin modules, i.e. after ``import tensorrt``.
"""

from __future__ import annotations

from typing import Any

import tensorrt as trt

from . import rules

_TRT_BY_NAME = {
    "float32": trt.DataType.FLOAT,
    "float16": trt.DataType.HALF,
    "bfloat16": trt.DataType.BF16,
    "int32": trt.DataType.INT32,
    "int64": trt.DataType.INT64,
}
_NAME_BY_TRT = {v: k for k, v in _TRT_BY_NAME.items()}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
_TYPESTR = {"float32": "<f4", "float16": "<f2", "bfloat16": "<i2", "int32": "<i4", "int64": "<i8"}


def name_to_trt(name: str) -> Any:
    return _TRT_BY_NAME[rules.dtype_name(name)]


def trt_to_name(dtype: Any) -> str:
    if dtype in _NAME_BY_TRT:
        return _NAME_BY_TRT[dtype]
    raise rules.PluginInputError(f"k3 plugins do not support TensorRT dtype {dtype}")


class _CudaArray:
    """A __cuda_array_interface__ view of a plugin buffer (bf16 travels as int16 and is re-viewed)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], name: str) -> None:
        item = _ITEMSIZE[name]
        self.__cuda_array_interface__ = {
            "shape": tuple(int(s) for s in shape),
            "typestr": _TYPESTR[name],
            "data": (int(ptr), False),
            "strides": tuple(int(s) * item for s in strides),
            "version": 3,
        }


def as_torch(t: Any):
    """A torch CUDA tensor sharing the memory of a ``tensorrt.plugin.Tensor`` (bf16 included)."""
    import torch

    name = trt_to_name(t.dtype)
    arr = _CudaArray(t.data_ptr, tuple(t.shape), tuple(t.strides), name)
    out = torch.as_tensor(arr, device="cuda")
    return out.view(torch.bfloat16) if name == "bfloat16" else out
