"""TensorRT plugin ``k3::moe_route`` (the op ``torch.ops.k3.moe_route``, contract ``k3export.ops.spec.MOE_ROUTE``):
sigmoid router, top-k of (scores + bias), weights from the unbiased scores (renormalised, times scale).

``define(trtp, trt)`` applies the ``tensorrt.plugin`` decorators (called by
``k3export.plugins.register_plugins()``), so this module imports without TensorRT.
AOT: Triton PTX with E, top_k, renormalize and scale baked in, grid from ``k3export.ops.moe_route.launch``.
JIT (debug): ``torch.ops.k3.moe_route`` on the TensorRT buffers.

No ``from __future__ import annotations``: ``tensorrt.plugin`` inspects real annotation objects.
"""

from typing import List, Tuple

from k3export.ops import aot
from k3export.ops.moe_route import launch
from k3export.ops.spec import MOE_ROUTE as SPEC

from . import rules


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
            N, E = tuple(logits.shape_expr)
            attrs = {"top_k": top_k, "renormalize": renormalize, "scale": scale}
            kernel = aot.compile_kernel("moe_route", "fp32", attrs, rules.static_dims(SPEC, E=E))
            return rules.aot_result(trtp, kernel, *launch(N))

    @trtp.impl(SPEC.plugin_id)
    def moe_route_impl(logits: trtp.Tensor, bias: trtp.Tensor, top_k: int, renormalize: int, scale: float,
                       outputs: Tuple[trtp.Tensor, trtp.Tensor], stream: int) -> None:
        run_op(SPEC.name, (logits, bias), (int(top_k), bool(renormalize), float(scale)), outputs, stream)
