"""Helpers shared by the ops tests: random inputs and error metrics."""

import torch


def rms_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.double()
    ref = ref.double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max()) if x.numel() else 0.0


def kda_inputs(B, T, H, K, V, *, dtype=torch.float32, state="nonzero", seed=0, gate="k3", device="cpu"):
    """L2-normalised q, k; K3-style bounded gate g = -5 sigmoid(.) (or 'strong': down to -30)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    if gate == "k3":
        g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) - 2.0)
    else:
        g = -30.0 * torch.rand(B, T, H, K, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen) if state == "nonzero" else torch.zeros(B, H, K, V)
    out = dict(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.float(), beta=beta, initial_state=h0.float()
    )
    return {n: t.to(device) for n, t in out.items()}
