"""Quantile Balancing: the training-time update of the router bias b (e_score_correction_bias).

With scores s [m tokens, n experts] (sigmoid, fp32), current bias b [n] and k experts per token:

    α_i  = (k+1)-th largest of (s_i + b)                   (route with top-(k+1))
    q    = m k / n                                          (target load per expert)
    b̂_j  = -((q+1)-th largest over tokens i of s_ij - α_i) = (q+1)-th smallest of r_ij = α_i - s_ij
    b    = b̂ - mean(b̂)

Exact form: ``quantile_balance_exact`` (sorts, for small batches). Distributed form: every rank
bins r_ij into a histogram [n, B] (B = 1000 uniform bins over [min(b) - 1, max(b) + 1]) with
``histogram_triton`` (atomic adds) or ``histogram_torch``; the histograms are summed across ranks
(one integer all-reduce) and ``bias_from_histogram`` takes, per expert, the first bin whose
cumulative count reaches ceil(q), interpolates linearly inside it, and mean-centres.
For a non-integer q the exact form uses the (ceil(q)+1)-th largest.
"""

from __future__ import annotations

import math

import torch

from k3export.ops import backend as _backend
from k3export.ops.spec import Arg, OpInputError, OpSpec, check_tensors

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    HAVE_TRITON = False

NUM_BINS = 1000
SPEC = OpSpec("quantile_balance", (Arg("scores", "m n", "float32|float64"), Arg("bias", "n", "float32|float64")), ())


def _check(scores, bias, k):
    check_tensors(SPEC, scores, bias)
    if not isinstance(k, int) or isinstance(k, bool) or not (1 <= k < scores.shape[1]):
        raise OpInputError(f"k: expected an int with 1 <= k < n = {scores.shape[1]} (top-(k+1) routing), got {k!r}")


