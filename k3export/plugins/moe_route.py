"""TensorRT plugin ``k3::moe_route``: sigmoid router, top-k of (scores + bias), weights from the unbiased
scores (renormalised, times scale). weights [N, top_k] fp32, indices [N, top_k] int64.

``define(trtp, trt)`` applies the ``tensorrt.plugin`` decorators (called by
``k3export.plugins.register_plugins()``), so this module imports without TensorRT.
AOT: Triton PTX with E, top_k, renormalize and scale baked in, grid (N,) (one program per row), no scalars.
JIT (debug): ``torch.ops.k3.moe_route`` on the TensorRT buffers.

No ``from __future__ import annotations``: ``tensorrt.plugin`` inspects real annotation objects.
"""

from typing import List, Tuple

from . import _aot, rules

OP = "moe_route"


def define(trtp, trt) -> None:
    from ._torch_bridge import as_torch, name_to_trt

    plugin_id = rules.PLUGINS[OP].plugin_id
    TensorDesc = trtp.TensorDesc

    @trtp.register(plugin_id)
    def moe_route_desc(logits: TensorDesc, bias: TensorDesc, top_k: int, renormalize: int,
                       scale: float) -> Tuple[TensorDesc, TensorDesc]:
        w_shape, i_shape = rules.moe_route_output_shapes(tuple(logits.shape_expr), top_k)
        w_dtype, i_dtype = rules.moe_route_output_dtypes()
        return (trtp.from_shape_expr(w_shape, dtype=name_to_trt(w_dtype)),
                trtp.from_shape_expr(i_shape, dtype=name_to_trt(i_dtype)))

    @trtp.autotune(plugin_id)
    def moe_route_autotune(logits: TensorDesc, bias: TensorDesc, top_k: int, renormalize: int, scale: float,
                           outputs: Tuple[TensorDesc, TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(rules.AUTOTUNE_TYPES[OP], rules.AUTOTUNE_LAYOUT)]

    if hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams"):

        @trtp.aot_impl(plugin_id)
        def moe_route_aot_impl(logits: TensorDesc, bias: TensorDesc, top_k: int, renormalize: int, scale: float,
                               outputs: Tuple[TensorDesc, TensorDesc], tactic: int
                               ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
            N, E = tuple(logits.shape_expr)
            if E.is_fake or not E.is_constant:
                raise ValueError("k3::moe_route: the number of experts E must be static in the network")
            kernel, _consts = _aot.compile_moe_route(E.constant_value(), top_k, renormalize, scale)
            plan = rules.moe_route_launch(N)
            return _aot.aot_result(trtp, kernel, plan)

    @trtp.impl(plugin_id)
    def moe_route_impl(logits: trtp.Tensor, bias: trtp.Tensor, top_k: int, renormalize: int, scale: float,
                       outputs: Tuple[trtp.Tensor, trtp.Tensor], stream: int) -> None:
        import torch

        import k3export.ops.moe_route  # noqa: F401  registers torch.ops.k3.moe_route

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            w, idx = torch.ops.k3.moe_route(as_torch(logits), as_torch(bias), int(top_k), bool(renormalize),
                                            float(scale))
            as_torch(outputs[0]).copy_(w)
            as_torch(outputs[1]).copy_(idx)
