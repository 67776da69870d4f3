"""TensorRT plugin ``k3::situ_glu`` (the op ``torch.ops.k3.situ_glu``, contract ``k3export.ops.spec.SITU_GLU``).

Elementwise; output like gate. ``define(trtp, trt)`` applies the ``tensorrt.plugin`` decorators (called by
``k3export.plugins.register_plugins()``), so this module imports without TensorRT.
AOT: Triton PTX with beta1 / beta2 baked in, grid and int32 scalar from ``k3export.ops.situ_glu.launch``.
JIT (debug): ``torch.ops.k3.situ_glu`` on the TensorRT buffers.

No ``from __future__ import annotations``: ``tensorrt.plugin`` inspects real annotation objects.
"""

from typing import List, Tuple

from k3export.dtypes import dtype
from k3export.ops import aot
from k3export.ops.situ_glu import launch
from k3export.ops.spec import SITU_GLU as SPEC

from . import rules


def define(trtp, trt) -> None:
    from ._torch_bridge import run_op

    TensorDesc = trtp.TensorDesc

    @trtp.register(SPEC.plugin_id)
    def situ_glu_desc(gate: TensorDesc, up: TensorDesc, beta1: float, beta2: float) -> Tuple[TensorDesc]:
        return rules.output_descs(trtp, SPEC, (gate, up), {"beta1": beta1, "beta2": beta2})

    @trtp.autotune(SPEC.plugin_id)
    def situ_glu_autotune(gate: TensorDesc, up: TensorDesc, beta1: float, beta2: float,
                          outputs: Tuple[TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(rules.autotune_types(SPEC), rules.AUTOTUNE_LAYOUT)]

    if hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams"):

        @trtp.aot_impl(SPEC.plugin_id)
        def situ_glu_aot_impl(gate: TensorDesc, up: TensorDesc, beta1: float, beta2: float,
                              outputs: Tuple[TensorDesc], tactic: int
                              ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
            kernel = aot.compile_kernel("situ_glu", dtype(gate.dtype).name, {"beta1": beta1, "beta2": beta2})
            return rules.aot_result(trtp, kernel, *launch(gate.shape_expr.numel(), trtp.cdiv))

    @trtp.impl(SPEC.plugin_id)
    def situ_glu_impl(gate: trtp.Tensor, up: trtp.Tensor, beta1: float, beta2: float,
                      outputs: Tuple[trtp.Tensor], stream: int) -> None:
        run_op(SPEC.name, (gate, up), (float(beta1), float(beta2)), outputs, stream)