def routing_threshold(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """α_i: the (k+1)-th largest biased score of each token, [m]."""
    _check(scores, bias, k)
    biased = scores + bias.to(scores.dtype)
    return torch.topk(biased, k + 1, dim=-1).values[:, k]


def target_load(m: int, n: int, k: int) -> float:
    return m * k / n


def quantile_balance_exact(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Exact new bias from one batch (sorts per expert); same dtype as ``scores``."""
    _check(scores, bias, k)
    m, n = scores.shape
    alpha = routing_threshold(scores, bias, k)
    r = alpha[:, None] - scores  # [m, n]
    pos = min(int(math.ceil(target_load(m, n, k) - 1e-9)), m - 1)  # 0-based: (ceil(q)+1)-th smallest
    b_hat = torch.sort(r, dim=0).values[pos]
    return b_hat - b_hat.mean()


def histogram_bounds(bias: torch.Tensor) -> tuple[float, float]:
    """[min(b) - 1, max(b) + 1]: r = α - s always lies inside (α ∈ [min b, 1 + max b], s ∈ [0, 1])."""
    return float(bias.min()) - 1.0, float(bias.max()) + 1.0


def histogram_torch(scores, alpha, lo: float, hi: float, num_bins: int = NUM_BINS) -> torch.Tensor:
    """Per-expert counts [n, num_bins] (int32) of r_ij = α_i - s_ij over uniform bins of [lo, hi]."""
    r = alpha.to(torch.float32)[:, None] - scores.to(torch.float32)
    idx = torch.floor((r - lo) * (num_bins / (hi - lo))).to(torch.int64).clamp_(0, num_bins - 1)
    n = scores.shape[1]
    flat = (torch.arange(n, device=scores.device)[None, :] * num_bins + idx).reshape(-1)
    hist = torch.zeros(n * num_bins, dtype=torch.int64, device=scores.device)
    hist.index_add_(0, flat, torch.ones_like(flat))
    return hist.view(n, num_bins).to(torch.int32)


if HAVE_TRITON:

    @triton.jit
    def qb_histogram_kernel(
        scores_ptr, alpha_ptr, hist_ptr, M, N, lo, inv_width,
        NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): bin a [BLOCK_M, BLOCK_N] tile, atomic-add 1s."""
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        om = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        on = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        mm = om < M
        mn = on < N
        mask = mm[:, None] & mn[None, :]
        s = tl.load(scores_ptr + om.to(tl.int64)[:, None] * N + on[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.load(alpha_ptr + om, mask=mm, other=0.0).to(tl.float32)
        r = a[:, None] - s
        b = tl.floor((r - lo) * inv_width).to(tl.int32)
        b = tl.minimum(tl.maximum(b, 0), NUM_BINS - 1)
        ones = tl.full([BLOCK_M, BLOCK_N], 1, dtype=tl.int32)
        tl.atomic_add(hist_ptr + on[None, :] * NUM_BINS + b, ones, mask=mask)


def histogram_triton(scores, alpha, lo: float, hi: float, num_bins: int = NUM_BINS) -> torch.Tensor:
    """Triton atomic-add version of ``histogram_torch`` (same bins, int32 counts)."""
    if not HAVE_TRITON:
        raise RuntimeError("the Triton histogram kernel needs the `triton` package")
    s = scores.to(torch.float32).contiguous()
    a = alpha.to(torch.float32).contiguous()
    M, N = s.shape
    hist = torch.zeros(N, num_bins, dtype=torch.int32, device=s.device)
    BM, BN = 16, 32
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    if M and N:
        qb_histogram_kernel[grid](s, a, hist, M, N, float(lo), float(num_bins / (hi - lo)),
                                  NUM_BINS=num_bins, BLOCK_M=BM, BLOCK_N=BN)
    return hist


def histogram(scores, alpha, lo: float, hi: float, num_bins: int = NUM_BINS) -> torch.Tensor:
    """Dispatches to Triton or torch by the ops backend."""
    if _backend.resolve(scores) == "triton":
        return histogram_triton(scores, alpha, lo, hi, num_bins)
    return histogram_torch(scores, alpha, lo, hi, num_bins)


def bias_from_histogram(hist: torch.Tensor, lo: float, hi: float, k: int, num_tokens: int | None = None) -> torch.Tensor:
    """New mean-centred bias [n] (fp32) from summed per-expert histograms [n, B] over [lo, hi].

    num_tokens m defaults to the per-expert total count (every token lands in every expert's row).
    """
    if hist.dim() != 2:
        raise OpInputError(f"hist: expected a 2-d tensor [n, num_bins], got shape {tuple(hist.shape)}")
    n, nb = hist.shape
    if not hi > lo:
        raise OpInputError(f"bounds: expected lo < hi, got [{lo}, {hi}]")
    counts = hist.to(torch.float64)
    m = int(counts[0].sum().item()) if num_tokens is None else int(num_tokens)
    q = target_load(m, n, k)
    target = max(1, int(math.ceil(q - 1e-9)))
    cum = counts.cumsum(dim=1)
    reached = cum >= target
    if not bool(reached[:, -1].all()):
        raise OpInputError(f"hist: every expert row needs at least ceil(q) = {target} counts")
    first = reached.to(torch.int8).argmax(dim=1)  # first bin reaching the target
    in_bin = counts.gather(1, first[:, None])[:, 0]
    before = cum.gather(1, first[:, None])[:, 0] - in_bin
    frac = ((target - before) / in_bin).clamp(0.0, 1.0)
    width = (hi - lo) / nb
    b_hat = lo + (first.to(torch.float64) + frac) * width
    return (b_hat - b_hat.mean()).to(torch.float32)


def quantile_balance_update(scores: torch.Tensor, bias: torch.Tensor, k: int, num_bins: int = NUM_BINS, all_reduce=None):
    """One histogram update: α, bounds, histogram (Triton/torch by backend), optional
    ``all_reduce(hist)`` (sum across ranks, in place or returned), then the new bias."""
    alpha = routing_threshold(scores, bias, k)
    lo, hi = histogram_bounds(bias)
    hist = histogram(scores, alpha, lo, hi, num_bins)
    if all_reduce is not None:
        out = all_reduce(hist)
        hist = hist if out is None else out
    return bias_from_histogram(hist, lo, hi, k)
