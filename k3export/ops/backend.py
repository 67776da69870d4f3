"""The one backend switch of the k3 ops.

Every registered op (``torch.ops.k3.kda``, ``k3.situ_glu``, ``k3.moe_route``) runs either its plain PyTorch
reference or a Triton kernel, and every kernel hook (``k3export.ops.KERNELS``) either runs the op or declines so
that the modeling file's PyTorch function runs. Which one is decided here, by `resolve`:

* ``"torch"``  - always the PyTorch implementation (any device, any dtype torch supports).
* ``"triton"`` - always the Triton kernel. On CUDA tensors this is the compiled kernel; on CPU
  tensors it only works under ``TRITON_INTERPRET=1`` (set before ``triton`` is first imported),
  which is how CI checks the kernels without a GPU.
* ``"auto"``   - Triton on CUDA tensors when ``triton`` is importable; on CPU the C++ kernels of `k3export.ops.cpu`
  where they exist (fp32; ``cpu._kernels``); PyTorch otherwise.

The setting is process-wide (``set_backend``) and can be overridden for a block with
``use_backend(...)``. The environment variable ``K3EXPORT_OPS_BACKEND`` sets the initial value.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch

from k3export import switches

BACKENDS = ("torch", "triton", "auto")

_backend: str = switches.choice("K3EXPORT_OPS_BACKEND") or "auto"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when ``import triton`` works (a CPU-only wheel counts: the interpreter needs it)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def triton_interpret() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def get_backend() -> str:
    """The current process-wide backend name (one of ``BACKENDS``)."""
    return _backend


def set_backend(name: str) -> str:
    """Set the process-wide backend; returns the previous one."""
    global _backend
    key = str(name).strip().lower()
    if key not in BACKENDS:
        raise ValueError(f"backend={name!r}: expected one of {BACKENDS}")
    if key == "triton" and not triton_available():
        raise ValueError("backend='triton' needs the `triton` package (pip install 'k3export[triton]')")
    previous, _backend = _backend, key
    return previous


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Context manager: ``with use_backend("triton"): ...`` then restore the previous backend."""
    previous = set_backend(name)
    try:
        yield name
    finally:
        set_backend(previous)


def resolve(*tensors: torch.Tensor) -> str:
    """Concrete implementation (``"torch"`` or ``"triton"``) for an op called on ``tensors``."""
    name = _backend
    if name == "torch":
        return "torch"
    on_cuda = all(t.device.type == "cuda" for t in tensors)
    if name == "triton":
        if not triton_available():
            raise RuntimeError("k3 ops backend is 'triton' but `import triton` fails")
        if not on_cuda and not triton_interpret():
            raise RuntimeError(
                "k3 ops backend is 'triton' but the tensors are on "
                f"{tensors[0].device.type!r}: Triton runs CUDA tensors, or CPU tensors only under "
                "TRITON_INTERPRET=1 (set before triton is imported)"
            )
        return "triton"
    # auto
    return "triton" if (on_cuda and triton_available()) else "torch"
