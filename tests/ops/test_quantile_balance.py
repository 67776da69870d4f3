"""Quantile Balancing: K3.md oracle, exact small-batch update, Triton histogram vs torch."""

import math

import pytest
import torch

from k3export.ops import use_backend
from k3export.ops.quantile_balance import (
    bias_from_histogram,
    histogram_bounds,
    histogram_torch,
    histogram_triton,
    quantile_balance_exact,
    quantile_balance_update,
    routing_threshold,
)


def test_k3_oracle():
    hist = torch.tensor([[0, 2, 2, 0], [2, 2, 0, 0]], dtype=torch.int32)
    b = bias_from_histogram(hist, -1.0, 1.0, k=1)
    assert torch.allclose(b, torch.tensor([0.25, -0.25]), atol=1e-7)


def test_exact_update_by_hand():
    """3 experts, 3 tokens, k=1: α = 2nd largest biased score; q = 1 -> 2nd smallest r per expert."""
    s = torch.tensor([[0.9, 0.5, 0.1], [0.2, 0.8, 0.6], [0.7, 0.3, 0.4]], dtype=torch.float64)
    b = torch.zeros(3, dtype=torch.float64)
    alpha = torch.tensor([0.5, 0.6, 0.4], dtype=torch.float64)
    assert torch.allclose(routing_threshold(s, b, 1), alpha)
    r = alpha[:, None] - s  # [[-.4,0,.4],[.4,-.2,0],[-.3,.1,0]]
    b_hat = torch.tensor([-0.3, 0.0, 0.0], dtype=torch.float64)  # 2nd smallest of each column
    assert torch.allclose(r.sort(0).values[1], b_hat)
    assert torch.allclose(quantile_balance_exact(s, b, 1), b_hat - b_hat.mean())


def test_exact_update_balances_load():
    """After the update, expert loads under top-k of s + b are close to the target m k / n."""
    gen = torch.Generator().manual_seed(0)
    m, n, k = 4000, 16, 2
    skew = torch.linspace(-2, 2, n)
    s = torch.sigmoid(torch.randn(m, n, generator=gen) + skew)
    b = torch.zeros(n)
    before = torch.bincount(torch.topk(s + b, k).indices.flatten(), minlength=n).float()
    for _ in range(3):
        b = quantile_balance_exact(s, b, k)
    after = torch.bincount(torch.topk(s + b, k).indices.flatten(), minlength=n).float()
    target = m * k / n
    assert (before - target).abs().max() > 0.5 * target
    assert (after - target).abs().max() < 0.15 * target
    assert abs(float(b.mean())) < 1e-6


@pytest.mark.parametrize("m,n,bins", [(1, 4, 10), (37, 8, 1000), (300, 40, 1000)])
def test_histogram_kernel_vs_torch(triton_interpreter, device, m, n, bins):
    gen = torch.Generator().manual_seed(m)
    s = torch.sigmoid(torch.randn(m, n, generator=gen))
    b = torch.randn(n, generator=gen) * 0.3
    alpha = routing_threshold(s, b, 1)
    lo, hi = histogram_bounds(b)
    h_t = histogram_torch(s, alpha, lo, hi, bins)
    h_k = histogram_triton(s.to(device), alpha.to(device), lo, hi, bins).cpu()
    assert h_k.dtype == torch.int32 and h_k.shape == (n, bins)
    assert torch.equal(h_k, h_t)
    assert (h_k.sum(1) == m).all()
    # independent count of one expert by Python
    r = (alpha[:, None] - s)[:, 0].tolist()
    counts = [0] * bins
    for x in r:
        counts[min(bins - 1, max(0, math.floor((x - lo) * (bins / (hi - lo)))))] += 1
    assert h_k[0].tolist() == counts


def test_histogram_update_matches_exact(triton_interpreter, device):
    gen = torch.Generator().manual_seed(4)
    m, n, k = 512, 8, 2
    s = torch.sigmoid(torch.randn(m, n, generator=gen) + torch.linspace(-1, 1, n))
    b = torch.randn(n, generator=gen) * 0.05
    exact = quantile_balance_exact(s.double(), b.double(), k).float()
    lo, hi = histogram_bounds(b)
    width = (hi - lo) / 1000
    with use_backend("triton"):
        est = quantile_balance_update(s.to(device), b.to(device), k).cpu()
    with use_backend("torch"):
        est_t = quantile_balance_update(s, b, k)
    assert torch.equal(est, est_t)
    # before centring the estimate lies within a bin of the ceil(q)-th .. (ceil(q)+1)-th order
    # statistic of r; the exact form takes the (ceil(q)+1)-th; centring can double the gap
    alpha = routing_threshold(s.double(), b.double(), k)
    order = (alpha[:, None] - s.double()).sort(0).values
    t = math.ceil(m * k / n)
    gap = float((order[t] - order[t - 1]).max())
    assert (est - exact).abs().max() < 2 * (width + gap) + 1e-6
    assert abs(float(est.mean())) < 1e-6


def test_all_reduce_hook_sums_ranks():
    hist = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.int32)
    # two ranks with the same local histogram: summed counts give the oracle
    b = bias_from_histogram(hist * 2, -1.0, 1.0, k=1)
    assert torch.allclose(b, torch.tensor([0.25, -0.25]))
