"""Launch an AOT-compiled plugin kernel (`k3export.ops.aot.Kernel`: PTX, entry, block, shared memory) on a CUDA
stream through the CUDA driver API (``libcuda.so.1`` by ctypes; no CUDA Python package, no Triton at run time).

The class-based plugins (`k3export.plugins.v3`) call `launch` from ``enqueue``: the argument buffer is the kernel's
PTX ``.entry`` parameter list, input pointers, then int32 scalars, then output pointers (the layout
``aot.check_layout`` enforces at build time), then a null pointer for each of Triton's hidden scratch pointers
(their sizes are checked to be 0). A module is loaded once per CUDA context and PTX (the driver JIT-compiles the PTX
for the device it runs on). Importing this module loads nothing; the first launch opens the driver.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from typing import Any

from k3export.errors import ExportError
from k3export.ops import aot

#: CUfunction_attribute CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
MAX_DYNAMIC_SHARED = 8
#: dynamic shared memory a launch gets without raising the function's limit
DEFAULT_SHARED = 48 * 1024


class CudaError(ExportError):
    """The CUDA driver refused a load or a launch."""


def hidden_params(kernel: aot.Kernel) -> int:
    """How many trailing pointer parameters (Triton's scratch pointers) the PTX entry has beyond the launch layout."""
    return len(aot.ptx_params(kernel.ptx, kernel.entry)) - (kernel.n_inputs + kernel.n_scalars + kernel.n_outputs)


def argument_buffer(kernel: aot.Kernel, inputs: Sequence[int], scalars: Sequence[int], outputs: Sequence[int]
                    ) -> tuple[Any, list]:
    """(``void*[]`` for cuLaunchKernel, the ctypes values it points at, to keep alive): the entry's parameters in
    order. ValueError when the counts differ from the kernel's layout or a scalar does not fit int32."""
    if (len(inputs), len(scalars), len(outputs)) != (kernel.n_inputs, kernel.n_scalars, kernel.n_outputs):
        raise ValueError(f"{kernel.entry}: takes {kernel.n_inputs} inputs, {kernel.n_scalars} scalars, "
                         f"{kernel.n_outputs} outputs; got {len(inputs)}, {len(scalars)}, {len(outputs)}")
    for s in scalars:
        if not -(2**31) <= int(s) < 2**31:
            raise ValueError(f"{kernel.entry}: scalar {s} does not fit int32")
    values: list = ([ctypes.c_uint64(int(p)) for p in inputs] + [ctypes.c_int32(int(s)) for s in scalars]
                    + [ctypes.c_uint64(int(p)) for p in outputs]
                    + [ctypes.c_uint64(0) for _ in range(hidden_params(kernel))])
    buffer = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    return buffer, values


class Driver:
    """The few CUDA driver entry points a launch needs (one per process; `driver()`)."""

    def __init__(self, lib: Any = None) -> None:
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        self._functions: dict[tuple, Any] = {}

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(text))
            raise CudaError(f"CUDA driver: {what} failed with error {result} "
                            f"({text.value.decode() if text.value else 'unknown'})")

    def function(self, kernel: aot.Kernel) -> Any:
        """The CUfunction of `kernel` in the current context (its module loaded on first use)."""
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        key = (ctx.value, kernel.entry, hashlib.sha256(kernel.ptx.encode()).hexdigest())
        if key not in self._functions:
            module, fn = ctypes.c_void_p(), ctypes.c_void_p()
            self._check(self.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(kernel.ptx.encode() + b"\0")),
                        f"cuModuleLoadData({kernel.entry})")
            self._check(self.lib.cuModuleGetFunction(ctypes.byref(fn), module, kernel.entry.encode()),
                        f"cuModuleGetFunction({kernel.entry})")
            if kernel.shared > DEFAULT_SHARED:
                self._check(self.lib.cuFuncSetAttribute(fn, MAX_DYNAMIC_SHARED, int(kernel.shared)),
                            f"cuFuncSetAttribute({kernel.entry}, {kernel.shared} B shared)")
            self._functions[key] = fn
        return self._functions[key]

    def launch(self, kernel: aot.Kernel, grid: Sequence[int], inputs: Sequence[int], scalars: Sequence[int],
               outputs: Sequence[int], stream: int) -> bool:
        """Launch `kernel` on `stream`; False (nothing launched) for an empty grid (no tokens, no elements)."""
        gx, gy, gz = (int(g) for g in grid)
        if min(gx, gy, gz) <= 0:
            return False
        buffer, _keep = argument_buffer(kernel, inputs, scalars, outputs)
        self._check(self.lib.cuLaunchKernel(self.function(kernel), gx, gy, gz, kernel.block[0], kernel.block[1],
                                            kernel.block[2], int(kernel.shared), ctypes.c_void_p(int(stream)), buffer,
                                            None), f"cuLaunchKernel({kernel.entry}, grid {(gx, gy, gz)})")
        return True


_driver: list[Driver] = []


def driver() -> Driver:
    if not _driver:
        _driver.append(Driver())
    return _driver[0]


__all__ = ["CudaError", "Driver", "argument_buffer", "driver", "hidden_params"]
