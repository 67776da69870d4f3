"""Cases of the k3 library's fused ops (`k3export.ops.spec.FUSED_SPECS`), shared by the ONNX Runtime and OpenVINO
bindings' tests and the fused ops' function bodies' test: each returns the node's inputs ((name, array), in order),
its attributes and the expected outputs, the op's float64 naive reference (`k3export.ops.naive`)."""

from __future__ import annotations

import numpy as np
import torch

from k3export.ops import naive


def _f64(*arrays):
    return [torch.from_numpy(np.asarray(a)).double() for a in arrays]


def short_conv_case(T: int, masked: bool):
    """SiLU of the causal depthwise conv over [state | x], and the new state: the window of K - 1 rows from `start`
    (with a mask, row 1's last real token is its second: trailing padding leaves the state there). C = 37: a
    vector's tail."""
    rng = np.random.default_rng(T)
    B, C, K = 2, 37, 4
    state = rng.normal(size=(B, C, K - 1)).astype(np.float32)
    x = rng.normal(size=(B, T, C)).astype(np.float32)
    taps = rng.normal(size=(K, C)).astype(np.float32)
    start = np.array([T, min(2, T)], np.int64)
    inputs = [("state", state), ("x", x), ("taps", taps)] + ([("start", start)] if masked else [])
    y, present = naive.short_conv_naive(*_f64(state, x, taps), torch.from_numpy(start) if masked else None)
    return inputs, {}, [y.numpy(), present.numpy()]


def kda_layer_case(T: int, masked: bool, V: int = 6):
    """The short conv, then q and k (H heads of K) L2-normalised and v (H of V) split off each token's C = 2HK + HV
    values, then KDA from `initial_state`. V != K by default (the kernels take it; the kda function's chunked body
    does not), and C is not a whole number of vectors."""
    rng = np.random.default_rng(10 + T)
    B, H, K, W = 2, 2, 8, 4
    C = 2 * H * K + H * V
    state = rng.normal(size=(B, C, W - 1)).astype(np.float32)
    x = rng.normal(size=(B, T, C)).astype(np.float32)
    taps = rng.normal(size=(W, C)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (B, T, H, K)).astype(np.float32)
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    s0 = rng.normal(size=(B, H, K, V)).astype(np.float32)
    start = np.array([T, min(2, T)], np.int64)
    inputs = [("state", state), ("x", x), ("taps", taps), ("g", g), ("beta", beta), ("initial_state", s0)]
    attrs = {"scale": K ** -0.5, "epsilon": 1e-6}
    o, window, s1 = naive.kda_layer_naive(*_f64(state, x, taps, g, beta, s0),
                                               torch.from_numpy(start) if masked else None, **attrs)
    return inputs + ([("start", start)] if masked else []), attrs, [o.numpy(), window.numpy(), s1.numpy()]


def mla_attend_case(masked: bool, halves: bool = False, T: int = 4):
    """MLA's attention over the latents, weights absorbed: the causal mask alone ([T, S], fill -inf), or a padding
    mask per row ([B, 1, T, S], a finite fill, any_key zeroing a row that sees no key: row 1's first query, and
    row 0's first query sees only key 0 of a tile of 32). The latents as the transposed latents and their first Dc
    features, or (`halves`) as the cache's key / value halves (R odd: the value half ends in a pad, as the contract
    pads it); T > `kernels/mla_attend.h`'s kMlaRowQueries (4) reads the halves through a transposed copy, T <= 4 in place."""
    rng = np.random.default_rng(7)
    B, H, S, R, Dc = 2, 6, 41, 111, 100  # tails of a block of heads, of a tile of keys and of features, in each half
    q = rng.normal(size=(B, H, T, R)).astype(np.float32)
    lat = rng.normal(size=(B, S, R)).astype(np.float32)
    if halves:
        W = (R + 1) // 2
        padded = np.concatenate([lat, np.full((B, S, 2 * W - R), 9.0, np.float32)], axis=-1)[:, None]
        latents = [("key", padded[..., :W].copy()), ("value", padded[..., W:].copy())]
        attrs = {"halves": 1, "value_dim": Dc}
    else:
        latents = [("lat_t", lat.transpose(0, 2, 1)[:, None].copy()), ("c", lat[:, None, :, :Dc].copy())]
        attrs = {"halves": 0, "value_dim": 0}
    causal = np.arange(S)[None] <= np.arange(S - T, S)[:, None]                       # [T, S]
    if masked:
        keys = np.ones((B, S), bool)
        keys[1, :7] = False                                                             # row 1: left padding
        visible = causal[None, None] & keys[:, None, None]                             # [B, 1, T, S]
        visible[1, 0, 0] = False                                                       # a query that sees no key
        visible[0, 0, 0, 1:] = False
        any_key = visible.any(-1, keepdims=True).astype(np.float32)
        fill = float(np.finfo(np.float32).min)
    else:
        visible, any_key, fill = causal, None, float("-inf")
    inputs = [("q", q), *latents, ("visible", visible)] + ([("any_key", any_key)] if masked else [])
    attrs = {"scale": 0.3, "fill": fill, **attrs}
    args = _f64(*(a for _, a in inputs[:3])) + [torch.from_numpy(visible)] + _f64(*(a for _, a in inputs[4:]))
    return inputs, attrs, [naive.mla_attend_naive(*args, **attrs).numpy()]


