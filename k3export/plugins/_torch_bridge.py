"""The JIT (``@trtp.impl``) debug path: run ``torch.ops.k3.<op>`` on TensorRT's buffers.

Used only from inside ``define(trtp, trt)`` of the plugin modules, i.e. after ``import tensorrt``.
"""

from __future__ import annotations

from typing import Any

from k3export.dtypes import dtype


class _CudaArray:
    """A __cuda_array_interface__ view of a plugin buffer (bf16 travels as int16 and is re-viewed)."""

    def __init__(self, t: Any) -> None:
        d = dtype(t.dtype)
        self.__cuda_array_interface__ = {
            "shape": tuple(int(s) for s in t.shape),
            "typestr": "<i2" if d.name == "bfloat16" else d.numpy.str,
            "data": (int(t.data_ptr), False),
            "strides": tuple(int(s) * d.bits // 8 for s in t.strides),
            "version": 3,
        }
        self.bf16 = d.name == "bfloat16"


def as_torch(t: Any):
    """A torch CUDA tensor sharing the memory of a ``tensorrt.plugin.Tensor`` (bf16 included)."""
    import torch

    arr = _CudaArray(t)
    out = torch.as_tensor(arr, device="cuda")
    return out.view(torch.bfloat16) if arr.bf16 else out


def run_op(name: str, inputs: tuple, attrs: tuple, outputs: tuple, stream: int) -> None:
    """``torch.ops.k3.<name>(*inputs, *attrs)`` on `stream`, results copied into the plugin's `outputs`."""
    import torch

    import k3export.ops.registry  # noqa: F401  registers torch.ops.k3.*

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        results = getattr(torch.ops.k3, name)(*map(as_torch, inputs), *attrs)
        for out, r in zip(outputs, results if isinstance(results, tuple) else (results,)):
            as_torch(out).copy_(r)
