"""The K3 custom ops registered with torch, and the kernel hooks of the modeling file.

Importing this module (the package does on first use of one of these names) registers ``k3::kda``,
``k3::situ_glu``, ``k3::moe_route``, ``k3::moe_experts`` and ``k3::moe_experts_mxfp4`` with torch. It never imports
``k3export.modeling``: the modeling file declares its PyTorch functions as fallbacks of named kernel hooks, and the
layer above both plugs ours in::

    from k3export.modeling.modeling_k3 import register_kernel
    for name, kernel in k3export.ops.KERNELS.items():
        register_kernel(name, kernel)

Each entry of `KERNELS` takes exactly the arguments of the modeling function of the same name and returns
``NotImplemented`` (so the PyTorch function runs) when the one backend switch (`backend`, set with
``K3EXPORT_OPS_BACKEND`` / `set_backend` / `use_backend`) rules its kernel out, or when the inputs are outside the
kernels' contract (`spec`: e.g. float64, an unsupported chunk size; `cpu`: fp32 only).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from k3export.ops import cpu, cpu_bags, expert_stacks
from k3export.ops.backend import BACKENDS, get_backend, resolve, set_backend, triton_available, use_backend
from k3export.ops.kda import kda, kda_algorithm
from k3export.ops.moe_experts import moe_experts, moe_experts_mxfp4
from k3export.ops.moe_route import moe_route
from k3export.ops.naive import (kda_naive, moe_experts_mxfp4_naive, moe_experts_naive, moe_route_naive,
                                mxfp4_dequant_naive, situ_glu_naive)
from k3export.ops.situ_glu import situ_glu
from k3export.ops.spec import ALL_SPECS, SPECS, OpInputError, OpSpec


def _hook(op: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # a list is one weight per expert (where `expert_weights` declined): the registered ops take stacks
        if any(isinstance(a, list) for a in args) or resolve(*tensors) == "torch":
            return NotImplemented
        try:
            return op(*args, **kwargs)
        except OpInputError:  # outside the kernels' contract: the caller's PyTorch function runs
            return NotImplemented

    kernel.__name__ = kernel.__qualname__ = f"k3_{op.__name__}"
    return kernel


def _first(*kernels: Callable[..., Any]) -> Callable[..., Any]:
    """One hook's kernels in turn (Triton, then CPU): the first that does not decline runs."""
    if len(kernels) == 1:
        return kernels[0]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        for k in kernels:
            out = k(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return NotImplemented

    kernel.__name__ = kernel.__qualname__ = kernels[0].__name__
    return kernel


_TRITON = {n: _hook(getattr(torch.ops.k3, n)) for n in ("kda", "situ_glu", "moe_route", "moe_experts")}

_ALL = (_TRITON, cpu.KERNELS, cpu_bags.KERNELS, expert_stacks.KERNELS)  # in the order a hook tries them
#: name -> kernel for `k3export.modeling.modeling_k3.register_kernel` (see the module docstring)
KERNELS: dict[str, Callable[..., Any]] = {n: _first(*(ks[n] for ks in _ALL if n in ks)) for ks in _ALL for n in ks}

__all__ = [
    "ALL_SPECS", "BACKENDS", "KERNELS", "OpInputError", "OpSpec", "SPECS", "get_backend", "kda", "kda_algorithm",
    "kda_naive", "moe_experts", "moe_experts_mxfp4", "moe_experts_mxfp4_naive", "moe_experts_naive", "moe_route",
    "moe_route_naive", "mxfp4_dequant_naive", "resolve", "set_backend", "situ_glu", "situ_glu_naive",
    "triton_available", "use_backend",
]

# the package's names for the ops are these functions, not the submodules of the same names that importing them bound
for _name in __all__:
    setattr(sys.modules[__package__], _name, globals()[_name])
