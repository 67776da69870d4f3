"""Float64 per-slot reference of the routed experts (shared by the modeling and ONNX tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_moe(seed: int, tokens: int, E: int, D: int, I: int, k: int):
    """(z [tokens, D], weights [tokens, k], indices [tokens, k] of distinct experts, w1, w3 [E, I, D], w2 [E, D, I])."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, D, generator=gen)
    w1, w3 = torch.randn(E, I, D, generator=gen) / 3, torch.randn(E, I, D, generator=gen) / 3
    w2 = torch.randn(E, D, I, generator=gen) / 3
    indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    return z, torch.rand(tokens, k, generator=gen), indices, w1, w3, w2


def per_slot_reference(z, weights, indices, w1, w3, w2, act, b1, b2):
    """Each token-slot through its own expert, in float64: the definition, with no grouping."""
    z, w1, w3, w2 = (t.double() for t in (z, w1, w3, w2))
    u = torch.zeros(z.shape[0], w2.shape[1], dtype=torch.float64)
    for n in range(indices.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[n, j])
            g, up = w1[e] @ z[n], w3[e] @ z[n]
            if act == "situ":
                h = b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(up / b2))
            else:
                h = F.silu(g) * up
            u[n] += float(weights[n, j]) * (w2[e] @ h)
    return u
