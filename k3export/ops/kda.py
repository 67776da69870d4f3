"""k3::kda - Kimi Delta Attention core (gated delta rule with per-key-channel decay).

Per batch b, head h and token t, with the state S [K, V] kept in fp32:

    S = exp(g_t)[:, None] * S                  # decay rows (per key channel), g_t <= 0
    S = S + beta_t * k_t (v_t - k_tᵀ S)ᵀ       # delta-rule write
    o_t = (scale * q_t)ᵀ S                     # read after the write

Layouts: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] fp32; beta [B, T, H];
initial_state [B, H, K, V] fp32. Returns (o [B, T, H, V] in q's dtype, final_state fp32).
q and k arrive L2-normalised; q is NOT yet scaled (the op multiplies by ``scale``).

Implementations in this file:
* ``kda_naive``        token-by-token reference (float64 by default): the independent reference.
* the torch backend is the modeling file's ``kda_recurrent`` / ``kda_chunked`` (the source of truth).
* ``kda_recurrent_triton`` / ``kda_recurrent_kernel``  fused recurrent Triton kernel (decode).
* ``kda_chunk_triton`` / ``kda_chunk_kernel``          chunked Triton kernel (prefill).
* ``torch.ops.k3.kda``  the registered op: backend switch, recurrent for short T, chunked else.

Chunked form (chunk C, Γ = inclusive cumulative sum of g inside the chunk):
    M[i, j]  = beta_i Σ_c k_ic k_jc e^{Γ_ic - Γ_jc}   (i > j)
    A_qk[i,j]= Σ_c q_ic k_jc e^{Γ_ic - Γ_jc}          (i >= j)
    W = (I + M)^-1 (beta ⊙ K ⊙ e^Γ),  U = (I + M)^-1 (beta ⊙ V)
    V' = U - W S;  O = (Q ⊙ e^Γ) S + A_qk V';  S <- e^{Γ_C} ⊙ S + (K ⊙ e^{Γ_C - Γ})ᵀ V'
The pairwise factors e^{Γ_i - Γ_j} are never formed as e^{Γ_i} * e^{-Γ_j} over a whole chunk
(e^{-Γ} overflows fp32 once a chunk's decay sum passes -88): rows are split in sub-blocks of 16;
a row block b talks to earlier columns through the reference Γ_ref = Γ at row 16b - 1, so both
factors e^{Γ_i - Γ_ref} and e^{Γ_ref - Γ_j} are <= 1; inside a diagonal sub-block the exponent
Γ_i - Γ_j is formed per pair (exact, no overflow for any gate magnitude).
"""

from __future__ import annotations

import math

import torch

from k3export.modeling.modeling_k3 import kda_chunked, kda_recurrent
from k3export.ops import backend as _backend
from k3export.ops._common import (
    FLOAT_DTYPES,
    OpInputError,
    check_dtype,
    check_rank,
    check_same_device,
    check_shape,
    next_pow2,
)

try:  # Triton is optional: the torch path works without it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

CHUNK = 64  # chunk length of the chunked (prefill) form
SUB = 16  # sub-block length used to split exponentials inside a chunk
RECURRENT_MAX_T = 32  # the op uses the recurrent kernel up to this many tokens, chunked above
MAX_HEAD_DIM = 256


# ---------------------------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------------------------
def check_kda_inputs(q, k, v, g, beta, initial_state) -> None:
    """Raise OpInputError (a ValueError) naming the argument when shapes/dtypes do not fit."""
    check_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_rank("k", k, 4, "[B, T, H, K]")
    check_shape("k", k, (B, T, H, K), "[B, T, H, K] (same as q)")
    check_rank("v", v, 4, "[B, T, H, V]")
    if tuple(v.shape[:3]) != (B, T, H):
        raise OpInputError(
            f"v: expected shape [B, T, H, V] with B, T, H = {(B, T, H)} (from q), got {tuple(v.shape)}"
        )
    V = v.shape[3]
    check_rank("g", g, 4, "[B, T, H, K]")
    check_shape("g", g, (B, T, H, K), "[B, T, H, K] (same as q)")
    check_rank("beta", beta, 3, "[B, T, H]")
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    check_rank("initial_state", initial_state, 4, "[B, H, K, V]")
    check_shape("initial_state", initial_state, (B, H, K, V), "[B, H, K, V]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_dtype("k", k, (q.dtype,), " (same as q)")
    check_dtype("v", v, (q.dtype,), " (same as q)")
    check_dtype("g", g, (torch.float32,), " (log-decay is kept in fp32)")
    check_dtype("beta", beta, tuple({torch.float32, q.dtype}), " (fp32 or q's dtype)")
    check_dtype("initial_state", initial_state, (torch.float32,), " (the recurrent state is fp32)")
    if K < 1 or V < 1 or K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise OpInputError(f"head dims K={K}, V={V}: expected 1 <= K, V <= {MAX_HEAD_DIM}")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)


