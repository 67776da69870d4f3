"""Naive references of the k3 ops, in plain PyTorch (this module imports nothing but torch).

Written for reading, computed in float64 by default: the independent references the Triton kernels are tested
against. In float32 they are also the ops' torch backend.
"""

from __future__ import annotations

import torch


def kda_naive(q, k, v, g, beta, initial_state, scale: float, *, dtype: torch.dtype = torch.float64):
    """KDA token by token in `dtype`: S = exp(g_t) S;  S += beta_t k_t (v_t - k_tᵀ S)ᵀ;  o_t = (scale q_t)ᵀ S.

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K]; beta [B, T, H]; initial_state [B, H, K, V].
    Returns (o [B, T, H, V] in q's dtype, final state in fp32, or float64 when q and `dtype` are float64).
    """
    B, T, H, _ = q.shape
    qf = q.to(dtype) * scale
    kf, vf, gf, bf = k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype)
    S = initial_state.to(dtype)
    o = torch.empty(B, T, H, v.shape[-1], dtype=dtype, device=q.device)
    for t in range(T):
        S = S * gf[:, t].exp()[..., None]
        kt = kf[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt * bf[:, t][..., None], vf[:, t] - pred)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", qf[:, t], S)
    state_dtype = torch.float64 if dtype == q.dtype == torch.float64 else torch.float32
    return o.to(q.dtype), S.to(state_dtype)


def situ_glu_naive(gate, up, beta1: float, beta2: float, *, dtype: torch.dtype = torch.float64):
    """SiTU-GLU(g, u) = beta1 tanh(g / beta1) sigmoid(g) * beta2 tanh(u / beta2), in `dtype`, returned in gate's."""
    g, u = gate.to(dtype), up.to(dtype)
    return (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))).to(gate.dtype)


def moe_route_naive(logits, bias, top_k: int, renormalize: bool, scale: float):
    """Sigmoid router in fp32: select by a stable descending sort of sigmoid(logits) + bias (ties: lower index),
    weigh by the unbiased scores (/ (sum + 1e-20) when renormalize), times scale.
    Returns (weights fp32 [N, top_k], indices int64 [N, top_k])."""
    s = torch.sigmoid(logits.float())
    order = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices[..., :top_k]
    w = torch.gather(s, -1, order)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, order
