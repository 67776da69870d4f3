"""k3export.ops: the K3 custom ops (``torch.ops.k3.*``), their naive references and Triton kernels.

Importing this package registers ``k3::kda``, ``k3::situ_glu``, ``k3::moe_route``, ``k3::moe_experts`` and
``k3::moe_experts_mxfp4`` with torch. It never imports ``k3export.modeling``: the modeling file declares its PyTorch
functions as fallbacks of named kernel hooks, and the layer above both plugs ours in::

    from k3export.modeling.modeling_k3 import register_kernel
    for name, kernel in k3export.ops.KERNELS.items():
        register_kernel(name, kernel)

Each entry of `KERNELS` takes exactly the arguments of the modeling function of the same name and returns
``NotImplemented`` (so the PyTorch function runs) when the one backend switch (`backend`, set with
``K3_OPS_BACKEND`` / `set_backend` / `use_backend`) rules its kernel out, or when the inputs are outside the
kernels' contract (`spec`: e.g. float64, an unsupported chunk size; `cpu`: fp32 only).

Layout: ``spec`` (each op's contract, written once), ``naive`` (the references: a leaf that imports only torch),
``kda`` / ``situ_glu`` / ``moe_route`` / ``moe_experts`` (Triton kernels, launch rules, the registered ops), ``aot``
(plugin kernels to PTX), ``backend`` (the switch), ``expert_stacks`` (the ``expert_weights`` hook: a layer's expert
weights kept stacked in place), and for CPU decode ``cpu`` (C++ kernels for ``kda_layer``, ``attn_res_aggregate``,
``rms_norm`` and ``moe_route``) and ``cpu_bags`` (``embedding_bag`` reads for ``linears`` and ``moe_experts``).
``quantile_balance`` (the training-time router-bias update) is imported where it is used.
"""

from __future__ import annotations

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
