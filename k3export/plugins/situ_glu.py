"""TensorRT plugin ``k3::situ_glu``: SiTU-GLU(gate, up) = softcap(gate, beta1) * sigmoid(gate) * softcap(up, beta2).

Elementwise; output like gate. ``define(trtp, trt)`` applies the ``tensorrt.plugin`` decorators (called
by ``k3export.plugins.register_plugins()``), so this module imports without TensorRT.
AOT: Triton PTX with beta1/beta2 baked in, grid (cdiv(numel, BLOCK),), int32 scalar numel.
JIT (debug): ``torch.ops.k3.situ_glu`` on the TensorRT buffers.

No ``from __future__ import annotations``: ``tensorrt.plugin`` inspects real annotation objects.
"""

from typing import List, Tuple

from . import _aot, rules

OP = "situ_glu"


def define(trtp, trt) -> None:
    from ._torch_bridge import as_torch, name_to_trt, trt_to_name

    plugin_id = rules.PLUGINS[OP].plugin_id
    TensorDesc = trtp.TensorDesc

    @trtp.register(plugin_id)
    def situ_glu_desc(gate: TensorDesc, up: TensorDesc, beta1: float, beta2: float) -> Tuple[TensorDesc]:
        (shape,) = rules.situ_glu_output_shapes(tuple(gate.shape_expr))
        (dtype,) = rules.situ_glu_output_dtypes(trt_to_name(gate.dtype))
        return (trtp.from_shape_expr(shape, dtype=name_to_trt(dtype)),)

    @trtp.autotune(plugin_id)
    def situ_glu_autotune(gate: TensorDesc, up: TensorDesc, beta1: float, beta2: float,
                          outputs: Tuple[TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(rules.AUTOTUNE_TYPES[OP], rules.AUTOTUNE_LAYOUT)]

    if hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams"):

        @trtp.aot_impl(plugin_id)
        def situ_glu_aot_impl(gate: TensorDesc, up: TensorDesc, beta1: float, beta2: float,
                              outputs: Tuple[TensorDesc], tactic: int
                              ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
            kernel, cfg = _aot.compile_situ_glu(trt_to_name(gate.dtype), beta1, beta2)
            plan = rules.situ_glu_launch(gate.shape_expr.numel(), cfg["BLOCK"], trtp.cdiv)
            return _aot.aot_result(trtp, kernel, plan)

    @trtp.impl(plugin_id)
    def situ_glu_impl(gate: trtp.Tensor, up: trtp.Tensor, beta1: float, beta2: float,
                      outputs: Tuple[trtp.Tensor], stream: int) -> None:
        import torch

        import k3export.ops.situ_glu  # noqa: F401  registers torch.ops.k3.situ_glu

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            out = torch.ops.k3.situ_glu(as_torch(gate), as_torch(up), float(beta1), float(beta2))
            as_torch(outputs[0]).copy_(out)
