"""Naive references of the k3 ops, in plain PyTorch (this module imports nothing but torch).

Written for reading, computed in float64 by default: the independent references the Triton kernels are tested
against. In float32 they are also the ops' torch backend. `mxfp4_dequant_naive` decodes compressed-tensors' MXFP4
bytes (bit-identical to ``k3export.converters.checkpoints.mxfp4.decode_mxfp4``, which ops may not import).
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


def q8_round_naive(x, block: int = 32):
    """x [..., n] (n a multiple of `block`) rounded to int8 per `block` features, in float64: d = max|x| / 127 in
    fp32, q = round(x / d) with the quotient in fp32 and ties to even (ONNX QuantizeLinear's), returned as d * q;
    an all-zero block stays zero."""
    xb = x.to(torch.float32).reshape(*x.shape[:-1], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d == 0, torch.zeros_like(xb), torch.round(xb / torch.where(d == 0, torch.ones_like(d), d)))
    return (q.to(torch.float64) * d.to(torch.float64)).reshape(x.shape)


def moe_experts_naive(z, weights, indices, w1, w3, w2, act: str, beta1: float, beta2: float, *,
                      dtype: torch.dtype = torch.float64, quantize_activations: bool = False):
    """Routed experts in `dtype`, expert by expert: u[n] = sum_j weights[n, j] W2[e] act(W1[e] z[n], W3[e] z[n]) with
    e = indices[n, j]; act "situ" = SiTU-GLU(beta1, beta2), "silu" = silu(gate) * up. Each selected expert runs once
    on all the token-slots that chose it. `quantize_activations`: z and the hidden activation each rounded by
    `q8_round_naive` before their products (the MXFP4 kernel's int8 activations).

    z [N, D]; weights / indices [N, top_k]; w1, w3 [E, I, D]; w2 [E, D, I]. Returns u [N, D] in fp32, or float64
    when z and `dtype` are float64."""
    rounded = q8_round_naive if quantize_activations else (lambda t: t)
    N, k = indices.shape
    flat = indices.reshape(-1)
    token = torch.arange(N * k, device=z.device) // k
    slot_w = weights.reshape(-1).to(dtype)
    zf = rounded(z).to(dtype)
    u = torch.zeros(N, w2.shape[1], dtype=dtype, device=z.device)
    for e in torch.unique(flat).tolist():
        sel = flat == e
        x = zf[token[sel]]
        g, up = x @ w1[e].to(dtype).T, x @ w3[e].to(dtype).T
        if act == "situ":
            h = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * (beta2 * torch.tanh(up / beta2))
        else:
            h = g * torch.sigmoid(g) * up
        u.index_add_(0, token[sel], (rounded(h).to(dtype) @ w2[e].to(dtype).T) * slot_w[sel, None])
    return u.to(torch.float64 if dtype == z.dtype == torch.float64 else torch.float32)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of an E2M1 nibble's bits 0-2 (bit 3: sign)


def mxfp4_dequant_naive(packed, scale, dtype: torch.dtype = torch.float32, group_size: int = 32):
    """MXFP4 (compressed-tensors' ``mxfp4-pack-quantized``) to `dtype`: packed uint8 [..., out, in/2] holds element
    2j in the low nibble of byte j, scale uint8 [..., out, in/group_size] is E8M0, 2^(byte - 127) (255 -> inf).
    Every value is exact in fp32 (and in bfloat16); returns [..., out, in]."""
    p = packed.to(torch.int32)
    nib = torch.stack([p & 15, p >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[nib & 7]
    val = torch.where(nib >= 8, -mag, mag)
    s = scale.to(torch.int32)
    s = torch.where(s == 0, torch.tensor(2.0**-127, device=s.device), (s << 23).view(torch.float32))
    return (val * s.repeat_interleave(group_size, dim=-1)).to(dtype)


def nvfp4_dequant_naive(packed, scale, scale_2, dtype: torch.dtype = torch.float64):
    """NVFP4 (NVIDIA Model-Optimizer) to `dtype`: packed uint8 [..., out, in/2] as MXFP4's (element 2j in the low
    nibble), scale float8_e4m3fn [..., out, in/16], scale_2 fp32 with one value per leading index ([...] or a
    scalar): e2m1 * float(scale) * scale_2, computed in float64 (exact) then cast. Returns [..., out, in]."""
    p = packed.to(torch.int32)
    nib = torch.stack([p & 15, p >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)[nib & 7]
    val = torch.where(nib >= 8, -mag, mag)
    s = scale.to(torch.float64).repeat_interleave(16, dim=-1)
    s2 = scale_2.to(torch.float64).reshape(*scale_2.shape, *([1] * (packed.dim() - scale_2.dim())))
    return (val * s * s2).to(dtype)


def moe_experts_nvfp4_naive(z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, w1_scale_2, w3_scale_2,
                            w2_scale_2, act: str, beta1: float, beta2: float, *, dtype: torch.dtype = torch.float64):
    """`moe_experts_naive` on NVFP4 experts (`spec.MOE_EXPERTS_NVFP4`: packed w1, w3 [E, I, D/2], w2 [E, D, I/2],
    E4M3 scales per 16, fp32 scale_2 [E]), dequantised in float64 with `nvfp4_dequant_naive`."""
    deq = [nvfp4_dequant_naive(w, s, s2) for w, s, s2 in ((w1, w1_scale, w1_scale_2), (w3, w3_scale, w3_scale_2),
                                                             (w2, w2_scale, w2_scale_2))]
    return moe_experts_naive(z, weights, indices, *deq, act, beta1, beta2, dtype=dtype)


def moe_experts_mxfp4_naive(z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, act: str, beta1: float,
                            beta2: float, *, dtype: torch.dtype = torch.float64, quantize_activations: bool = False):
    """`moe_experts_naive` on MXFP4 experts (packed w1, w3 [E, I, D/2], w2 [E, D, I/2], E8M0 scales), dequantised
    with `mxfp4_dequant_naive`; `quantize_activations`: the activations rounded to int8 per 32 features
    (`spec.MXFP4_QUANTIZE_ACTIVATIONS`)."""
    deq = [mxfp4_dequant_naive(w, s) for w, s in ((w1, w1_scale), (w3, w3_scale), (w2, w2_scale))]
    return moe_experts_naive(z, weights, indices, *deq, act, beta1, beta2, dtype=dtype,
                             quantize_activations=quantize_activations)


# -- the fused ops (`spec.FUSED_SPECS`): what each computes, in `dtype`, from the references above


def l2_norm_naive(x, epsilon: float, *, dtype: torch.dtype = torch.float64):
    """x / sqrt(sum(x^2) + epsilon) over the last axis, in `dtype`."""
    xf = x.to(dtype)
    return xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + epsilon)


def short_conv_naive(state, x, taps, start=None, *, dtype: torch.dtype = torch.float64):
    """KDA's short convolution: full = [stateᵀ | x] ([B, W-1+T, C]), y_t = silu(sum_j taps_j full_{t+j}) and the new
    state, the W - 1 rows of full from row start[b] (None: the last W - 1), transposed. state [B, C, W-1]; x
    [B, T, C]; taps [W, C]. Returns (y [B, T, C], present [B, C, W-1]) in `dtype`."""
    (B, T, _), W = x.shape, taps.shape[0]
    full = torch.cat([state.to(dtype).transpose(1, 2), x.to(dtype)], dim=1)
    conv = sum(taps[j].to(dtype) * full[:, j:j + T] for j in range(W))
    ends = [T] * B if start is None else [int(s) for s in start]
    present = torch.stack([full[b, ends[b]:ends[b] + W - 1].T for b in range(B)])
    return conv * torch.sigmoid(conv), present


def kda_layer_naive(state, x, taps, g, beta, initial_state, start=None, *, scale: float, epsilon: float,
                         dtype: torch.dtype = torch.float64):
    """KDA's stateful core: `short_conv_naive`, its output split into q, k (H heads of K: g [B, T, H, K]) and v (H
    of V: initial_state [B, H, K, V]), q and k through `l2_norm_naive`, then `kda_naive` from initial_state.
    Returns (o [B, T, H, V], present, final_state) in `dtype`."""
    B, T, H, K = g.shape
    V = initial_state.shape[-1]
    y, present = short_conv_naive(state, x, taps, start, dtype=dtype)
    q, k, v = (y[..., a:b].reshape(B, T, H, -1) for a, b in ((0, H * K), (H * K, 2 * H * K), (2 * H * K, None)))
    assert v.shape[-1] == V
    q, k = l2_norm_naive(q, epsilon, dtype=dtype), l2_norm_naive(k, epsilon, dtype=dtype)
    o, final = kda_naive(q, k, v, g.to(dtype), beta.to(dtype), initial_state.to(dtype), scale, dtype=dtype)
    return o, present, final


def attn_res_aggregate_naive(weight, *sources, epsilon: float, dtype: torch.dtype = torch.float64):
    """Attention Residuals over depth (`modeling_k3.attn_res_aggregate` with the key norm's gain times the
    pseudo-query as `weight` [D]): per row, alpha = softmax over the S sources [..., D] of (weight . v_s) / rms(v_s)
    (rms = sqrt(mean(v_s^2) + epsilon)), out = sum_s alpha_s v_s, in `dtype`."""
    v = torch.stack([s.to(dtype) for s in sources])                                      # [S, ..., D]
    logits = (v @ weight.to(dtype)) / torch.sqrt((v * v).mean(-1) + epsilon)            # [S, ...]
    alpha = torch.softmax(logits, dim=0)
    return (alpha[..., None] * v).sum(0)


def mla_attend_naive(q, lat_t, c, visible, any_key=None, *, scale: float, fill: float, halves: int = 0,
                     value_dim: int = 0, dtype: torch.dtype = torch.float64):
    """MLA's absorbed attention: p = softmax over the S keys of scale q . latent_s where `visible`, `fill` elsewhere,
    times any_key when given; out = sum_s p_s latent_s[:Dc]. q [B, H, T, R]; latents as lat_t [B, 1, R, S] and c
    [B, 1, S, Dc], or (halves) the cache's key / value halves [B, 1, S, W] whose join latent_s = key_s ++ value_s
    holds R <= 2W features, Dc = value_dim; visible [T, S] or [B, 1, T, S]; any_key [B, 1, T, 1]. Returns
    [B, H, T, Dc] in `dtype`."""
    R = q.shape[-1]
    if halves:
        lat = torch.cat([lat_t, c], dim=-1)[..., :R].to(dtype)                            # [B, 1, S, R]
        keys, values = lat.transpose(-1, -2), lat[..., :value_dim]
    else:
        keys, values = lat_t.to(dtype), c.to(dtype)
    scores = (q.to(dtype) @ keys) * scale                                                # [B, H, T, S]
    scores = torch.where(visible.to(torch.bool), scores, torch.tensor(fill, dtype=dtype))
    p = torch.softmax(scores, dim=-1)
    if any_key is not None:
        p = p * any_key.to(dtype)
    return p @ values


def moe_route_experts_naive(logits, bias, z, w1, w3, w2, *scales, top_k: int, renormalize: int, scale: float,
                            act: str, beta1: float, beta2: float, dtype: torch.dtype = torch.float64):
    """`moe_route_naive`, then the routed experts on its slots: `moe_experts_naive`, or with MXFP4 `scales`
    (w1_scale, w3_scale, w2_scale) `moe_experts_mxfp4_naive`."""
    weights, indices = moe_route_naive(logits, bias, top_k, bool(renormalize), scale)
    if scales:
        return moe_experts_mxfp4_naive(z, weights, indices, w1, w3, w2, *scales, act, beta1, beta2, dtype=dtype)
    return moe_experts_naive(z, weights, indices, w1, w3, w2, act, beta1, beta2, dtype=dtype)


#: the naive reference of each fused op (`spec.FUSED_SPECS`)
FUSED_NAIVE = {"attn_res_aggregate": attn_res_aggregate_naive, "mla_attend": mla_attend_naive,
               "short_conv": short_conv_naive, "l2_norm": l2_norm_naive, "kda_layer": kda_layer_naive,
               "moe_route_experts": moe_route_experts_naive, "moe_route_experts_mxfp4": moe_route_experts_naive}
