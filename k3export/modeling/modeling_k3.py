# Copyright 2026 the k3export authors. Apache-2.0.
"""PyTorch Kimi K3 text model: the numerical source of truth of k3export.

    K3 = KDA (linear attention) + gated NoPE MLA + Stable LatentMoE (SiTU-GLU) + Attention Residuals

Read top to bottom, one section per concept (its ops in plain PyTorch, then its module): KDA, MLA, LatentMoE and
Attention Residuals, then the hybrid decode cache and the models. Parameter names are the released checkpoint's
minus the ``language_model.`` prefix. With the K3 additions switched off in the config this is Kimi-Linear
(checked against transformers' ``KimiLinearForCausalLM``).

This file is copied next to saved checkpoints (``trust_remote_code``) with ``configuration_k3.py``, ``contract.py``
and ``loading_k3.py`` (strict loading, other layouts through k3export's loader, as transformers keeps loading in
``modeling_utils``): it needs only torch and transformers, and never imports k3export. A `hookable` function is a
kernel hook: it is the reference, and a kernel plugged in under its name (`register_kernel`; ``k3export`` plugs
in ``k3export.ops.KERNELS``) runs instead wherever it does not decline.

Long file: one file for ``trust_remote_code`` (as transformers keeps a model): K3's maths, read top to bottom.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_k3 import K3Config
from .contract import FP32_PARAM_SUFFIXES, MLA_QUERY_BLOCK, StateSpec, cache_from_states, cache_to_states
from .loading_k3 import K3CheckpointError, K3LoadingMixin


# ============================================================================ kernel hooks


_KERNELS: dict[str, Callable[..., Any]] = {}


def register_kernel(name: str, kernel: Callable[..., Any] | None) -> None:
    """Plug `kernel` in for the op `name` (None unplugs it). It is called with the PyTorch function's arguments and
    returns ``NotImplemented`` to decline a call (wrong device, backend set to torch); the PyTorch function then runs."""
    if kernel is None:
        _KERNELS.pop(name, None)
    else:
        _KERNELS[name] = kernel


def hookable(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a PyTorch function as the fallback of the kernel op `name` (transformers' hub-kernel habit)."""

    def wrap(fallback: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fallback)
        def call(*args: Any, **kwargs: Any) -> Any:
            kernel = _KERNELS.get(name)
            out = NotImplemented if kernel is None else kernel(*args, **kwargs)
            return fallback(*args, **kwargs) if out is NotImplemented else out

        call.fallback = fallback  # type: ignore[attr-defined]
        return call

    return wrap


# ============================================================================ shared pieces


def fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` for the fp32 math: fp32, or float64 kept as is (a float64 model is a float64 reference)."""
    return x if x.dtype in _FP32_OR_64 else x.float()


_FP32_OR_64 = (torch.float32, torch.float64)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's convention, eps inside the root)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


@hookable("linears")
def linears(x: torch.Tensor, modules: Sequence[nn.Linear]) -> list[torch.Tensor]:
    """x through each linear of `modules`. One hook for the projections that read one input (KDA's q, k, v, f_a,
    b and g; MLA's q_a, kv_a and g; an MLP's gate and up), so that a kernel can read their weights as one."""
    return [F.linear(x, m.weight, m.bias) for m in modules]


class K3Linear(nn.Linear):
    """nn.Linear through the `linears` hook."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linears(x, (self,))[0]


@hookable("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim, with fp32 statistics."""
    dtype = x.dtype
    if dtype == weight.dtype == torch.float32:  # one call, rounding as below (w * (x * r) = (x * r) * w)
        return F.rms_norm(x, weight.shape, weight, eps)
    x = fp32(x)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class K3RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


# ============================================================================ KDA: Kimi Delta Attention


def kda_recurrent(q, k, v, g, beta, initial_state, scale: float):
    """KDA, one token at a time (decode path; also the readable definition).

    q, k [B,T,H,K] (L2-normalised), v [B,T,H,V], g [B,T,H,K] log-decay, beta [B,T,H], state [B,H,K,V] fp32.
    Per token: S = exp(g) * S;  S = S + beta * k (v - k^T S);  o = (scale q)^T S.
    Returns o [B,T,H,V] in q's dtype and the final state (fp32).
    """
    dtype = q.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # float64 in: a float64 reference out
    q, k, v, g, beta, state = (t if t.dtype is acc else t.to(acc) for t in (q, k, v, g, beta, initial_state))
    outputs = []
    for t in range(q.shape[1]):
        kt = k[:, t].unsqueeze(-2)  # [B,H,1,K]
        state = state * g[:, t].exp().unsqueeze(-1)
        kv_mem = kt @ state  # [B,H,1,V]
        delta = (v[:, t].unsqueeze(-2) - kv_mem) * beta[:, t, :, None, None]
        state = torch.addcmul(state, kt.transpose(-1, -2), delta)
        outputs.append((q[:, t].unsqueeze(-2) * scale) @ state)
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)  # [B,H,T,V]
    return o.transpose(1, 2).to(dtype), state


def kda_chunked(q, k, v, g, beta, initial_state, scale: float, chunk_size: int = 64):
    """KDA in chunked (parallel) form for prefill; same contract as `kda_recurrent`.

    Inside a chunk with cumulative log-decay G (G_i = sum_{t<=i} g_t) and state S at its start:
        A[i,j]  = beta_i sum_d k_i k_j exp(G_i - G_j)   (i > j)       T = (I + A)^-1 diag(beta)
        U = T V,  W = T (K * exp(G)),  V' = U - W S
        O = (Q * exp(G)) S + A_qk V'                     A_qk[i,j] = sum_d q_i k_j exp(G_i - G_j)  (i >= j)
        S <- exp(G_C) S + (K * exp(G_C - G))^T V'
    Only differences G_i - G_j (i >= j) are exponentiated, so nothing overflows however long the chunk.
    """
    dtype = q.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    B, T, H, K = k.shape
    V = v.shape[-1]
    # [B,H,T,D]; padding tokens get beta = 0 and g = 0, so they neither write nor decay the state.
    q, k, v, g = (t.to(acc).transpose(1, 2) for t in (q, k, v, g))
    beta = beta.to(acc).transpose(1, 2)
    pad = (-T) % chunk_size
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (T + pad) // chunk_size
    q, k, v, g = (t.reshape(B, H, n, chunk_size, -1) for t in (q, k, v, g))
    beta = beta.reshape(B, H, n, chunk_size)
    q = q * scale

    eye = torch.eye(chunk_size, device=q.device, dtype=acc)
    strict_lower = torch.ones(chunk_size, chunk_size, device=q.device, dtype=torch.bool).tril(-1)
    lower = strict_lower | eye.bool()
    state = initial_state.to(acc)
    outputs = []
    for c in range(n):
        qc, kc, vc, bc = q[:, :, c], k[:, :, c], v[:, :, c], beta[:, :, c]
        G = g[:, :, c].cumsum(-2)  # [B,H,C,K]
        diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~lower[..., None], float("-inf"))
        decay = diff.exp()  # [B,H,C,C,K], decay[i,j] = exp(G_i - G_j) for i >= j else 0
        A = torch.einsum("bhid,bhjd,bhijd->bhij", kc, kc, decay) * bc.unsqueeze(-1)
        A = A.masked_fill(~strict_lower, 0.0)
        rhs = torch.cat([vc, kc * G.exp()], dim=-1) * bc.unsqueeze(-1)
        UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        U, W = UW[..., :V], UW[..., V:]
        v_new = U - W @ state
        A_qk = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, decay)
        outputs.append((qc * G.exp()) @ state + A_qk @ v_new)
        G_last = G[:, :, -1:]  # [B,H,1,K]
        state = state * G_last.transpose(-1, -2).exp() + (kc * (G_last - G).exp()).transpose(-1, -2) @ v_new
    o = torch.cat(outputs, dim=2)[:, :, :T].transpose(1, 2)
    return o.to(dtype), state


@hookable("kda")
def kda(q, k, v, g, beta, initial_state, scale: float, chunk_size: int = 64):
    """KDA over any number of tokens: the recurrence for one token (decode), the chunked form for more (prefill).
    This is the one rule for which algorithm runs; a plugged-in kernel receives `chunk_size` and follows it."""
    if q.shape[1] == 1:
        return kda_recurrent(q, k, v, g, beta, initial_state, scale)
    return kda_chunked(q, k, v, g, beta, initial_state, scale, chunk_size)


def short_conv(weight: torch.Tensor, x: torch.Tensor, conv_state: torch.Tensor | None,
               mask: torch.Tensor | None = None):
    """Causal depthwise conv (weight [C, 1, kernel], C = 3*H*K for q|k|v) + SiLU over [conv_state | x];
    returns (y, new conv_state [B, C, kernel-1]).

    With `mask` [B, T] the new conv state is the window that ends at each row's last real token, so trailing
    padding (right padding, as onnxruntime-genai feeds a batch) leaves it as an unpadded run would."""
    B, T, C = x.shape
    km1 = weight.shape[-1] - 1
    if conv_state is None:
        conv_state = x.new_zeros(B, C, km1)
    full = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)
    if T == 1:  # decode: a dot product over the window per channel
        y = (fp32(full) * fp32(weight).view(C, -1)).sum(-1, keepdim=True)
    else:
        y = F.conv1d(fp32(full), fp32(weight), groups=C)
    if mask is None:
        return F.silu(y).transpose(1, 2).to(x.dtype), full[..., -km1:].contiguous()
    end = (mask.to(torch.long) * torch.arange(1, T + 1, device=x.device)).amax(dim=1)  # tokens up to the last real
    idx = (end[:, None] + torch.arange(km1, device=x.device))[:, None, :].expand(B, C, km1)
    return F.silu(y).transpose(1, 2).to(x.dtype), full.gather(-1, idx)


@hookable("kda_layer")
def kda_layer(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor | None, g: torch.Tensor,
              b: torch.Tensor, gate: torch.Tensor, state: torch.Tensor | None, o_norm: Callable[..., torch.Tensor],
              chunk_size: int = 64, mask: torch.Tensor | None = None):
    """KDA after its projections and forget gate: short conv + SiLU, L2-normed q and k, beta = sigmoid(b), the
    delta rule (`kda`), the per-head output norm gated by sigmoid(gate): one hook for ~30 small operators.

    qkv [B, T, 3*H*K] (q | k | v), conv_weight [3*H*K, 1, W], conv_state [B, 3*H*K, W-1] or None (zeros),
    g [B, T, H, K] fp32 log-decay, b [B, T, H], gate [B, T, H*K], state [B, H, K, K] fp32 or None (zeros),
    o_norm a `K3RMSNorm` over K, mask [B, T] or None. Returns (o [B, T, H, K] fp32, conv state, state).
    The k3 op of this name (`ops.spec.KDA_LAYER`, the export's) is this less beta's sigmoid, masks and output norm.
    """
    B, T, _ = qkv.shape
    H, K = g.shape[-2:]
    qkv, conv_state = short_conv(conv_weight, qkv, conv_state, mask)
    qkv = qkv.view(B, T, 3, H, K)
    q, k = l2norm(fp32(qkv[:, :, :2])).to(qkv.dtype).unbind(2)
    v = qkv[:, :, 2]
    beta = torch.sigmoid(fp32(b))
    if mask is not None:
        beta = beta * mask[..., None].to(beta.dtype)
        g = g * mask[..., None, None].to(g.dtype)
    if state is None:
        state = beta.new_zeros(B, H, K, K)
    o, state = kda(q, k, v, g, beta, state, K ** -0.5, chunk_size)
    return o_norm(fp32(o)) * torch.sigmoid(fp32(gate).view(B, T, H, K)), conv_state, state


class K3KimiDeltaAttention(nn.Module):
    """KDA: short convs + SiLU, L2-normed q/k, per-channel forget gate, delta rule, gated per-head output norm."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        lac = config.linear_attn_config
        self.num_heads, self.head_dim = config.kda_num_heads, config.kda_head_dim
        self.kernel_size = config.kda_conv_kernel
        self.gate_lower_bound = lac["gate_lower_bound"]
        self.chunk_size = config.kda_chunk_size
        d, hk = config.hidden_size, self.num_heads * self.head_dim
        self.q_proj = K3Linear(d, hk, bias=False)
        self.k_proj = K3Linear(d, hk, bias=False)
        self.v_proj = K3Linear(d, hk, bias=False)
        self.q_conv1d = nn.Conv1d(hk, hk, self.kernel_size, groups=hk, bias=False)
        self.k_conv1d = nn.Conv1d(hk, hk, self.kernel_size, groups=hk, bias=False)
        self.v_conv1d = nn.Conv1d(hk, hk, self.kernel_size, groups=hk, bias=False)
        self.f_a_proj = K3Linear(d, self.head_dim, bias=False)
        self.f_b_proj = K3Linear(self.head_dim, hk, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(hk, dtype=torch.float32))
        # K3 stores A_log padded to [max(H, head_dim)] (first H used); Kimi-Linear as [1, 1, H, 1].
        a_shape = (max(self.num_heads, self.head_dim),) if self.gate_lower_bound is not None else (1, 1, self.num_heads, 1)
        self.A_log = nn.Parameter(torch.zeros(a_shape, dtype=torch.float32))
        self.b_proj = K3Linear(d, self.num_heads, bias=False)
        if lac["use_full_rank_gate"]:
            self.g_proj = K3Linear(d, hk, bias=False)
        else:
            self.g_a_proj = K3Linear(d, self.head_dim, bias=False)
            self.g_b_proj = K3Linear(self.head_dim, hk, bias=False)
        self.x_projections = ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj",
                              "g_proj" if lac["use_full_rank_gate"] else "g_a_proj")
        self.o_norm = K3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = K3Linear(hk, d, bias=False)

    def forget_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """Per-head, per-key-channel log-decay g <= 0, fp32 [B, T, H, K], from f_a = f_a_proj(x)."""
        B, T, _ = f_a.shape
        f = fp32(self.f_b_proj(f_a)) + fp32(self.dt_bias)
        f = f.view(B, T, self.num_heads, self.head_dim)
        if self.gate_lower_bound is not None:  # K3: bounded sigmoid gate
            A = fp32(self.A_log)[: self.num_heads].exp().view(1, 1, -1, 1)
            return self.gate_lower_bound * torch.sigmoid(A * f)
        A = fp32(self.A_log).view(1, 1, -1, 1).exp()  # Kimi-Linear: softplus gate
        return -A * F.softplus(f)

    def forward(self, x: torch.Tensor, cache: K3Cache | None = None, attention_mask: torch.Tensor | None = None):
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        mask = attention_mask[:, -T:] if attention_mask is not None else None
        if mask is not None:  # padded positions leave the recurrence untouched: no input, no write, no decay
            x = x * mask[..., None].to(x.dtype)
        conv0, s0 = cache.kda_state(self.layer_idx) if cache is not None else (None, None)
        q, k, v, f_a, b, gate = linears(x, [self._modules[n] for n in self.x_projections])
        conv_weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        if not hasattr(self, "g_proj"):
            gate = self.g_b_proj(gate)
        o, conv_state, s1 = kda_layer(torch.cat([q, k, v], dim=-1), conv_weight, conv0, self.forget_gate(f_a), b,
                                      gate, s0, self.o_norm, self.chunk_size, mask)
        if cache is not None:
            cache.update_kda(self.layer_idx, conv_state, s1)
        return self.o_proj(o.reshape(B, T, H * K).to(x.dtype))


# ============================================================================ MLA: gated NoPE multi-head latent attention


class K3MLAttention(nn.Module):
    """Gated NoPE MLA over the compressed latent [c_kv | k_pe]: the 'rope' dims are never rotated."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk = config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = K3Linear(d, H * qk, bias=False)
        else:
            self.q_a_proj = K3Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = K3RMSNorm(config.q_lora_rank, eps=1e-6)
            self.q_b_proj = K3Linear(config.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = K3Linear(d, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = K3RMSNorm(config.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = K3Linear(config.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        if config.mla_use_output_gate:
            self.g_proj = K3Linear(d, H * self.v_dim, bias=False)
        self.o_proj = K3Linear(H * self.v_dim, d, bias=False)
        self.scaling = qk ** -0.5
        self.x_projections = ("q_proj" if config.q_lora_rank is None else "q_a_proj", "kv_a_proj_with_mqa",
                              *(("g_proj",) if config.mla_use_output_gate else ()))

    def forward(self, x: torch.Tensor, cache: K3Cache | None = None, attention_mask: torch.Tensor | None = None):
        B, T, _ = x.shape
        H = self.num_heads
        q, kv_a, *gate = linears(x, [self._modules[n] for n in self.x_projections])
        if self.config.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(B, T, H, -1).transpose(1, 2)  # [B,H,T,192]
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)  # [B,T,576]: what decode caches
        if cache is not None:
            latent = cache.update_mla(self.layer_idx, latent)
        if T == 1 and attention_mask is None and x.dtype == torch.float32:
            o = self.decode_absorbed(q, latent)
        else:
            o = self.attend(q, latent, x.dtype, attention_mask)
        o = o.transpose(1, 2).reshape(B, T, H * self.v_dim)
        if gate:
            o = (fp32(o) * torch.sigmoid(fp32(gate[0]))).to(x.dtype)
        return self.o_proj(o)

    def decode_absorbed(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """`attend` for one fp32 token, kv_b_proj absorbed (q_nope . W_uk c = (W_uk^T q_nope) . c, and W_uv
        applied after the sum over positions): no keys and values expanded from the latent each step."""
        H, r = self.num_heads, self.kv_lora_rank
        w = self.kv_b_proj.weight.float().reshape(H, self.nope_dim + self.v_dim, r)  # any storage a kernel keeps
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)  # [H, nope, r], [H, v, r]
        q = q.float()  # [B,H,1,nope+rope]
        q_lat = torch.cat([q[..., : self.nope_dim] @ w_uk, q[..., self.nope_dim:]], dim=-1)  # [B,H,1,r+rope]
        kv = latent.float()  # [B,S,r+rope]; the heads are the rows of one product per sequence, not a broadcast
        q_lat = q_lat.squeeze(2)  # [B,H,r+rope]  (a broadcast over H would copy the latent once per head)
        probs = torch.softmax((q_lat @ kv.transpose(-1, -2)) * self.scaling, dim=-1)  # [B,H,S]
        return ((probs @ kv[..., :r]).unsqueeze(2) @ w_uv.transpose(-1, -2)).to(latent.dtype)  # [B,H,1,v]

    def attend(self, q: torch.Tensor, latent: torch.Tensor, dtype: torch.dtype,
               attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of q [B,H,T,qk] over the latent [B,S,r+rope] expanded by kv_b_proj; o [B,H,T,v].
        At most `MLA_QUERY_BLOCK` queries at a time: the scores are [B,H,block,S], not [B,H,T,S]."""
        B, H, T, _ = q.shape
        S = latent.shape[1]
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(B, S, H, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_t = fp32(torch.cat([k_nope, k_pe[:, None].expand(B, H, S, self.rope_dim)], dim=-1)).transpose(-1, -2)
        v = fp32(v)
        keys = torch.arange(S, device=q.device)
        real = attention_mask[:, None, None, -S:].bool() if attention_mask is not None else None
        out = []
        for start in range(0, max(T, 1), MLA_QUERY_BLOCK):  # T = 0: one empty block
            qb = q[:, :, start:start + MLA_QUERY_BLOCK]
            rows = S - T + start + torch.arange(qb.shape[2], device=q.device)  # each query's position
            mask = (keys[None, :] <= rows[:, None])[None, None]
            if real is not None:
                mask = mask & real
            scores = (torch.matmul(fp32(qb), k_t) * self.scaling).masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked (padding) rows -> 0
            out.append(torch.matmul(probs, v))
        return (out[0] if len(out) == 1 else torch.cat(out, dim=2)).to(dtype)


# ============================================================================ Stable LatentMoE (SiTU-GLU experts)


@hookable("situ_glu")
def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """SiTU-GLU(g, u) = softcap(g, b1) * sigmoid(g) * softcap(u, b2), softcap(x, b) = b tanh(x / b); fp32 math."""
    g, u = fp32(gate), fp32(up)
    out = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))
    return out.to(gate.dtype)


def _activation(config: K3Config) -> tuple[str, float, float]:
    """(hidden_act, beta1, beta2), which modules read once: a transformers config attribute costs ~1.5 us."""
    return config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta


def _glu(act: tuple[str, float, float], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    name, beta1, beta2 = act
    return situ_glu(gate, up, beta1, beta2) if name == "situ" else F.silu(gate) * up


class K3MLP(nn.Module):
    """Gated MLP (dense FFN of the first layers, and the fused shared experts): SiTU-GLU in K3, SiLU-GLU in Kimi-Linear."""

    def __init__(self, config: K3Config, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.config = config
        self.act = _activation(config)
        self.gate_proj = K3Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = K3Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = K3Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_glu(self.act, *linears(x, (self.gate_proj, self.up_proj))))


@hookable("moe_route")
def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float):
    """Sigmoid router: select by scores + bias (ties: lower expert index first), weigh by unbiased scores.

    Returns (weights fp32 [N, top_k], indices int64 [N, top_k]) ordered by biased score, descending.
    """
    scores = torch.sigmoid(fp32(logits))
    order = torch.sort(scores + fp32(bias), dim=-1, descending=True, stable=True).indices
    indices = order[..., :top_k]
    weights = scores.gather(-1, indices)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, indices


class K3Router(nn.Module):
    """Sigmoid router with the (Quantile-Balancing) correction bias, used for selection only."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32),
                                                    requires_grad=False)
        self.rule = config.num_experts_per_token, config.moe_renormalize, config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(fp32(x), fp32(self.weight))
        return moe_route(logits, fp32(self.e_score_correction_bias), *self.rule)


def _grouped_linear(x: torch.Tensor, w: Any, offs: torch.Tensor) -> torch.Tensor:
    """Rows x[offs[e-1]:offs[e]] @ w[e]^T for every expert e: one grouped GEMM for a stacked w where torch has one,
    else one product per expert that has rows."""
    if (isinstance(w, torch.Tensor) and hasattr(F, "grouped_mm") and x.dtype in (torch.float32, torch.bfloat16)
            and x.shape[0] and all(n * x.element_size() % 16 == 0 for n in w.shape[1:])):  # grouped_mm's stride rule
        return F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    out, start = x.new_empty(x.shape[0], w[0].shape[0]), 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e].T
        start = end
    return out


@hookable("moe_experts")
def moe_experts(z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, act: str, beta1: float, beta2: float) -> torch.Tensor:
    """Routed experts: u[n] = sum_j weights[n, j] * E_{indices[n, j]}(z[n]), fp32 [N, D].

    z [N, D]; weights fp32 / indices int64 [N, top_k] (from `moe_route`); w1 = gate, w3 = up (E weights [I, D]),
    w2 = down (E weights [D, I]), each stacked [E, out, in] or one tensor per expert (`expert_weights`); act "situ"
    (SiTU-GLU with beta1, beta2) or "silu". The token-slots are sorted by expert and each expert's rows run as one
    product: each selected expert is read once per call, where it lies.
    """
    N, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    offs = torch.bincount(flat, minlength=len(w1)).cumsum(0).to(torch.int32)
    x = z[token]
    gate, up = _grouped_linear(x, w1, offs), _grouped_linear(x, w3, offs)
    h = situ_glu(gate, up, beta1, beta2) if act == "situ" else F.silu(gate) * up
    y = fp32(_grouped_linear(h, w2, offs)) * fp32(weights.reshape(-1)[order, None])
    return y.new_zeros(N, w2[0].shape[0]).index_add_(0, token, y)


@hookable("expert_weights")
def expert_weights(experts: nn.ModuleList) -> tuple[Any, Any, Any]:
    """(w1, w3, w2) of the routed experts, as `moe_experts` reads them: here each expert's own parameter (no copy).
    A kernel may hand them stacked [E, out, in] (`k3export.ops.expert_stacks` keeps the parameters as views)."""
    return tuple([getattr(e, w).weight for e in experts] for w in ("w1", "w3", "w2"))  # type: ignore[return-value]


class K3Expert(nn.Module):
    """One routed expert, E(z) = w2(act(w1 z, w3 z)); names as released (`experts.{e}.w1/w2/w3`)."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.config = config
        d, i = config.expert_input_size, config.moe_intermediate_size
        self.act = _activation(config)
        self.w1 = nn.Linear(d, i, bias=False)
        self.w2 = nn.Linear(i, d, bias=False)
        self.w3 = nn.Linear(d, i, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.w2(_glu(self.act, self.w1(z), self.w3(z)))


class K3SparseMoE(nn.Module):
    """Stable LatentMoE: y = W_up(RMSNorm(sum_j p_j E_j(W_down x))) + Shared(x).

    Without latent projections (Kimi-Linear) the experts read x directly and there is no norm.
    Parameters keep the checkpoint's per-expert names (`experts.{e}.w1`), which `expert_weights` hands over.
    """

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.config = config
        self.gate = K3Router(config)
        self.experts = nn.ModuleList([K3Expert(config) for _ in range(config.num_experts)])
        self.act = _activation(config)
        self.latent, self.shared = config.use_latent_moe, bool(config.num_shared_experts)
        self.latent_norm = self.latent and config.latent_moe_use_norm
        if self.latent:
            self.routed_expert_down_proj = K3Linear(config.hidden_size, config.routed_expert_hidden_size, bias=False)
            self.routed_expert_up_proj = K3Linear(config.routed_expert_hidden_size, config.hidden_size, bias=False)
        if self.latent_norm:
            self.routed_expert_norm = K3RMSNorm(config.routed_expert_hidden_size, config.rms_norm_eps)
        if self.shared:
            self.shared_experts = K3MLP(config, config.hidden_size,
                                        config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.gate(x)
        z = self.routed_expert_down_proj(x) if self.latent else x
        u = moe_experts(z, weights, indices, *expert_weights(self.experts), *self.act).to(x.dtype)
        if self.latent_norm:
            u = self.routed_expert_norm(u)
        if self.latent:
            u = self.routed_expert_up_proj(u)
        if self.shared:
            u = u + self.shared_experts(x)
        return u.reshape(shape)


# ============================================================================ Attention Residuals and the decoder layer


@hookable("attn_res_aggregate")
def attn_res_aggregate(sources: list[torch.Tensor], proj: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """Attention Residuals: softmax over depth of (gamma * w) . v_i / rms(v_i), then sum_i alpha_i v_i (raw v).

    sources: the stored block sums plus the running partial sum, each [B, T, d]; proj = w [1, d] (pseudo-query),
    norm = gamma [d] (key norm gain). Computed in fp32, returned in the sources' dtype.
    """
    values = fp32(torch.stack(sources))  # [S,B,T,d]
    # (gamma * w) . (v / rms(v)) = ((gamma * w) . v) / rms(v)
    logits = (values @ (fp32(norm) * fp32(proj).view(-1))) * torch.rsqrt(values.pow(2).mean(-1) + eps)  # [S,B,T]
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * values).sum(0).to(sources[-1].dtype)


class K3DecoderLayer(nn.Module):
    """Attention sublayer (KDA or MLA) then FFN sublayer (dense or MoE), both pre-norm; AttnRes parameters."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attn_type = config.attn_types[layer_idx]
        self.self_attn = (K3MLAttention if self.attn_type == "mla" else K3KimiDeltaAttention)(config, layer_idx)
        if config.mlp_types[layer_idx] == "dense":
            self.mlp = K3MLP(config, config.hidden_size, config.intermediate_size)
        else:
            self.block_sparse_moe = K3SparseMoE(config)
        self.input_layernorm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.use_attn_res:
            d = config.hidden_size
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.self_attention_res_norm = K3RMSNorm(d, config.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = K3RMSNorm(d, config.rms_norm_eps)

    def attention(self, x, cache, attention_mask):
        return self.self_attn(self.input_layernorm(x), cache=cache, attention_mask=attention_mask)

    def ffn(self, y):
        y = self.post_attention_layernorm(y)
        return self.mlp(y) if hasattr(self, "mlp") else self.block_sparse_moe(y)

    def aggregate(self, sources: list[torch.Tensor], which: str) -> torch.Tensor:
        proj, norm = getattr(self, f"{which}_res_proj"), getattr(self, f"{which}_res_norm")
        return attn_res_aggregate(sources, proj.weight, norm.weight, norm.variance_epsilon)


# ============================================================================ hybrid decode cache


class K3Cache:
    """Decode state of every layer, constant in length for KDA and growing for MLA.

    KDA layer: the short-conv inputs of q, k, v as one tensor [B, 3*H*K, kernel-1] and the recurrent state
    [B, H, K, V] fp32. MLA layer: the compressed latent [B, T_past, kv_lora_rank + rope]. `to_states` and
    `from_states` map it to and from the contract's named state tensors (``contract.state_specs``).
    """

    is_compileable = False
    is_croppable = False  # a recurrent state cannot be rolled back

    def __init__(self, config: K3Config) -> None:
        self.config = config
        self.conv_states: dict[int, torch.Tensor] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}
        self.latents: dict[int, torch.Tensor] = {}
        self.carried: dict[str, torch.Tensor] = {}  # contract states no layer updates, by name
        self._seen_tokens = 0

    def kda_state(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv state, recurrent state) of a KDA layer; (None, None) (zeros) before its first token."""
        return self.conv_states.get(layer_idx), self.recurrent_states.get(layer_idx)

    def update_kda(self, layer_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv_states[layer_idx] = conv
        self.recurrent_states[layer_idx] = recurrent

    def update_mla(self, layer_idx: int, latent: torch.Tensor) -> torch.Tensor:
        if layer_idx in self.latents:
            latent = torch.cat([self.latents[layer_idx], latent], dim=1)
        self.latents[layer_idx] = latent
        return latent

    def to_states(self, specs: list[StateSpec] | None = None) -> dict[str, torch.Tensor]:
        """{state name: tensor} in the contract's layout (`contract.cache_to_states`)."""
        return cache_to_states(self, specs)

    @classmethod
    def from_states(cls, config: K3Config, states: dict[str, torch.Tensor],
                    specs: list[StateSpec] | None = None) -> K3Cache:
        """The cache holding `states` (named as `to_states` names them); a missing state raises KeyError."""
        return cache_from_states(cls(config), states, specs)

    @property
    def is_linear(self) -> list[bool]:
        """Per layer, whether its state is constant in length (KDA); transformers' generate reads this."""
        return [t == "kda" for t in self.config.attn_types]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen_tokens

    def get_mask_sizes(self, *args: Any, **kwargs: Any):  # transformers' generate may ask; we build masks ourselves
        return self._seen_tokens, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for d in (self.conv_states, self.recurrent_states, self.latents):
            for i, t in d.items():
                d[i] = t.index_select(0, beam_idx.to(t.device))

    def bytes(self) -> int:
        tensors = [*self.conv_states.values(), *self.recurrent_states.values(), *self.latents.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


# ============================================================================ models


@dataclass
class K3ModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    cache: K3Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class K3CausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: K3Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class K3PreTrainedModel(PreTrainedModel):
    config_class = K3Config
    config: K3Config
    base_model_prefix = "model"
    _no_split_modules = ["K3DecoderLayer"]
    _keep_in_fp32_modules_strict = [s.removesuffix(".weight") for s in FP32_PARAM_SUFFIXES]
    _is_stateful = True
    _supports_cache_class = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
            module.weight.normal_(0.0, std)
        elif isinstance(module, K3RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, K3Router):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, K3KimiDeltaAttention):
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


class K3Model(K3PreTrainedModel):
    """The decoder stack: embeddings, layers with (block) Attention Residuals, final norm."""

    def __init__(self, config: K3Config) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([K3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.use_attn_res:
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
            self.output_attn_res_norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: K3Cache | None = None, inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, **kwargs: Any) -> K3ModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if cache is None and kwargs.get("past_key_values") is not None:
            cache = kwargs["past_key_values"]
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = K3Cache(self.config)
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: skip masking work
        hidden_states: list[torch.Tensor] = []

        if self.config.use_attn_res:
            block = self.config.attn_res_block_size
            prefix, bank = h, []
            for layer in self.layers:
                x = layer.aggregate(bank + [prefix], "self_attention") if bank else prefix
                if layer.layer_idx % block == 0:  # a new block starts from zero
                    bank.append(prefix)
                    prefix = layer.attention(x, cache, attention_mask)
                else:
                    prefix = prefix + layer.attention(x, cache, attention_mask)
                y = layer.aggregate(bank + [prefix], "mlp")
                prefix = prefix + layer.ffn(y)
                if output_hidden_states:  # the equivalent plain residual stream
                    hidden_states.append(torch.stack(bank + [prefix]).sum(0))
            h = attn_res_aggregate(bank + [prefix], self.output_attn_res_proj.weight,
                                   self.output_attn_res_norm.weight, self.output_attn_res_norm.variance_epsilon)
        else:
            for layer in self.layers:
                h = h + layer.attention(h, cache, attention_mask)
                h = h + layer.ffn(h)
                if output_hidden_states:
                    hidden_states.append(h)
        if cache is not None:
            cache._seen_tokens += h.shape[1]
        return K3ModelOutput(last_hidden_state=self.norm(h), cache=cache if use_cache else None,
                             hidden_states=tuple(hidden_states) if output_hidden_states else None)


class K3ForCausalLM(K3LoadingMixin, K3PreTrainedModel, GenerationMixin):
    """K3 with the LM head; `generate()` runs with the hybrid `K3Cache`, `from_pretrained` is `K3LoadingMixin`'s."""

    _tied_weights_keys: dict[str, str] = {}

    def __init__(self, config: K3Config) -> None:
        super().__init__(config)
        self.model = K3Model(config)
        self.lm_head = K3Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: K3Cache | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, logits_to_keep: int = 0, **kwargs: Any) -> K3CausalLMOutput:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, output_hidden_states=output_hidden_states, **kwargs)
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return K3CausalLMOutput(loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states)

    # -- generation: our hybrid cache instead of transformers' DynamicCache
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args: Any, **kwargs: Any) -> None:
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = K3Cache(self.config)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False


__all__ = [
    "K3Cache", "K3CheckpointError", "K3ForCausalLM", "K3Model", "K3PreTrainedModel", "attn_res_aggregate", "kda",
    "kda_chunked", "kda_recurrent", "l2norm", "moe_experts", "moe_route", "register_kernel", "situ_glu",
]

# save_pretrained writes `auto_map` and copies this file and the ones it imports next to the weights.
K3Config.register_for_auto_class()
K3Model.register_for_auto_class("AutoModel")
K3ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
