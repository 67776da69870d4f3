"""k3::kda - Kimi Delta Attention core (gated delta rule with per-key-channel decay).

Per batch b, head h and token t, with the state S [K, V] kept in fp32:

    S = exp(g_t)[:, None] * S                  # decay rows (per key channel), g_t <= 0
    S = S + beta_t * k_t (v_t - k_tᵀ S)ᵀ       # delta-rule write
    o_t = (scale * q_t)ᵀ S                     # read after the write

The contract (layouts, dtypes, attributes, kernel scalars) is ``spec.KDA``. The torch backend is the reference
recurrence (``naive.kda_naive`` in fp32); the Triton backend runs one of two kernels, chosen by ``kda_algorithm``:
``kda_recurrent_kernel`` for one token (decode) and ``kda_chunk_kernel`` for more (prefill).

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

import torch

from k3export import dtypes
from k3export.ops import backend
from k3export.ops.naive import kda_naive
from k3export.ops.spec import KDA, OpInputError, check_tensors

try:  # Triton is optional: the torch backend works without it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False

CHUNK = 64  # default chunk length of the chunked form (the modeling file's default too)
SUB = 16  # sub-block length that splits the exponentials inside a chunk
#: chunk lengths the chunk kernel supports: (I + X)^-1 = (I - X)(I + X^2) needs at most 4 sub-blocks of 16
CHUNK_SIZES = (16, 32, 64)


def kda_algorithm(T: int) -> str:
    """The one rule for which KDA algorithm runs: "recurrent" for a single token (decode), "chunk" for more
    (prefill). The op, the "kda" kernel hook and the TensorRT plugin's tactic all follow it."""
    return "recurrent" if T == 1 else "chunk"


if HAVE_TRITON:

    @triton.jit
    def kda_recurrent_kernel(
        # inputs
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, initial_state_ptr,
        # int32 scalars
        T, H,
        # outputs
        o_ptr, final_state_ptr,
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
        h = tl.load(initial_state_ptr + s_off, mask=mkv, other=0.0).to(tl.float32)
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
        tl.store(final_state_ptr + s_off, h, mask=mkv)

    @triton.jit
    def kda_chunk_kernel(
        # inputs
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, initial_state_ptr,
        # int32 scalars
        T, H,
        # outputs
        o_ptr, final_state_ptr,
        # baked-in attributes
        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
        BT: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """Grid (cdiv(V, BV), B*H). One program walks the chunks of BT tokens of one (b, h) and
        one v-block, state tile S [BK, BV] fp32 in registers. Per chunk: decay-weighted scores
        (off-diagonal sub-blocks by matmul against a reference row, diagonal sub-blocks exact),
        (I + M)^-1 as (I + X)^-1 D^-1 (D^-1 of the 16x16 diagonal blocks by forward substitution,
        X = D^-1 N nilpotent of order BT / BC <= 4), then the WY update of O and S."""
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
        S = tl.load(initial_state_ptr + s_off, mask=mkv, other=0.0).to(tl.float32)
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

            # (I + d_kk + N)^-1 = (I + X)^-1 D^-1 with D = I + d_kk, X = D^-1 N (X^4 = 0 for at most 4
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
        tl.store(final_state_ptr + s_off, S, mask=mkv)


def config(algorithm: str, K: int, V: int, float_dtype: str, chunk_size: int = CHUNK) -> tuple[dict, int]:
    """(constexprs without SCALE, num_warps) of the `algorithm` kernel for head dims K, V (launcher and AOT)."""
    BK = max(16, triton.next_power_of_2(K))
    const = {"K": K, "V": V, "BK": BK, "BV": min(max(16, triton.next_power_of_2(V)), 64 if BK <= 64 else 32)}
    if algorithm == "recurrent":
        return const, 4 if BK * const["BV"] <= 4096 else 8
    const.update(BT=chunk_size, BC=SUB, DOT_PRECISION="tf32x3" if float_dtype == "float32" else "tf32")
    return const, 4 if BK <= 64 else 8


def launch(B, T, H, V: int, BV: int) -> tuple[tuple, tuple]:
    """(grid, int32 scalars) of both kernels: grid (cdiv(V, BV), B*H, 1), scalars (T, H). One program owns the
    state tile S[:, v-block] of one (batch, head) and walks the T tokens. B and T may be symbolic."""
    return (-(-V // BV), B * H, 1), (T, H)


def aot_config(kernel: str, float_dtype: str, attrs: dict, dims: dict):
    """(jit function, constexprs, num_warps) of a plugin kernel: head dims and ``scale`` baked in."""
    algorithm = kernel.removeprefix("kda_")
    const, num_warps = config(algorithm, int(dims["K"]), int(dims["V"]), float_dtype)
    fn = kda_recurrent_kernel if algorithm == "recurrent" else kda_chunk_kernel
    return fn, {**const, "SCALE": float(attrs["scale"])}, num_warps


def kda_triton(q, k, v, g, beta, initial_state, scale: float, chunk_size: int = CHUNK, algorithm: str | None = None):
    """The Triton backend: the kernel `kda_algorithm(T)` picks (or `algorithm`), same contract as the op."""
    if not HAVE_TRITON:
        raise RuntimeError("the Triton kda kernels need the `triton` package")
    algorithm = algorithm or kda_algorithm(q.shape[1])
    q, k, v, g, beta, h0 = (t.contiguous() for t in (q, k, v, g, beta, initial_state))
    B, T, H, K = q.shape
    V = v.shape[-1]
    const, num_warps = config(algorithm, K, V, dtypes.dtype(q.dtype).name, chunk_size)
    o = q.new_empty(B, T, H, V)
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
    grid, scalars = launch(B, T, H, V, const["BV"])
    kernel = kda_recurrent_kernel if algorithm == "recurrent" else kda_chunk_kernel
    kernel[grid](q, k, v, g, beta, h0, *scalars, o, ht, SCALE=float(scale), num_warps=num_warps, **const)
    return o, ht


@torch.library.custom_op("k3::kda", mutates_args=())
def _kda_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            initial_state: torch.Tensor, scale: float, chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensors(KDA, q, k, v, g, beta, initial_state, scale=scale)
    if chunk_size not in CHUNK_SIZES:
        raise OpInputError(f"k3::kda chunk_size={chunk_size}: the chunk kernel supports {CHUNK_SIZES}")
    if backend.resolve(q) == "torch":
        return kda_naive(q, k, v, g, beta, initial_state, scale, dtype=torch.float32)
    return kda_triton(q, k, v, g, beta, initial_state, scale, chunk_size)


@_kda_op.register_fake
def _(q, k, v, g, beta, initial_state, scale, chunk_size=CHUNK):
    return q.new_empty(*q.shape[:3], v.shape[-1]), initial_state.new_empty(initial_state.shape, dtype=torch.float32)


def kda(q, k, v, g, beta, initial_state=None, scale: float | None = None, chunk_size: int = CHUNK):
    """``torch.ops.k3.kda`` with defaults: `initial_state` None = a fresh sequence (zeros), `scale` None = K ** -0.5.
    Raises OpInputError (a ValueError) naming the argument when shapes, dtypes or values do not fit."""
    if initial_state is None:
        initial_state = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], device=q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.k3.kda(q, k, v, g, beta, initial_state, float(scale), chunk_size)
