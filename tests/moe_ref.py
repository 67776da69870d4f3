"""Float64 per-slot reference of the routed experts (shared by the modeling and ONNX tests)."""

from __future__ import annotations

import numpy as np
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


#: E2M1's 16 codes (MXFP4 elements)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_f64(packed, scale):
    """MXFP4 bytes (numpy uint8 [..., n/2], element 2j in the low nibble of byte j) and E8M0 scales ([..., n/32],
    2^(byte - 127)) as float64 [..., n]."""
    nib = np.stack([packed & 15, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    return np.asarray(E2M1)[nib] * np.repeat(np.exp2(scale.astype(np.float64) - 127), 32, axis=-1)


def q8_f64(x):
    """x (numpy [..., n], n a multiple of 32) rounded to int8 per 32 features as the MXFP4 kernel's
    ``quantize_activations`` does: d = max|x| / 127 in fp32, q = round(x / d) (fp32 quotient, ties to even),
    returned as d * q in float64 (an all-zero block stays zero)."""
    xb = np.asarray(x, np.float32).reshape(*np.shape(x)[:-1], -1, 32)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(d == 0, 0, np.rint(xb / d))
    return (q * d.astype(np.float64)).reshape(np.shape(x))


def q8_experts_f64(z, weights, idx, w1, w3, w2, act, b1=4.0, b2=25.0):
    """Each token-slot through its own expert in float64, z and the hidden activation rounded by `q8_f64` (the
    hidden one from its fp32 value, as the kernel holds it): float64 [N, D]."""
    zq = q8_f64(z)
    u = np.zeros((z.shape[0], w2.shape[1]))
    for n in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            g, up = w1[e] @ zq[n], w3[e] @ zq[n]
            if act == "situ":
                h = b1 * np.tanh(g / b1) / (1 + np.exp(-g)) * (b2 * np.tanh(up / b2))
            else:
                h = g / (1 + np.exp(-g)) * up
            u[n] += float(weights[n, j]) * (w2[e] @ q8_f64(h))
    return u


def experts_f64(z, weights, idx, w1, w3, w2, act):
    """`per_slot_reference` on numpy arrays, SiTU-GLU's betas 4 and 25: float64 [N, D]."""
    return per_slot_reference(*(torch.as_tensor(a) for a in (z, weights, idx, w1, w3, w2)), act, 4.0, 25.0).numpy()


def routing(rng, N: int, top_k: int, E: int):
    """(weights [N, top_k] fp32, indices [N, top_k] int64): experts 0 and E - 1 chosen by no token."""
    idx = np.stack([rng.choice(np.arange(1, E - 1), top_k, replace=False) for _ in range(N)]).astype(np.int64)
    return rng.uniform(0.1, 1, (N, top_k)).astype(np.float32), idx


def dense_case(N: int, top_k: int, E: int, D: int, I: int, seed: int) -> dict:
    """The inputs of a dense ``k3::moe_experts`` call (numpy, fp32), by input name."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 2, (N, D)).astype(np.float32)
    weights, idx = routing(rng, N, top_k, E)
    w1, w3 = (rng.normal(0, 0.5, (E, I, D)).astype(np.float32) for _ in range(2))
    w2 = rng.normal(0, 0.5, (E, D, I)).astype(np.float32)
    return dict(z=z, weights=weights, indices=idx, w1=w1, w3=w3, w2=w2)


def mxfp4_case(N: int, top_k: int, E: int, D: int, I: int, seed: int) -> dict:
    """The inputs of an MXFP4 ``k3::moe_experts`` call: packed E2M1 bytes and E8M0 scales (uint8), by input name."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 2, (N, D)).astype(np.float32)
    weights, idx = routing(rng, N, top_k, E)
    packed = [rng.integers(0, 256, (E, r, c // 2), dtype=np.uint8) for r, c in ((I, D), (I, D), (D, I))]
    scales = [rng.integers(118, 130, (E, r, c // 32), dtype=np.uint8) for r, c in ((I, D), (I, D), (D, I))]
    return dict(z=z, weights=weights, indices=idx, w1=packed[0], w3=packed[1], w2=packed[2], w1_scale=scales[0],
                w3_scale=scales[1], w2_scale=scales[2])