# ---------------------------------------------------------------------------------------------
# references (pure torch)
# ---------------------------------------------------------------------------------------------
def kda_naive(q, k, v, g, beta, initial_state, scale: float, *, dtype: torch.dtype = torch.float64):
    """Token-by-token recurrence computed in ``dtype`` (float64 by default).

    Returns (o in q's dtype, final_state fp32) - or both in ``dtype`` when ``dtype`` is float64
    and q is float64. Inputs are never modified.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    qf = q.to(dtype) * scale
    kf, vf, gf, bf = k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype)
    S = initial_state.to(dtype).clone()
    o = torch.empty(B, T, H, V, dtype=dtype, device=q.device)
    for t in range(T):
        S = S * gf[:, t].exp()[..., None]  # [B,H,K,V]
        kt = kf[:, t]  # [B,H,K]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt * bf[:, t][..., None], vf[:, t] - pred)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", qf[:, t], S)
    out_dtype = q.dtype
    state_dtype = torch.float64 if (dtype == torch.float64 and q.dtype == torch.float64) else torch.float32
    return o.to(out_dtype), S.to(state_dtype)


def kda_chunk_torch(q, k, v, g, beta, initial_state, scale: float):
    """The torch backend for prefill: the modeling file's chunked form, chunk 64."""
    o, state = kda_chunked(q, k, v, g, beta, initial_state, scale, chunk_size=CHUNK)
    return o, state.float()


