"""TensorRT plugin ``k3::moe_route`` (the op ``torch.ops.k3.moe_route``, contract ``k3export.ops.spec.MOE_ROUTE``):
sigmoid router, top-k of (scores + bias), weights from the unbiased scores (renormalised, times scale).

`kernel` / `grid` say once which kernel runs and how it is launched (Triton PTX with E, top_k, renormalize and scale
baked in, grid from ``k3export.ops.moe_route.launch``); ``define(trtp, trt)`` applies the ``tensorrt.plugin``
decorators with them (called by ``k3export.plugins.register_plugins()``, so this module imports without TensorRT)
and `k3export.plugins.v3` builds the class-based plugin from them.
JIT (debug): ``torch.ops.k3.moe_route`` on the TensorRT buffers.

No ``from __future__ import annotations``: ``tensorrt.plugin`` inspects real annotation objects.
"""

from typing import List, Tuple

from k3export.ops import aot
from k3export.ops.moe_route import launch
from k3export.ops.spec import MOE_ROUTE as SPEC

from . import rules


def tactic(shapes_max: list, float_dtype: str, attrs: dict, target: tuple) -> int:
    return 0  # one kernel


def kernel(tactic: int, float_dtype: str, attrs: dict, shapes: list, target: tuple) -> aot.Kernel:
    """The router kernel; it runs in fp32 whatever the activations (the spec's logits are fp32)."""
    dims = rules.static_dims(SPEC, E=tuple(shapes[0])[1])
    return aot.compile_kernel("moe_route", "fp32", dict(attrs), dims, target)


def grid(kernel: aot.Kernel, shapes: list, attrs: dict, cdiv=rules.ceil_div) -> tuple:
    return launch(tuple(shapes[0])[0])


def define(trtp, trt) -> None:
    from ._torch_bridge import run_op

    TensorDesc = trtp.TensorDesc

    @trtp.register(SPEC.plugin_id)
    def moe_route_desc(logits: TensorDesc, bias: TensorDesc, top_k: int, renormalize: int,
                       scale: float) -> Tuple[TensorDesc, TensorDesc]:
        attrs = {"top_k": top_k, "renormalize": renormalize, "scale": scale}
        return rules.output_descs(trtp, SPEC, (logits, bias), attrs)

    @trtp.autotune(SPEC.plugin_id)
    def moe_route_autotune(logits: TensorDesc, bias: TensorDesc, top_k: int, renormalize: int, scale: float,
                           outputs: Tuple[TensorDesc, TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(rules.autotune_types(SPEC), rules.AUTOTUNE_LAYOUT)]

    if hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams"):

        @trtp.aot_impl(SPEC.plugin_id)
        def moe_route_aot_impl(logits: TensorDesc, bias: TensorDesc, top_k: int, renormalize: int, scale: float,
                               outputs: Tuple[TensorDesc, TensorDesc], tactic: int
                               ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
            attrs = {"top_k": top_k, "renormalize": renormalize, "scale": scale}
            k = kernel(tactic, "fp32", attrs, [logits.shape_expr], rules.kernel_target())
            return rules.aot_result(trtp, k, *grid(k, [logits.shape_expr], attrs))

    @trtp.impl(SPEC.plugin_id)
    def moe_route_impl(logits: trtp.Tensor, bias: trtp.Tensor, top_k: int, renormalize: int, scale: float,
                       outputs: Tuple[trtp.Tensor, trtp.Tensor], stream: int) -> None:
        run_op(SPEC.name, (logits, bias), (int(top_k), bool(renormalize), float(scale)), outputs, stream)
