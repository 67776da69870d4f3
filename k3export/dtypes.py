"""One dtype vocabulary for every boundary: canonical name <-> torch / numpy / ONNX / TensorRT / Triton.

Every file k3export writes spells a dtype by its canonical name (``"float32"``, ``"bfloat16"``, ...);
every boundary converts through `dtype(...)`, which accepts any spelling a user or a library hands us::

    dtype("bf16").torch            # torch.bfloat16
    dtype(TensorProto.FLOAT).name  # "float32"
    dtype("tensor(float16)").numpy # numpy.float16

Nothing heavy is imported here: the torch / numpy / TensorRT objects are resolved on first use.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from k3export.errors import K3ExportError


class DTypeError(K3ExportError, ValueError):
    """A dtype spelling that k3export does not know."""


@dataclass(frozen=True)
class DType:
    name: str  # canonical: what every artifact file writes
    short: str  # the CLI's spelling (fp32, bf16, ...)
    bits: int
    onnx: int  # onnx.TensorProto.DataType value
    torch_name: str | None
    numpy_name: str | None  # numpy (or ml_dtypes) type name; None: no host type
    trt_name: str | None  # tensorrt.DataType member
    triton: str | None  # Triton signature element type

    @property
    def itemsize(self) -> float:
        """Bytes per element (0.5 for 4-bit types)."""
        return self.bits / 8

    @property
    def torch(self) -> Any:
        import torch

        if self.torch_name is None:
            raise DTypeError(f"dtype {self.name} has no torch type")
        return getattr(torch, self.torch_name)

    @property
    def numpy(self) -> Any:
        import numpy as np

        if self.numpy_name is None:
            raise DTypeError(f"dtype {self.name} has no numpy type")
        if self.numpy_name == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.numpy_name)

    @property
    def trt(self) -> Any:
        import tensorrt as trt

        if self.trt_name is None:
            raise DTypeError(f"dtype {self.name} has no TensorRT type")
        return getattr(trt.DataType, self.trt_name)

    @property
    def is_float(self) -> bool:
        return self.name.startswith(("float", "bfloat"))

    def __str__(self) -> str:
        return self.name


_TABLE = (
    DType("float32", "fp32", 32, 1, "float32", "float32", "FLOAT", "fp32"),
    DType("bfloat16", "bf16", 16, 16, "bfloat16", "bfloat16", "BF16", "bf16"),
    DType("float16", "fp16", 16, 10, "float16", "float16", "HALF", "fp16"),
    DType("float64", "fp64", 64, 11, "float64", "float64", None, "fp64"),
    DType("int64", "i64", 64, 7, "int64", "int64", "INT64", "i64"),
    DType("int32", "i32", 32, 6, "int32", "int32", "INT32", "i32"),
    DType("int8", "i8", 8, 3, "int8", "int8", "INT8", "i8"),
    DType("uint8", "u8", 8, 2, "uint8", "uint8", "UINT8", "u8"),
    DType("bool", "bool", 8, 9, "bool", "bool", "BOOL", "i1"),
    DType("float4e2m1", "fp4", 4, 23, None, None, "FP4", None),
    DType("float8e8m0", "e8m0", 8, 24, None, None, None, None),
    DType("float8e4m3fn", "e4m3", 8, 17, "float8_e4m3fn", None, "FP8", "fp8e4nv"),
)
FLOAT32, BFLOAT16, FLOAT16 = _TABLE[0], _TABLE[1], _TABLE[2]
#: float4e2m1's 16 codes -> their values (bit 3 the sign): MXFP4 / NVFP4 element values
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_BY_KEY: dict[Any, DType] = {}
for _d in _TABLE:
    for _key in (_d.name, _d.short, f"tensor({_d.name})", f"torch.{_d.name}", _d.onnx, f"DataType.{_d.trt_name}"):
        _BY_KEY.setdefault(_key, _d)
for _alias, _canon in (("float", "float32"), ("half", "float16"), ("double", "float64"), ("tensor(float)", "float32"),
                       ("tensor(double)", "float64"), ("bf16", "bfloat16"), ("long", "int64"), ("int", "int32")):
    _BY_KEY[_alias] = _BY_KEY[_canon]

#: the activation dtypes an export can be made in (CLI spelling -> DType)
EXPORT_DTYPES = {d.short: d for d in (FLOAT32, BFLOAT16, FLOAT16)}


def dtype(value: Any) -> DType:
    """The `DType` of any spelling: a name (``fp32``, ``bfloat16``, ``tensor(float)``), a torch or numpy dtype,
    an ONNX ``TensorProto`` enum value, a TensorRT ``DataType`` or a `DType`."""
    if isinstance(value, DType):
        return value
    if isinstance(value, bool):
        raise DTypeError(f"unknown dtype {value!r}")
    key: Any = value if isinstance(value, int) else str(value).strip()
    if isinstance(key, str):
        key = key.lower() if not key.startswith("DataType.") else key
    found = _BY_KEY.get(key)
    if found is None and not isinstance(value, (str, int)):
        name = getattr(value, "name", None)  # numpy dtype, TensorRT enum
        found = _BY_KEY.get(str(name).lower()) or _BY_KEY.get(f"DataType.{name}")
    if found is None:
        raise DTypeError(f"unknown dtype {value!r}; known: {', '.join(d.name for d in _TABLE)}")
    return found


def dtype_among(value: Any, names: Iterable[str]) -> DType | None:
    """The `DType` of `value` (any spelling) when its canonical name is one of `names`, else None (an unknown
    spelling too): for callers that word their own error."""
    try:
        d = dtype(value)
    except DTypeError:
        return None
    return d if d.name in names else None


def export_dtype(value: Any) -> DType:
    """An activation dtype an export can be made in (fp32, bf16, fp16), else a clear error."""
    d = dtype_among(value, [e.name for e in EXPORT_DTYPES.values()])
    if d is None:
        raise DTypeError(f"unsupported export dtype {value!r}; choose one of {', '.join(EXPORT_DTYPES)}")
    return d