def kda_recurrent_torch(q, k, v, g, beta, initial_state, scale: float):
    """The torch backend for decode: the modeling file's token loop."""
    o, state = kda_recurrent(q, k, v, g, beta, initial_state, scale)
    return o, state.float()


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def kda_recurrent_kernel(
        # inputs
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr,
        # int32 scalars
        T, H,
        # outputs
        o_ptr, ht_ptr,
        # baked-in attributes
        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
    ):
        """Grid (cdiv(V, BV), B*H). One program owns the state tile S[:, v-block] for one (b, h)
        and walks the T tokens, keeping S in registers; loads per token q,k,g [K], v [BV], beta."""
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_b = i_bh // H
        i_h = i_bh % H
        ok = tl.arange(0, BK)
        ov = i_v * BV + tl.arange(0, BV)
        mk = ok < K
        mv = ov < V
        mkv = mk[:, None] & mv[None, :]
        s_off = i_bh.to(tl.int64) * K * V + ok[:, None] * V + ov[None, :]
        h = tl.load(h0_ptr + s_off, mask=mkv, other=0.0).to(tl.float32)
        row = (i_b.to(tl.int64) * T) * H + i_h  # flat (b, t=0, h) row index
        for t in range(0, T):
            r = row + t * H
            b_q = tl.load(q_ptr + r * K + ok, mask=mk, other=0.0).to(tl.float32) * SCALE
            b_k = tl.load(k_ptr + r * K + ok, mask=mk, other=0.0).to(tl.float32)
            b_g = tl.load(g_ptr + r * K + ok, mask=mk, other=0.0).to(tl.float32)
            b_v = tl.load(v_ptr + r * V + ov, mask=mv, other=0.0).to(tl.float32)
            b_beta = tl.load(beta_ptr + r).to(tl.float32)
            h = h * tl.exp(b_g)[:, None]
            b_v = b_v - tl.sum(h * b_k[:, None], axis=0)
            h = h + (b_beta * b_k)[:, None] * b_v[None, :]
            b_o = tl.sum(h * b_q[:, None], axis=0)
            tl.store(o_ptr + r * V + ov, b_o.to(o_ptr.dtype.element_ty), mask=mv)
        tl.store(ht_ptr + s_off, h, mask=mkv)

    @triton.jit
    def kda_chunk_kernel(
        # inputs
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr,
        # int32 scalars
        T, H,
        # outputs
        o_ptr, ht_ptr,
        # baked-in attributes
        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
        BT: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """Grid (cdiv(V, BV), B*H). One program walks the chunks of BT tokens of one (b, h) and
        one v-block, state tile S [BK, BV] fp32 in registers. Per chunk: decay-weighted scores
        (off-diagonal sub-blocks by matmul against a reference row, diagonal sub-blocks exact),
        (I + M)^-1 as (I + X)^-1 D^-1 (D^-1 of the 16x16 diagonal blocks by forward substitution,
        X = D^-1 N nilpotent of order 4), then the WY update of O and S."""
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_b = i_bh // H
        i_h = i_bh % H
        ok = tl.arange(0, BK)
        ov = i_v * BV + tl.arange(0, BV)
        mk = ok < K
        mv = ov < V
        mkv = mk[:, None] & mv[None, :]
        rows = tl.arange(0, BT)
        cols = tl.arange(0, BT)
        s_off = i_bh.to(tl.int64) * K * V + ok[:, None] * V + ov[None, :]
        S = tl.load(h0_ptr + s_off, mask=mkv, other=0.0).to(tl.float32)
        row0 = (i_b.to(tl.int64) * T) * H + i_h
        eye = (rows[:, None] == cols[None, :]).to(tl.float32)
        strict = rows[:, None] > cols[None, :]
        n_chunks = tl.cdiv(T, BT)
        for i_t in range(0, n_chunks):
            t0 = i_t * BT
            tok = t0 + rows
            mt = tok < T
            r = row0 + tok.to(tl.int64) * H  # [BT] flat rows
            mtk = mt[:, None] & mk[None, :]
            b_k = tl.load(k_ptr + r[:, None] * K + ok[None, :], mask=mtk, other=0.0).to(tl.float32)
            b_q = tl.load(q_ptr + r[:, None] * K + ok[None, :], mask=mtk, other=0.0).to(tl.float32) * SCALE
            b_g = tl.load(g_ptr + r[:, None] * K + ok[None, :], mask=mtk, other=0.0).to(tl.float32)
            b_v = tl.load(v_ptr + r[:, None] * V + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0).to(
                tl.float32
            )
            b_beta = tl.load(beta_ptr + r, mask=mt, other=0.0).to(tl.float32)
            gam = tl.cumsum(b_g, axis=0)  # [BT, BK] inclusive cumulative log-decay

            blk = rows // BC  # sub-block of each row
            # Γ restarted at each sub-block (inclusive cumsum inside the block)
            gam_in = tl.reshape(tl.cumsum(tl.reshape(b_g, [BT // BC, BC, BK]), axis=1), [BT, BK])

            # off-diagonal sub-blocks: row block sb against all earlier columns, through the
            # reference Γ_ref = Γ at row sb*BC - 1 (both exponentials <= 1)
            a_kk = tl.zeros([BT, BT], dtype=tl.float32)
            a_qk = tl.zeros([BT, BT], dtype=tl.float32)
            for sb in tl.static_range(1, BT // BC):
                g_ref = tl.sum(tl.where(rows[:, None] == sb * BC - 1, gam, 0.0), axis=0)  # [BK]
                in_blk = blk == sb
                before = rows < sb * BC
                e_row = tl.exp(tl.where(in_blk[:, None], gam - g_ref[None, :], 0.0))
                e_col = tl.exp(tl.where(before[:, None], g_ref[None, :] - gam, 0.0))
                k_l = tl.where(in_blk[:, None], b_k * e_row, 0.0)
                q_l = tl.where(in_blk[:, None], b_q * e_row, 0.0)
                k_r = tl.where(before[:, None], b_k * e_col, 0.0)
                a_kk += tl.dot(k_l, tl.trans(k_r), input_precision=DOT_PRECISION)
                a_qk += tl.dot(q_l, tl.trans(k_r), input_precision=DOT_PRECISION)

            # diagonal sub-blocks, all at once, exact pairwise exponents: step j handles column
            # c(r) = BC*blk(r) + j of every row r (rows gathered from memory, cached)
            d_kk = tl.zeros([BT, BT], dtype=tl.float32)
            d_qk = tl.zeros([BT, BT], dtype=tl.float32)
            g_col = tl.zeros([BT, BK], dtype=tl.float32)  # Γ_in at column c(r)
            for j in range(0, BC):
                c = blk * BC + j  # [BT]
                tc = t0 + c
                rc = row0 + tc.to(tl.int64) * H
                mc = (tc < T)[:, None] & mk[None, :]
                k_c = tl.load(k_ptr + rc[:, None] * K + ok[None, :], mask=mc, other=0.0).to(tl.float32)
                g_col += tl.load(g_ptr + rc[:, None] * K + ok[None, :], mask=mc, other=0.0).to(tl.float32)
                keep = (rows % BC) >= j
                ek = tl.exp(tl.where(keep[:, None], gam_in - g_col, float("-inf"))) * k_c
                hit = cols[None, :] == c[:, None]
                d_kk = tl.where(hit, tl.sum(b_k * ek, axis=1)[:, None], d_kk)
                d_qk = tl.where(hit, tl.sum(b_q * ek, axis=1)[:, None], d_qk)
            a_qk += d_qk
            d_kk = tl.where(strict, d_kk, 0.0) * b_beta[:, None]
            a_kk = a_kk * b_beta[:, None]  # strictly block-lower part N

            # (I + d_kk + N)^-1 = (I + X)^-1 D^-1 with D = I + d_kk, X = D^-1 N (X^4 = 0 for 4
            # sub-blocks: (I + X)^-1 = (I - X)(I + X^2)). D^-1: forward substitution, all
            # sub-blocks at once (step i finalises row i of every sub-block).
            d_inv = eye
            for i in range(1, BC):
                sel = (rows % BC) == i
                upd = tl.dot(tl.where(sel[:, None], d_kk, 0.0), d_inv, input_precision=DOT_PRECISION)
                d_inv = tl.where(sel[:, None], d_inv - upd, d_inv)
            x = tl.dot(d_inv, a_kk, input_precision=DOT_PRECISION)
            x2 = tl.dot(x, x, input_precision=DOT_PRECISION)
            inv = tl.dot(eye - x, eye + x2, input_precision=DOT_PRECISION)
            inv = tl.dot(inv, d_inv, input_precision=DOT_PRECISION)
            e_gam = tl.exp(gam)
            w = tl.dot(inv, b_beta[:, None] * b_k * e_gam, input_precision=DOT_PRECISION)  # [BT, BK]
            u = tl.dot(inv, b_beta[:, None] * b_v, input_precision=DOT_PRECISION)  # [BT, BV]
            v_new = u - tl.dot(w, S, input_precision=DOT_PRECISION)
            b_o = tl.dot(b_q * e_gam, S, input_precision=DOT_PRECISION) + tl.dot(
                a_qk, v_new, input_precision=DOT_PRECISION
            )
            tl.store(o_ptr + r[:, None] * V + ov[None, :], b_o.to(o_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])
            g_last = tl.sum(tl.where(rows[:, None] == BT - 1, gam, 0.0), axis=0)  # [BK]
            k_dec = b_k * tl.exp(g_last[None, :] - gam)
            S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(k_dec), v_new, input_precision=DOT_PRECISION)
        tl.store(ht_ptr + s_off, S, mask=mkv)


def _require_triton():
    if not HAVE_TRITON:
        raise RuntimeError("the Triton kda kernels need the `triton` package")


def recurrent_launch_config(K: int, V: int) -> dict:
    """Block sizes / warps of the recurrent kernel for head dims K, V (also used by the AOT path)."""
    BK = max(16, next_pow2(K))
    BV = min(max(16, next_pow2(V)), 32 if BK > 64 else 64)
    return {"BK": BK, "BV": BV, "num_warps": 4 if BK * BV <= 4096 else 8}


def chunk_launch_config(K: int, V: int, dtype: torch.dtype) -> dict:
    """Block sizes / warps of the chunk kernel (also used by the AOT path)."""
    BK = max(16, next_pow2(K))
    BV = min(max(16, next_pow2(V)), 64 if BK <= 64 else 32)
    return {
        "BK": BK,
        "BV": BV,
        "BT": CHUNK,
        "BC": SUB,
        "DOT_PRECISION": "tf32x3" if dtype == torch.float32 else "tf32",
        "num_warps": 4 if BK <= 64 else 8,
    }


def _prep(q, k, v, g, beta, initial_state):
    return (
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        initial_state.contiguous(),
    )


def _launch(kernel, cfg: dict, constexpr_names: tuple[str, ...], q, k, v, g, beta, initial_state, scale: float):
    """Allocate (o, final_state) and run one of the two KDA kernels (same parameter layout) on grid
    (cdiv(V, BV), B*H); `constexpr_names` are the kernel-specific entries of `cfg`."""
    q, k, v, g, beta, h0 = _prep(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(V, cfg["BV"]), B * H)
    kernel[grid](
        q, k, v, g, beta, h0, T, H, o, ht,
        K=K, V=V, BK=cfg["BK"], BV=cfg["BV"], SCALE=float(scale), num_warps=cfg["num_warps"],
        **{name: cfg[name] for name in constexpr_names},
    )
    return o, ht


def kda_recurrent_triton(q, k, v, g, beta, initial_state, scale: float):
    """Fused recurrent Triton kernel (the decode path). Same contract as ``torch.ops.k3.kda``."""
    _require_triton()
    cfg = recurrent_launch_config(q.shape[-1], v.shape[-1])
    return _launch(kda_recurrent_kernel, cfg, (), q, k, v, g, beta, initial_state, scale)


def kda_chunk_triton(q, k, v, g, beta, initial_state, scale: float):
    """Chunked Triton kernel (the prefill path). Same contract as ``torch.ops.k3.kda``."""
    _require_triton()
    cfg = chunk_launch_config(q.shape[-1], v.shape[-1], q.dtype)
    return _launch(kda_chunk_kernel, cfg, ("BT", "BC", "DOT_PRECISION"), q, k, v, g, beta, initial_state, scale)


# ---------------------------------------------------------------------------------------------
# the registered op
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("k3::kda", mutates_args=())
def _kda_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_kda_inputs(q, k, v, g, beta, initial_state)
    T = q.shape[1]
    impl = _backend.resolve(q)
    if impl == "triton":
        fn = kda_recurrent_triton if T <= RECURRENT_MAX_T else kda_chunk_triton
    else:
        fn = kda_recurrent_torch if T <= RECURRENT_MAX_T else kda_chunk_torch
    return fn(q, k, v, g, beta, initial_state, scale)


@_kda_op.register_fake
def _kda_fake(q, k, v, g, beta, initial_state, scale):
    B, T, H, _ = q.shape
    V = v.shape[-1]
    o = q.new_empty(B, T, H, V)
    return o, initial_state.new_empty(initial_state.shape, dtype=torch.float32)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated entry point for ``torch.ops.k3.kda``.

    ``initial_state=None`` means a fresh sequence (zeros); ``scale=None`` means K ** -0.5.
    Raises OpInputError (a ValueError) naming the argument when shapes or dtypes do not fit.
    """
    check_rank("q", q, 4, "[B, T, H, K]")
    check_rank("v", v, 4, "[B, T, H, V]")
    if initial_state is None:
        B, _, H, K = q.shape
        initial_state = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=q.device)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scale = float(scale)
    if not math.isfinite(scale):
        raise OpInputError(f"scale: expected a finite float, got {scale}")
    check_kda_inputs(q, k, v, g, beta, initial_state)
    return torch.ops.k3.kda(q, k, v, g, beta, initial_state, scale)
