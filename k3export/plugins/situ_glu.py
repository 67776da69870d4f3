"""TensorRT plugin ``k3::situ_glu`` (the op ``torch.ops.k3.situ_glu``, contract ``k3export.ops.spec.SITU_GLU``).

Elementwise; output like gate. `kernel` / `grid` say once which kernel runs and how it is launched (Triton PTX with
beta1 / beta2 baked in, grid and int32 scalar from ``k3export.ops.situ_glu.launch``); ``define(trtp, trt)`` applies
the ``tensorrt.plugin`` decorators with them (called by ``k3export.plugins.register_plugins()``, so this module
imports without TensorRT) and `k3export.plugins.v3` builds the class-based plugin from them.
JIT (debug): ``torch.ops.k3.situ_glu`` on the TensorRT buffers.

No ``from __future__ import annotations``: ``tensorrt.plugin`` inspects real annotation objects.
"""

import math
from typing import List, Tuple

from k3export.dtypes import dtype
from k3export.ops import aot
from k3export.ops.situ_glu import launch
from k3export.ops.spec import SITU_GLU as SPEC

from . import rules


def tactic(shapes_max: list, float_dtype: str, attrs: dict, target: tuple) -> int:
    return 0  # one kernel


def kernel(tactic: int, float_dtype: str, attrs: dict, shapes: list, target: tuple) -> aot.Kernel:
    return aot.compile_kernel("situ_glu", float_dtype, {"beta1": attrs["beta1"], "beta2": attrs["beta2"]}, None,
                              target)


def grid(kernel: aot.Kernel, shapes: list, attrs: dict, cdiv=rules.ceil_div) -> tuple:
    """(grid, int32 scalars) over gate's elements; `shapes[0]` a tuple of ints, or a ``ShapeExprs`` (its numel)."""
    numel = shapes[0].numel() if hasattr(shapes[0], "numel") else math.prod(int(d) for d in shapes[0])
    return launch(numel, cdiv)


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
            attrs = {"beta1": beta1, "beta2": beta2}
            k = kernel(tactic, dtype(gate.dtype).name, attrs, [gate.shape_expr], rules.kernel_target())
            return rules.aot_result(trtp, k, *grid(k, [gate.shape_expr], attrs, trtp.cdiv))

    @trtp.impl(SPEC.plugin_id)
    def situ_glu_impl(gate: trtp.Tensor, up: trtp.Tensor, beta1: float, beta2: float,
                      outputs: Tuple[trtp.Tensor], stream: int) -> None:
        run_op(SPEC.name, (gate, up), (float(beta1), float(beta2)), outputs, stream)
