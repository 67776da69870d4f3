"""`moe_experts` (grouped by expert) against a float64 per-slot reference, on stacked weights and on one tensor per
expert. The stacks that k3export's kernels keep are tested in tests/ops/test_expert_stacks.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3export.modeling import modeling_k3 as mk
from moe_ref import per_slot_reference


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("stacked", [True, False])
def test_moe_experts_matches_per_slot_float64(act, tokens, grouped, stacked, monkeypatch):
    if not grouped:  # the loop fallback of torch builds without grouped_mm
        monkeypatch.delattr(F, "grouped_mm", raising=False)
    gen = torch.Generator().manual_seed(tokens)
    E, D, I, k = 6, 12, 8, 3  # 16-byte aligned rows (grouped_mm)
    z = torch.randn(tokens, D, generator=gen)
    w1, w3 = torch.randn(E, I, D, generator=gen) / 3, torch.randn(E, I, D, generator=gen) / 3
    w2 = torch.randn(E, D, I, generator=gen) / 3
    indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    ws = (w1, w3, w2) if stacked else ([*w1], [*w3], [*w2])  # stacks, or one tensor per expert (`expert_weights`)
    got = mk.moe_experts.fallback(z, weights, indices, *ws, act, 4.0, 25.0)
    ref = per_slot_reference(z, weights, indices, w1, w3, w2, act, 4.0, 25.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5)
