"""TensorRT plugin ``k3::moe_experts_nvfp4`` (the op ``torch.ops.k3.moe_experts_nvfp4``, contract
``k3export.ops.spec.MOE_EXPERTS_NVFP4``): ``k3::moe_experts`` on NVIDIA's NVFP4 bytes (W4A16).

Inputs z, weights, indices, then w1, w3 uint8 [E, I, D/2], w2 uint8 [E, D, I/2] (packed E2M1, as MXFP4's), their
E4M3 block scales [E, out, in/16] and their fp32 global scales [E] (``weight_scale_2``). The packed values and the
E4M3 scales travel through TensorRT as int8 over the same bytes (``rules.TRT_BYTES``; the kernel decodes the E4M3
bit fields); the global scales stay fp32. The kernel ("tokens", `k3export.ops.moe_experts.moe_experts_nvfp4_kernel`)
decodes each weight tile in registers: e2m1 x e4m3 (exact) x scale_2. Everything else is ``k3::moe_experts``'s
and ``k3::moe_experts_mxfp4``'s (see those modules).

No ``from __future__ import annotations``: ``tensorrt.plugin`` inspects real annotation objects.
"""

from typing import List, Tuple

from k3export.ops import aot
from k3export.ops.spec import MOE_EXPERTS_NVFP4 as SPEC

from . import rules
from .moe_experts import aot_launch, grid, tactic  # noqa: F401 (one kernel, launched as k3::moe_experts's)


def kernel(tactic: int, float_dtype: str, attrs: dict, shapes: list, target: tuple) -> aot.Kernel:
    return rules.moe_experts_kernel(SPEC, float_dtype, attrs, shapes, target)


def define(trtp, trt) -> None:
    from ._torch_bridge import run_op

    TensorDesc = trtp.TensorDesc

    @trtp.register(SPEC.plugin_id)
    def moe_experts_nvfp4_desc(z: TensorDesc, weights: TensorDesc, indices: TensorDesc, w1: TensorDesc,
                               w3: TensorDesc, w2: TensorDesc, w1_scale: TensorDesc, w3_scale: TensorDesc,
                               w2_scale: TensorDesc, w1_scale_2: TensorDesc, w3_scale_2: TensorDesc,
                               w2_scale_2: TensorDesc, act: str, beta1: float, beta2: float) -> Tuple[TensorDesc]:
        attrs = {"act": act, "beta1": beta1, "beta2": beta2}
        return rules.output_descs(trtp, SPEC, (z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale,
                                               w1_scale_2, w3_scale_2, w2_scale_2), attrs)

    @trtp.autotune(SPEC.plugin_id)
    def moe_experts_nvfp4_autotune(z: TensorDesc, weights: TensorDesc, indices: TensorDesc, w1: TensorDesc,
                                   w3: TensorDesc, w2: TensorDesc, w1_scale: TensorDesc, w3_scale: TensorDesc,
                                   w2_scale: TensorDesc, w1_scale_2: TensorDesc, w3_scale_2: TensorDesc,
                                   w2_scale_2: TensorDesc, act: str, beta1: float, beta2: float,
                                   outputs: Tuple[TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(rules.autotune_types(SPEC), rules.AUTOTUNE_LAYOUT)]

    if hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams"):

        @trtp.aot_impl(SPEC.plugin_id)
        def moe_experts_nvfp4_aot_impl(z: TensorDesc, weights: TensorDesc, indices: TensorDesc, w1: TensorDesc,
                                       w3: TensorDesc, w2: TensorDesc, w1_scale: TensorDesc, w3_scale: TensorDesc,
                                       w2_scale: TensorDesc, w1_scale_2: TensorDesc, w3_scale_2: TensorDesc,
                                       w2_scale_2: TensorDesc, act: str, beta1: float, beta2: float,
                                       outputs: Tuple[TensorDesc], tactic: int
                                       ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
            return aot_launch(trtp, kernel, z, weights, w1, act, beta1, beta2, tactic)

    @trtp.impl(SPEC.plugin_id)
    def moe_experts_nvfp4_impl(z: trtp.Tensor, weights: trtp.Tensor, indices: trtp.Tensor, w1: trtp.Tensor,
                               w3: trtp.Tensor, w2: trtp.Tensor, w1_scale: trtp.Tensor, w3_scale: trtp.Tensor,
                               w2_scale: trtp.Tensor, w1_scale_2: trtp.Tensor, w3_scale_2: trtp.Tensor,
                               w2_scale_2: trtp.Tensor, act: str, beta1: float, beta2: float,
                               outputs: Tuple[trtp.Tensor], stream: int) -> None:
        run_op(SPEC.name, (z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, w1_scale_2, w3_scale_2,
                           w2_scale_2), (str(act), float(beta1), float(beta2)), outputs, stream)
