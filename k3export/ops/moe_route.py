"""k3::moe_route - sigmoid router with a selection-only bias (Stable LatentMoE).

    s       = sigmoid(logits)                     (fp32)
    idx     = top_k of (s + bias), descending; ties -> lower expert index first (ONNX TopK rule)
    weights = s[idx]  (bias NOT in the weights), / (sum + 1e-20) if renormalize, * scale

The contract is ``spec.MOE_ROUTE``; the torch backend is ``naive.moe_route_naive``, the Triton backend
``moe_route_kernel`` (one program per token row, E <= 1024 and top_k <= 32; larger routers run the torch code).
"""

from __future__ import annotations

import torch

from k3export.ops import backend
from k3export.ops.naive import moe_route_naive
from k3export.ops.spec import MOE_ROUTE, OpInputError, check_tensors

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    HAVE_TRITON = False

MAX_EXPERTS = 1024
MAX_TOP_K = 32


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


def config(E: int, top_k: int) -> tuple[dict, int]:
    """(constexprs without RENORMALIZE / SCALE, num_warps) for E experts and top_k (launcher and AOT)."""
    if not (1 <= top_k <= min(E, MAX_TOP_K) and E <= MAX_EXPERTS):
        raise OpInputError(f"k3::moe_route Triton kernel: needs 1 <= top_k <= min(E, {MAX_TOP_K}) and "
                           f"E <= {MAX_EXPERTS}, got E={E}, top_k={top_k}")
    const = {"E": E, "BLOCK_E": max(16, triton.next_power_of_2(E)), "TOP_K": top_k,
             "BLOCK_K": max(2, triton.next_power_of_2(top_k))}
    return const, 4 if E <= 256 else 8


def launch(N) -> tuple[tuple, tuple]:
    """(grid, int32 scalars): one program per token row, grid (N, 1, 1); no scalars (E, top_k are baked in)."""
    return (N, 1, 1), ()


def aot_config(kernel: str, float_dtype: str, attrs: dict, dims: dict):
    """(jit function, constexprs, num_warps) of the plugin kernel: E, top_k, renormalize and scale baked in."""
    const, num_warps = config(int(dims["E"]), int(attrs["top_k"]))
    return moe_route_kernel, {**const, "RENORMALIZE": bool(attrs["renormalize"]), "SCALE": float(attrs["scale"])}, num_warps


def moe_route_triton(logits, bias, top_k: int, renormalize: bool, scale: float):
    if not HAVE_TRITON:
        raise RuntimeError("the Triton moe_route kernel needs the `triton` package")
    N, E = logits.shape
    const, num_warps = config(E, top_k)
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N:
        grid, _ = launch(N)
        moe_route_kernel[grid](logits.contiguous(), bias.contiguous(), w, idx, RENORMALIZE=bool(renormalize),
                               SCALE=float(scale), num_warps=num_warps, **const)
    return w, idx


@torch.library.custom_op("k3::moe_route", mutates_args=())
def _moe_route_op(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensors(MOE_ROUTE, logits, bias, top_k=top_k, renormalize=renormalize, scale=scale)
    if backend.resolve(logits) == "triton" and logits.shape[1] <= MAX_EXPERTS and top_k <= MAX_TOP_K:
        return moe_route_triton(logits, bias, top_k, renormalize, scale)
    return moe_route_naive(logits, bias, top_k, renormalize, scale)


@_moe_route_op.register_fake
def _(logits, bias, top_k, renormalize, scale):
    N = logits.shape[0]
    return logits.new_empty(N, top_k, dtype=torch.float32), logits.new_empty(N, top_k, dtype=torch.int64)


def moe_route(logits, bias, top_k: int, renormalize: bool = True, scale: float = 1.0):
    """``torch.ops.k3.moe_route`` with defaults (renormalize, scale 1)."""
    return torch.ops.k3.moe_route(logits, bias, top_k, renormalize, float(scale))