def attn_res_aggregate_case(S: int, rows: int):
    """The Attention-Residuals aggregate (modeling_k3.attn_res_aggregate) over S sources [rows, D], with the key
    norm's gain times the pseudo-query (gw) as the fused node takes it: softmax over depth of gw . v_s / rms(v_s),
    then the weighted sum of the raw v_s, in float64."""
    rng = np.random.default_rng(S)
    D, eps = 48, 1e-5
    sources = [rng.normal(0, 3, (rows, D)).astype(np.float32) for _ in range(S)]
    gw = (rng.normal(size=D) * rng.normal(size=D)).astype(np.float32)
    out = naive.attn_res_aggregate_naive(*_f64(gw, *sources), epsilon=eps)
    return [("gw", gw)] + [(f"v{i}", a) for i, a in enumerate(sources)], {"epsilon": eps}, [out.numpy()]


def aggregate_atol(inputs) -> float:
    """fp32 rounding of the aggregate's S-term sum, at the sources' size."""
    S = len(inputs) - 1
    return max(S * 2.0**-24 * max(np.abs(a).max() for _, a in inputs), 2e-6)


def l2_norm_case(rows: int, n: int):
    """KDA's q / k L2 normalisation (modeling_k3.l2norm) over the last axis of [2, rows, n]: x / sqrt(sum(x^2) +
    eps), in float64; one row all zeros (the eps alone under the root)."""
    x = np.random.default_rng(rows).normal(0, 2, (2, rows, n)).astype(np.float32)
    x[1, 0] = 0
    return [("x", x)], {"epsilon": 1e-6}, [naive.l2_norm_naive(*_f64(x), 1e-6).numpy()]


def moe_route_experts_case(mxfp4: bool, N: int = 5):
    """The sigmoid router (top-3 of sigmoid(logits) + bias, weighed by the unbiased sigmoids renormalised, times
    2.5) and the routed SiTU-GLU experts on its slots; dense fp32 or MXFP4 experts (packed E2M1 bytes and E8M0
    scales, uint8). E = 9 experts, D = 64, I = 32."""
    from moe_ref import dense_case, mxfp4_case

    E, D, I, top_k = 9, 64, 32, 3
    rng = np.random.default_rng(20 + N + mxfp4)
    logits = rng.normal(0, 2, (N, E)).astype(np.float32)
    bias = (rng.normal(size=E) * 0.5).astype(np.float32)
    case = (mxfp4_case if mxfp4 else dense_case)(N, top_k, E, D, I, N)
    inputs = [("logits", logits), ("bias", bias)] + [(k, v) for k, v in case.items() if k not in ("weights", "indices")]
    attrs = {"top_k": top_k, "renormalize": 1, "scale": 2.5, "act": "situ", "beta1": 4.0, "beta2": 25.0}
    args = [torch.from_numpy(a) if a.dtype == np.uint8 else torch.from_numpy(a).double() for _, a in inputs]
    return inputs, attrs, [naive.moe_route_experts_naive(*args, **attrs).numpy()]
