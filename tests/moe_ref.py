"""Float64 per-slot reference of the routed experts (shared by the modeling and ONNX tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
