"""k3::moe_route - sigmoid router with a selection-only bias (Stable LatentMoE).

    s       = sigmoid(logits)                     (fp32)
    idx     = top_k of (s + bias), descending; ties -> lower expert index first (ONNX TopK rule)
    weights = s[idx]  (bias NOT in the weights), / (sum + 1e-20) if renormalize, * scale

logits [N, E] fp32, bias [E] fp32 -> (weights fp32 [N, top_k], indices int64 [N, top_k]).
"""

from __future__ import annotations

import math

import torch

from k3export.ops import backend as _backend
from k3export.ops._common import OpInputError, check_dtype, check_rank, check_same_device, check_shape, next_pow2

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False

MAX_EXPERTS = 1024
MAX_TOP_K = 32
RENORM_EPS = 1e-20


def check_moe_route_inputs(logits, bias, top_k, renormalize, scale) -> None:
    check_rank("logits", logits, 2, "[N, E]")
    E = logits.shape[1]
    check_rank("bias", bias, 1, "[E]")
    check_shape("bias", bias, (E,), "[E] (E from logits)")
    check_dtype("logits", logits, (torch.float32,), " (the router runs in fp32)")
    check_dtype("bias", bias, (torch.float32,))
    check_same_device(logits=logits, bias=bias)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise OpInputError(f"top_k: expected an int, got {type(top_k).__name__}")
    if top_k < 1:
        raise OpInputError(f"top_k: expected 1 <= top_k <= E = {E}, got {top_k}")
    if top_k > E:
        raise OpInputError(f"top_k: expected top_k <= number of experts E = {E} (logits [N, E]), got {top_k}")
    if not isinstance(renormalize, bool):
        raise OpInputError(f"renormalize: expected a bool, got {type(renormalize).__name__}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise OpInputError(f"scale: expected a finite float, got {scale!r}")


def moe_route_naive(logits, bias, top_k: int, renormalize: bool, scale: float):
    """Reference: stable descending sort of (s + bias) gives ties to the lower index."""
    s = torch.sigmoid(logits.to(torch.float32))
    biased = s + bias.to(torch.float32)
    order = torch.sort(biased, dim=-1, descending=True, stable=True).indices[..., :top_k]
    w = torch.gather(s, -1, order)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + RENORM_EPS)
    return (w * scale).to(torch.float32), order.to(torch.int64)


if HAVE_TRITON:

    @triton.jit
    def moe_route_kernel(
        logits_ptr, bias_ptr,  # inputs
        weights_ptr, indices_ptr,  # outputs (no int32 scalars: one program per row, E baked)
        E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
        RENORMALIZE: tl.constexpr, SCALE: tl.constexpr,
    ):
        """Grid (N,): program n routes token row n by TOP_K rounds of (max, lowest index of max)."""
        row = tl.program_id(0).to(tl.int64)
        oe = tl.arange(0, BLOCK_E)
        me = oe < E
        x = tl.load(logits_ptr + row * E + oe, mask=me, other=0.0).to(tl.float32)
        b = tl.load(bias_ptr + oe, mask=me, other=0.0).to(tl.float32)
        ex = tl.exp(-tl.abs(x))  # overflow-free sigmoid
        s = tl.where(x >= 0, 1.0 / (1.0 + ex), ex / (1.0 + ex))
        score = tl.where(me, s + b, float("-inf"))
        ok = tl.arange(0, BLOCK_K)
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        idx = tl.zeros([BLOCK_K], dtype=tl.int32)
        for i in tl.static_range(0, TOP_K):
            best = tl.max(score, axis=0)
            j = tl.min(tl.where((score == best) & me, oe, BLOCK_E), axis=0)
            sj = tl.sum(tl.where(oe == j, s, 0.0), axis=0)
            w = tl.where(ok == i, sj, w)
            idx = tl.where(ok == i, j, idx)
            score = tl.where(oe == j, float("-inf"), score)
        mk = ok < TOP_K
        if RENORMALIZE:
            w = w / (tl.sum(tl.where(mk, w, 0.0), axis=0) + 1e-20)
        w = w * SCALE
        tl.store(weights_ptr + row * TOP_K + ok, w, mask=mk)
        tl.store(indices_ptr + row * TOP_K + ok, idx.to(tl.int64), mask=mk)


def launch_config(E: int, top_k: int) -> dict:
    return {"BLOCK_E": max(16, next_pow2(E)), "BLOCK_K": max(2, next_pow2(top_k)), "num_warps": 4 if E <= 256 else 8}


def moe_route_triton(logits, bias, top_k: int, renormalize: bool, scale: float):
    if not HAVE_TRITON:
        raise RuntimeError("the Triton moe_route kernel needs the `triton` package")
    N, E = logits.shape
    if E > MAX_EXPERTS or top_k > MAX_TOP_K:
        raise OpInputError(
            f"moe_route Triton kernel supports E <= {MAX_EXPERTS} and top_k <= {MAX_TOP_K}, got E={E}, top_k={top_k}"
        )
    x = logits.contiguous()
    bb = bias.contiguous()
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N:
        cfg = launch_config(E, top_k)
        moe_route_kernel[(N,)](
            x, bb, w, idx, E=E, BLOCK_E=cfg["BLOCK_E"], TOP_K=top_k, BLOCK_K=cfg["BLOCK_K"],
            RENORMALIZE=bool(renormalize), SCALE=float(scale), num_warps=cfg["num_warps"],
        )
    return w, idx


@torch.library.custom_op("k3::moe_route", mutates_args=())
def _moe_route_op(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_moe_route_inputs(logits, bias, top_k, renormalize, scale)
    E = logits.shape[1]
    if _backend.resolve(logits) == "triton" and E <= MAX_EXPERTS and top_k <= MAX_TOP_K:
        return moe_route_triton(logits, bias, top_k, renormalize, scale)
    return moe_route_naive(logits, bias, top_k, renormalize, scale)


@_moe_route_op.register_fake
def _moe_route_fake(logits, bias, top_k, renormalize, scale):
    N = logits.shape[0]
    return (
        logits.new_empty(N, top_k, dtype=torch.float32),
        logits.new_empty(N, top_k, dtype=torch.int64),
    )


def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool = True, scale: float = 1.0):
    """Validated entry point for ``torch.ops.k3.moe_route``."""
    check_moe_route_inputs(logits, bias, top_k, renormalize, float(scale) if isinstance(scale, int) else scale)
    return torch.ops.k3.moe_route(logits, bias, int(top_k), bool(renormalize), float(scale))
