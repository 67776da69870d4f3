# Copyright 2026 the k3export authors. Apache-2.0.
"""NVFP4 routed experts (NVIDIA's ``nvidia/Kimi-K3-NVFP4``) in ONNX, and the form ONNX Runtime's CPU provider runs.

**Standard ONNX** (`bodies.moe_experts_function(nvfp4=True)`): ``k3::moe_experts(z, weights, indices, w1, w3, w2,
w1_scale, w3_scale, w2_scale, w1_scale_2, w3_scale_2, w2_scale_2)`` (`k3export.ops.spec.MOE_EXPERTS_NVFP4`), w*
FLOAT4E2M1 [E, out, in], w*_scale FLOAT8E4M3FN [E, out, in/16], w*_scale_2 fp32 [E]; each selected expert is
cropped and dequantised with two ``DequantizeLinear``: its E4M3 scales by its global scale (the standard's block
``DequantizeLinear`` takes no E4M3 scale), then its E2M1 values by those, block 16.

**ONNX Runtime** (1.32 CPU has no ``DequantizeLinear`` on FP4, nor a fast FP4 gather; `ort_moe_function`): the
8-bit form of `mxfp4` (q = 2v + 128, uint8 [E, out, in]; lossless), with float block scales e4m3 / 2 (exact)
through ``GatherBlockQuantized(bits=8, block_size=16)``, which gives v * e4m3 exactly, times the expert's
``scale_2`` (one fp32 rounding, as `k3export.converters.checkpoints.nvfp4.decode_nvfp4`): the export writes it as
the ``Q8_OVERLOAD`` of its experts' function, a session converts the bytes (`k3export.artifacts.expert_views`).
"""

from __future__ import annotations

import onnx
from onnx import helper

from k3export.artifacts.graph_forms import EXPERT_BLOCK

from .bodies import MS_DOMAIN, Body, moe_experts_nodes

GROUP_SIZE = 16
INPUTS = ["z", "weights", "indices", "w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale", "w1_scale_2",
          "w3_scale_2", "w2_scale_2"]


def _ort_experts(b: Body, weight: tuple[str, str, str], e: str, like: str) -> str:
    """Experts ``e`` (a vector) [S, out, in] from the 8-bit form: GatherBlockQuantized, times their scale_2."""
    q, s, s2 = weight
    w = b.op("GatherBlockQuantized", [q, e, s], domain=MS_DOMAIN, bits=8, block_size=GROUP_SIZE, gather_axis=0,
             quantize_axis=2)                                                                 # [S, out, in] fp32
    g = b.op("Reshape", [b.op("Gather", [s2, e], axis=0), b.const([-1, 1, 1])])
    return b.op("CastLike", [b.op("Mul", [w, g]), like])


def ort_expert(b: Body, weight: tuple[str, str, str], e: str, like: str) -> str:
    """Expert ``e``'s weight [out, in] from the 8-bit form (`_ort_experts` of one)."""
    one = _ort_experts(b, weight, b.op("Unsqueeze", [e, b.const([0])]), like)
    return b.op("Squeeze", [one, b.const([0])])


ort_expert.many = _ort_experts  # type: ignore[attr-defined]


def ort_moe_function(act: str, beta1: float, beta2: float, opset: int, domain: str | None = None,
                     block: int = EXPERT_BLOCK) -> onnx.FunctionProto:
    """``k3::moe_experts`` over the NVFP4 8-bit form (`ort_form`; the signature of the NVFP4 one) for ONNX
    Runtime's CPU provider; `domain`: the export's (default `functions.DOMAIN`); `block`: experts per iteration."""
    if domain is None:
        from .functions import DOMAIN as domain
    b = Body("")
    ws = [(w, f"{w}_scale", f"{w}_scale_2") for w in ("w1", "w3", "w2")]
    b.out(moe_experts_nodes(b, "z", "weights", "indices", *ws, act, beta1, beta2, expert=ort_expert, block=block),
          "u")
    return helper.make_function(domain, "moe_experts", INPUTS, ["u"], b.nodes,
                                [helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)],
                                attributes=["act", "beta1", "beta2"])


__all__ = ["GROUP_SIZE", "INPUTS", "ort_expert", "ort_moe_function"]
