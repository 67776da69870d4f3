"""TensorRT plugin ``k3::moe_experts`` (the op ``torch.ops.k3.moe_experts``, contract
``k3export.ops.spec.MOE_EXPERTS``): the routed experts, u [N, D] fp32 = sum over each token's top_k slots of
weight * W2 act(W1 z, W3 z).

`kernel` / `grid` (``rules.moe_experts_kernel`` / ``moe_experts_grid``) say once which kernel runs and how it is
launched; ``define(trtp, trt)`` applies the ``tensorrt.plugin`` decorators with them (called by
``k3export.plugins.register_plugins()``, so this module imports without TensorRT) and `k3export.plugins.v3` builds
the class-based plugin from them.

* ``register``  output desc from the spec: u [N, D] fp32.
* ``autotune``  the spec's io types (z and the weights share FP32|BF16|FP16), LINEAR.
* ``aot_impl``  Triton PTX of the "tokens" kernel (``k3export.ops.moe_experts``) with E, I, D, top_k, act and the
                betas baked in; grid (cdiv(N, BN),) and the int32 scalar N from ``moe_experts.launch``. A program owns
                BN token rows of u, so the kernel needs no zeroed output and no workspace (TensorRT gives an AOT
                kernel neither): each selected expert is read once per BN tokens.
* ``impl``      JIT debug path: ``torch.ops.k3.moe_experts`` on the TensorRT buffers (the expert-parallel kernel).

No ``from __future__ import annotations``: ``tensorrt.plugin`` inspects real annotation objects.
"""

from typing import List, Tuple

from k3export.dtypes import dtype
from k3export.ops import aot
from k3export.ops.spec import MOE_EXPERTS as SPEC

from . import rules


def tactic(shapes_max: list, float_dtype: str, attrs: dict, target: tuple) -> int:
    return 0  # one kernel


def kernel(tactic: int, float_dtype: str, attrs: dict, shapes: list, target: tuple) -> aot.Kernel:
    return rules.moe_experts_kernel(SPEC, float_dtype, attrs, shapes, target)


def grid(kernel: aot.Kernel, shapes: list, attrs: dict, cdiv=rules.ceil_div) -> tuple:
    return rules.moe_experts_grid(kernel, shapes, cdiv)


def aot_launch(trtp, kernel_of, z, weights, w1, act: str, beta1: float, beta2: float, tactic: int) -> tuple:
    """What the ``aot_impl`` of this plugin and of ``k3::moe_experts_mxfp4`` returns: `kernel_of` (the module's
    `kernel`) compiled from z's, the weights' and w1's shape expressions, launched by `grid`."""
    attrs = {"act": act, "beta1": beta1, "beta2": beta2}
    shapes = [tuple(z.shape_expr), tuple(weights.shape_expr), None, tuple(w1.shape_expr)]
    k = kernel_of(tactic, dtype(z.dtype).name, attrs, shapes, rules.kernel_target())
    return rules.aot_result(trtp, k, *grid(k, shapes, attrs, trtp.cdiv))


def define(trtp, trt) -> None:
    from ._torch_bridge import run_op

    TensorDesc = trtp.TensorDesc

    @trtp.register(SPEC.plugin_id)
    def moe_experts_desc(z: TensorDesc, weights: TensorDesc, indices: TensorDesc, w1: TensorDesc, w3: TensorDesc,
                         w2: TensorDesc, act: str, beta1: float, beta2: float) -> Tuple[TensorDesc]:
        attrs = {"act": act, "beta1": beta1, "beta2": beta2}
        return rules.output_descs(trtp, SPEC, (z, weights, indices, w1, w3, w2), attrs)

    @trtp.autotune(SPEC.plugin_id)
    def moe_experts_autotune(z: TensorDesc, weights: TensorDesc, indices: TensorDesc, w1: TensorDesc,
                             w3: TensorDesc, w2: TensorDesc, act: str, beta1: float, beta2: float,
                             outputs: Tuple[TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(rules.autotune_types(SPEC), rules.AUTOTUNE_LAYOUT)]

    if hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams"):

        @trtp.aot_impl(SPEC.plugin_id)
        def moe_experts_aot_impl(z: TensorDesc, weights: TensorDesc, indices: TensorDesc, w1: TensorDesc,
                                 w3: TensorDesc, w2: TensorDesc, act: str, beta1: float, beta2: float,
                                 outputs: Tuple[TensorDesc], tactic: int
                                 ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
            return aot_launch(trtp, kernel, z, weights, w1, act, beta1, beta2, tactic)

    @trtp.impl(SPEC.plugin_id)
    def moe_experts_impl(z: trtp.Tensor, weights: trtp.Tensor, indices: trtp.Tensor, w1: trtp.Tensor,
                         w3: trtp.Tensor, w2: trtp.Tensor, act: str, beta1: float, beta2: float,
                         outputs: Tuple[trtp.Tensor], stream: int) -> None:
        run_op(SPEC.name, (z, weights, indices, w1, w3, w2), (str(act), float(beta1), float(beta2)), outputs, stream)
