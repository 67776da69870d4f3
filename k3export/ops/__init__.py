"""k3export.ops: the K3 custom ops (``torch.ops.k3.*``), their contracts, naive references and Triton kernels.

Layout: ``spec`` (each op's contract, written once), ``naive`` (the references: a leaf that imports only torch),
``kda`` / ``situ_glu`` / ``moe_route`` / ``moe_experts`` (Triton kernels, launch rules, the registered ops), ``aot``
(plugin kernels to PTX), ``backend`` (the switch), ``expert_stacks`` (the ``expert_weights`` hook: a layer's expert
weights kept stacked in place), and for CPU decode ``cpu`` (C++ kernels for ``kda_layer``, ``attn_res_aggregate``,
``rms_norm`` and ``moe_route``) and ``cpu_bags`` (``embedding_bag`` reads for ``linears`` and ``moe_experts``).
``quantile_balance`` (the training-time router-bias update) is imported where it is used.

Importing the package imports no torch: `spec`'s names come from ``spec`` (what an export folder's check and the
native runtime libraries read, in a process without torch); every other name, on first use, imports ``registry``,
which registers ``k3::kda``, ``k3::situ_glu``, ``k3::moe_route``, ``k3::moe_experts`` and ``k3::moe_experts_mxfp4``
with torch (``import k3export.ops.registry`` does that alone).
"""

from __future__ import annotations

import importlib
from typing import Any

_SPEC_NAMES = ("ALL_SPECS", "OpInputError", "OpSpec", "SPECS")
_REGISTRY_NAMES = (
    "BACKENDS", "KERNELS", "get_backend", "kda", "kda_algorithm", "kda_naive", "moe_experts", "moe_experts_mxfp4",
    "moe_experts_mxfp4_naive", "moe_experts_naive", "moe_route", "moe_route_naive", "mxfp4_dequant_naive", "resolve",
    "set_backend", "situ_glu", "situ_glu_naive", "triton_available", "use_backend",
)


def __getattr__(name: str) -> Any:
    if name in _SPEC_NAMES:
        return getattr(importlib.import_module(f"{__name__}.spec"), name)
    if name in _REGISTRY_NAMES:
        return getattr(importlib.import_module(f"{__name__}.registry"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_SPEC_NAMES + _REGISTRY_NAMES)
