"""k3::moe_experts and k3::moe_experts_mxfp4 - the routed experts of a K3 MoE layer, each selected expert read once.

    u[n] = sum_j weights[n, j] * W2[e] act(W1[e] z[n], W3[e] z[n]),   e = indices[n, j]      (fp32 [N, D])

z [N, D]; weights fp32 / indices int64 [N, top_k] (from ``moe_route``); W1 = gate, W3 = up [E, I, D], W2 = down
[E, D, I]; act "situ" (SiTU-GLU with beta1, beta2, as ``situ_glu``) or "silu" (SiLU-GLU). The contracts are
``spec.MOE_EXPERTS`` and ``spec.MOE_EXPERTS_MXFP4``; the torch backend is ``naive.moe_experts_naive`` in fp32.

**The kernels.** No routing metadata is precomputed anywhere: every program finds its token-slots by scanning
``indices`` (a compare and a prefix count per block of slots), gathers up to BM of them by rank, and runs one
expert tile on them: gate / up GEMMs over D (fp32 accumulate), SiTU-GLU / SiLU-GLU fused in registers, the down
GEMM, times the routing weight, added into u. Slots whose index is outside [0, E) contribute nothing
(``moe_route`` never makes them). Two ways of cutting the work into programs:

* ``"experts"`` (`moe_experts_experts_kernel`, the op's Triton backend): grid (E, cdiv(I, BI)); program (e, i)
  owns rows i of W1[e] / W3[e] and columns i of W2[e] and reads them once per BM of e's slots, so every selected
  expert is read once per call whenever at most BM slots chose it (BM grows with the average); experts nobody
  chose cost one scan of ``indices``. Programs of different experts add into the same rows of u with atomics, so
  u must be zero on entry: the launcher allocates it with ``torch.zeros``.
* ``"tokens"`` (`moe_experts_kernel`, `moe_experts_mxfp4_kernel`, `moe_experts_nvfp4_kernel`: the TensorRT plugin
  kernels): grid
  (cdiv(N, BN),); a program owns BN token rows of u, zeroes them, then walks the experts its slots chose (each
  once, at its first slot) over all of I. TensorRT launches an AOT plugin kernel with nothing but the tensors (no
  workspace, uninitialised outputs, one kernel), and a sum across programs would need a zeroed accumulator, so the
  plugin kernel owns its output rows: correct with any prior contents of u, deterministic, and each selected
  expert is read once per block of BN tokens (once per call when N <= BN, i.e. any decode batch up to BN), at the
  cost of one program per token block.

**MXFP4 (W4A16).** ``k3::moe_experts_mxfp4`` takes compressed-tensors' bytes as they are: w1 / w3 uint8
[E, I, D/2] and w2 uint8 [E, D, I/2] (element 2j in the low nibble of byte j; a nibble is E2M1: bit 3 sign,
bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}) with E8M0 scales uint8 [E, out, in/32] (2^(byte - 127); 255 = inf,
as compressed-tensors decodes it). The kernels decode a weight tile in registers to fp32 (exact), cast it to z's
dtype (exact in bf16) and run the same GEMMs; nothing dequantised is ever written.

**NVFP4 (W4A16).** `moe_experts_triton(..., scale_2=(g1, g3, g2))` (both kernels; ``spec.MOE_EXPERTS_NVFP4``):
the same packed E2M1 bytes, E4M3 scale bytes [E, out, in/16] and fp32 global scales
[E]; a tile decodes to e2m1 x e4m3 (exact in fp32) times its expert's global scale (one rounding).
"""

from __future__ import annotations

import torch

from k3export import dtypes
from k3export.ops import backend
from k3export.ops.naive import moe_experts_mxfp4_naive, moe_experts_naive, moe_experts_nvfp4_naive
from k3export.ops.spec import MOE_ACTS, MOE_EXPERTS, MOE_EXPERTS_MXFP4, MOE_EXPERTS_NVFP4, OpInputError, check_tensors

try:
    import triton
    import triton.language as tl

    from k3export.ops.situ_glu import _tanh

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    HAVE_TRITON = False

ALGORITHMS = ("experts", "tokens")
BN = 16  # token rows per program of the "tokens" kernels (the plugin's): a decode batch up to BN reads each expert once
BI = 64  # intermediate columns per tile (MXFP4: 32)
BD = 32  # hidden columns per tile
MAX_BM = 64  # slots per tile of the "experts" kernel
MAX_BS = 256  # slots scanned per step of the "experts" kernel


if HAVE_TRITON:

    @triton.jit
    def _glu(g, u, ACT: tl.constexpr, BETA1: tl.constexpr, BETA2: tl.constexpr):
        """SiTU-GLU (ACT 0) or SiLU-GLU (ACT 1) of fp32 gate / up: the formulas of ``situ_glu`` and F.silu."""
        e = tl.exp(-tl.abs(g))  # overflow-free sigmoid
        sig = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        if ACT == 0:
            return (BETA1 * _tanh(g / BETA1)) * sig * (BETA2 * _tanh(u / BETA2))
        else:
            return g * sig * u

    @triton.jit
    def _e2m1_tile(w_ptr, row, rows, c0, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """The E2M1 values of packed bytes [R, C/2] (element 2j in the low nibble of byte j, MXFP4's and NVFP4's
        grid) at rows `row` (`rows` < R valid), columns c0:c0+BC, fp32 [BR, BC], unscaled."""
        cb = c0 // 2 + tl.arange(0, BC // 2)  # byte columns
        byte = tl.load(w_ptr + row * (C // 2) + cb[None, :], mask=(rows < R)[:, None] & (cb < C // 2)[None, :],
                       other=0).to(tl.int32)
        nib = tl.reshape(tl.join(byte & 15, byte >> 4), [BR, BC])
        ex = (nib >> 1) & 3
        man = (nib & 1).to(tl.float32)
        # E2M1: exponent 0 -> 0 or 0.5 (subnormal); else (1 + m/2) * 2^(ex - 1)
        mag = tl.where(ex == 0, 0.5 * man, (1.0 + 0.5 * man) * tl.where(ex == 1, 1.0, tl.where(ex == 2, 2.0, 4.0)))
        return tl.where(nib >= 8, -mag, mag)

    @triton.jit
    def _weight_tile(w_ptr, s_ptr, g_ptr, e, r0, c0, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr, MXFP4: tl.constexpr, NVFP4: tl.constexpr = False):
        """W[e][r0:r0+BR, c0:c0+BC] of a stacked [E, R, C] weight, fp32 [BR, BC], zero outside [R, C]. MXFP4: from the
        packed bytes [E, R, C/2] (element 2j in the low nibble of byte j) and the E8M0 scales [E, R, C/32] (C and c0
        multiples of 32), decoded here. NVFP4 (with MXFP4 set): the same packed bytes, E4M3 scale bytes [E, R, C/16]
        and the fp32 global scales [E] at `g_ptr`: e2m1 x e4m3 (exact), times the global scale (one rounding)."""
        rows = r0 + tl.arange(0, BR)
        row = e.to(tl.int64) * R + rows[:, None].to(tl.int64)
        if NVFP4:
            val = _e2m1_tile(w_ptr, row, rows, c0, R, C, BR, BC)
            tl.static_assert(BC >= 16, "an NVFP4 tile spans whole blocks of 16")
            cs = c0 // 16 + tl.arange(0, BC // 16)
            sb = tl.load(s_ptr + row * (C // 16) + cs[None, :], mask=(rows < R)[:, None] & (cs < C // 16)[None, :],
                         other=0).to(tl.int32)
            # E4M3: exponent field 0 -> man * 2^-9 (subnormal), else (1 + man/8) * 2^(field - 7) (fp32 bit pattern)
            sx = (sb >> 3) & 15
            sm = (sb & 7).to(tl.float32)
            smag = tl.where(sx == 0, sm * 0.001953125, (1.0 + 0.125 * sm) * ((sx + 120) << 23).to(tl.float32,
                                                                                                   bitcast=True))
            scale = tl.where(sb >= 128, -smag, smag)
            g = tl.load(g_ptr + e)
            return tl.reshape(tl.reshape(val, [BR, BC // 16, 16]) * scale[:, :, None], [BR, BC]) * g
        if MXFP4:
            val = _e2m1_tile(w_ptr, row, rows, c0, R, C, BR, BC)
            tl.static_assert(BC >= 32, "an MXFP4 tile spans whole groups of 32")
            cs = c0 // 32 + tl.arange(0, BC // 32)
            sb = tl.load(s_ptr + row * (C // 32) + cs[None, :], mask=(rows < R)[:, None] & (cs < C // 32)[None, :],
                         other=127).to(tl.int32)
            # E8M0: 2^(byte - 127) is the fp32 bit pattern byte << 23 (255 -> inf), except byte 0 (2^-127, subnormal)
            scale = tl.where(sb == 0, 5.877471754111438e-39, (sb << 23).to(tl.float32, bitcast=True))
            return tl.reshape(tl.reshape(val, [BR, BC // 32, 32]) * scale[:, :, None], [BR, BC])
        else:
            cols = c0 + tl.arange(0, BC)
            mask = (rows < R)[:, None] & (cols < C)[None, :]
            return tl.load(w_ptr + row * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _expert_tile(z_ptr, w1_ptr, w3_ptr, w2_ptr, s1_ptr, s3_ptr, s2_ptr, u_ptr, e, i0, tok, wgt, valid,
                     D: tl.constexpr, I: tl.constexpr, ACT: tl.constexpr, BETA1: tl.constexpr, BETA2: tl.constexpr,
                     MXFP4: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr, BD: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr, g1_ptr=None, g3_ptr=None, g2_ptr=None,
                     NVFP4: tl.constexpr = False):
        """u[tok] += wgt * W2[e][:, i0:i0+BI] act(W1[e][i0:i0+BI] z[tok], W3[e][i0:i0+BI] z[tok]) for the BM slots
        (tok, wgt, valid): gate / up over D in fp32, the GLU in registers, then the down GEMM added into u
        (atomically) block of BD columns by block. Reads rows i0:i0+BI of W1[e], W3[e] and columns of W2[e] once.
        GEMM operands are in z's dtype (the intermediate rounded to it), or DOT_F32: those values widened to fp32
        (exact; the CPU interpreter's bf16 dot is wrong)."""
        zt = z_ptr.dtype.element_ty
        dt = tl.float32 if DOT_F32 else zt
        oi = i0 + tl.arange(0, BI)
        mi = oi < I
        row = tok.to(tl.int64) * D
        acc_g = tl.zeros([BM, BI], dtype=tl.float32)
        acc_u = tl.zeros([BM, BI], dtype=tl.float32)
        for d0 in range(0, D, BD):
            od = d0 + tl.arange(0, BD)
            md = od < D
            x = tl.load(z_ptr + row[:, None] + od[None, :], mask=valid[:, None] & md[None, :], other=0.0).to(dt)
            g1 = _weight_tile(w1_ptr, s1_ptr, g1_ptr, e, i0, d0, I, D, BI, BD, MXFP4, NVFP4).to(zt).to(dt)  # [BI, BD]
            g3 = _weight_tile(w3_ptr, s3_ptr, g3_ptr, e, i0, d0, I, D, BI, BD, MXFP4, NVFP4).to(zt).to(dt)
            acc_g = tl.dot(x, tl.trans(g1), acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(x, tl.trans(g3), acc_u, input_precision=DOT_PRECISION)
        h = _glu(acc_g, acc_u, ACT, BETA1, BETA2)
        h = tl.where(valid[:, None] & mi[None, :], h, 0.0).to(zt).to(dt)
        for d0 in range(0, D, BD):
            od = d0 + tl.arange(0, BD)
            md = od < D
            w2t = _weight_tile(w2_ptr, s2_ptr, g2_ptr, e, d0, i0, D, I, BD, BI, MXFP4, NVFP4).to(zt).to(dt)  # [BD, BI]
            y = tl.dot(h, tl.trans(w2t), input_precision=DOT_PRECISION) * wgt[:, None]
            tl.atomic_add(u_ptr + row[:, None] + od[None, :], y, mask=valid[:, None] & md[None, :])

    @triton.jit
    def _slots(indices_ptr, weights_ptr, start, stop, e, rank0, TOP_K: tl.constexpr, BM: tl.constexpr,
               BS: tl.constexpr):
        """(token, routing weight, valid) [BM] of the slots s in [start, stop) with indices[s] == e whose rank among
        them (in slot order) is rank0 + 0..BM-1: a scan of BS slots per step, compacted by prefix count."""
        rows = rank0 + tl.arange(0, BM)
        tok = tl.zeros([BM], dtype=tl.int32)
        wgt = tl.zeros([BM], dtype=tl.float32)
        found = tl.zeros([BM], dtype=tl.int32)
        seen = tl.sum(tl.zeros([BS], dtype=tl.int32), axis=0)
        for s0 in range(start, stop, BS):
            offs = s0 + tl.arange(0, BS)
            m = offs < stop
            hit = m & (tl.load(indices_ptr + offs, mask=m, other=-1) == e)
            n_hit = tl.sum(hit.to(tl.int32), axis=0)
            if (n_hit > 0) & (seen < rank0 + BM) & (seen + n_hit > rank0):
                rank = seen + tl.cumsum(hit.to(tl.int32), axis=0) - 1
                sel = hit[None, :] & (rank[None, :] == rows[:, None])  # [BM, BS]: row r <- the slot of rank r
                w = tl.load(weights_ptr + offs, mask=hit, other=0.0)
                tok += tl.sum(tl.where(sel, (offs // TOP_K)[None, :], 0), axis=1)
                wgt += tl.sum(tl.where(sel, w[None, :], 0.0), axis=1)
                found += tl.sum(sel.to(tl.int32), axis=1)
            seen += n_hit
        return tok, wgt, found > 0

    @triton.jit
    def _count(indices_ptr, start, stop, e, BS: tl.constexpr):
        """How many slots s in [start, stop) have indices[s] == e."""
        n = tl.sum(tl.zeros([BS], dtype=tl.int32), axis=0)
        for s0 in range(start, stop, BS):
            offs = s0 + tl.arange(0, BS)
            m = offs < stop
            n += tl.sum((m & (tl.load(indices_ptr + offs, mask=m, other=-1) == e)).to(tl.int32), axis=0)
        return n

    @triton.jit
    def _token_block(z_ptr, weights_ptr, indices_ptr, w1_ptr, w3_ptr, w2_ptr, s1_ptr, s3_ptr, s2_ptr, N, u_ptr,
                     E: tl.constexpr, I: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr, ACT: tl.constexpr,
                     BETA1: tl.constexpr, BETA2: tl.constexpr, MXFP4: tl.constexpr, BN: tl.constexpr,
                     BS: tl.constexpr, BI: tl.constexpr, BD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     DOT_F32: tl.constexpr, g1_ptr=None, g3_ptr=None, g2_ptr=None, NVFP4: tl.constexpr = False):
        """The "tokens" program: owns rows [BN * pid, + BN) of u; zeroes them, then runs every expert its slots
        chose (at the expert's first slot in the block) over all of I. NVFP4: the global scales at g*_ptr."""
        n0 = tl.program_id(0) * BN
        rows = n0 + tl.arange(0, BN)
        mr = rows < N
        for d0 in range(0, D, BD):
            od = d0 + tl.arange(0, BD)
            zero = tl.zeros([BN, BD], dtype=tl.float32)
            tl.store(u_ptr + rows.to(tl.int64)[:, None] * D + od[None, :], zero, mask=mr[:, None] & (od < D)[None, :])
        tl.debug_barrier()  # the zeros are written before any thread of this program adds
        start = n0 * TOP_K
        stop = tl.minimum(N, n0 + BN) * TOP_K
        lane = tl.arange(0, BS)
        block = tl.load(indices_ptr + start + lane, mask=start + lane < stop, other=-1)
        for j in range(0, BN * TOP_K):
            if start + j < stop:
                e = tl.load(indices_ptr + start + j)
                first = tl.sum(((block == e) & (lane < j)).to(tl.int32), axis=0) == 0
                if first & (e >= 0) & (e < E):
                    n_e = tl.sum((block == e).to(tl.int32), axis=0)
                    for c in range(0, tl.cdiv(n_e, BN)):  # more than BN only when a token repeats an expert
                        tok, wgt, valid = _slots(indices_ptr, weights_ptr, start, stop, e, c * BN, TOP_K, BN, BS)
                        for i0 in range(0, I, BI):
                            _expert_tile(z_ptr, w1_ptr, w3_ptr, w2_ptr, s1_ptr, s3_ptr, s2_ptr, u_ptr, e, i0, tok,
                                         wgt, valid, D, I, ACT, BETA1, BETA2, MXFP4, BN, BI, BD, DOT_PRECISION,
                                         DOT_F32, g1_ptr, g3_ptr, g2_ptr, NVFP4)

    @triton.jit
    def moe_experts_kernel(
        z_ptr, weights_ptr, indices_ptr, w1_ptr, w3_ptr, w2_ptr,  # inputs
        N,  # int32 scalar
        u_ptr,  # output
        E: tl.constexpr, I: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr, ACT: tl.constexpr,
        BETA1: tl.constexpr, BETA2: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, BI: tl.constexpr,
        BD: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """Plugin kernel of k3::moe_experts. Grid (cdiv(N, BN),): program b owns token rows [BN b, BN b + BN) of u
        (any prior contents) and runs each expert its slots chose once (`_token_block`)."""
        _token_block(z_ptr, weights_ptr, indices_ptr, w1_ptr, w3_ptr, w2_ptr, w1_ptr, w3_ptr, w2_ptr, N, u_ptr,
                     E, I, D, TOP_K, ACT, BETA1, BETA2, False, BN, BS, BI, BD, DOT_PRECISION, DOT_F32)

    @triton.jit
    def moe_experts_mxfp4_kernel(
        z_ptr, weights_ptr, indices_ptr, w1_ptr, w3_ptr, w2_ptr, w1_scale_ptr, w3_scale_ptr, w2_scale_ptr,  # inputs
        N,  # int32 scalar
        u_ptr,  # output
        E: tl.constexpr, I: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr, ACT: tl.constexpr,
        BETA1: tl.constexpr, BETA2: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, BI: tl.constexpr,
        BD: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """Plugin kernel of k3::moe_experts_mxfp4: `moe_experts_kernel` on packed E2M1 weights and E8M0 scales,
        decoded in registers."""
        _token_block(z_ptr, weights_ptr, indices_ptr, w1_ptr, w3_ptr, w2_ptr, w1_scale_ptr, w3_scale_ptr,
                     w2_scale_ptr, N, u_ptr, E, I, D, TOP_K, ACT, BETA1, BETA2, True, BN, BS, BI, BD, DOT_PRECISION,
                     DOT_F32)

    @triton.jit
    def moe_experts_nvfp4_kernel(
        z_ptr, weights_ptr, indices_ptr, w1_ptr, w3_ptr, w2_ptr, w1_scale_ptr, w3_scale_ptr, w2_scale_ptr,
        w1_scale_2_ptr, w3_scale_2_ptr, w2_scale_2_ptr,  # inputs
        N,  # int32 scalar
        u_ptr,  # output
        E: tl.constexpr, I: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr, ACT: tl.constexpr,
        BETA1: tl.constexpr, BETA2: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, BI: tl.constexpr,
        BD: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """Plugin kernel of k3::moe_experts_nvfp4: `moe_experts_kernel` on packed E2M1 weights, E4M3 scale bytes and
        fp32 global scales, decoded in registers."""
        _token_block(z_ptr, weights_ptr, indices_ptr, w1_ptr, w3_ptr, w2_ptr, w1_scale_ptr, w3_scale_ptr,
                     w2_scale_ptr, N, u_ptr, E, I, D, TOP_K, ACT, BETA1, BETA2, True, BN, BS, BI, BD, DOT_PRECISION,
                     DOT_F32, w1_scale_2_ptr, w3_scale_2_ptr, w2_scale_2_ptr, True)

    @triton.jit
    def moe_experts_experts_kernel(
        z_ptr, weights_ptr, indices_ptr, w1_ptr, w3_ptr, w2_ptr, w1_scale_ptr, w3_scale_ptr, w2_scale_ptr, N, u_ptr,
        E: tl.constexpr, I: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr, ACT: tl.constexpr,
        BETA1: tl.constexpr, BETA2: tl.constexpr, MXFP4: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
        BI: tl.constexpr, BD: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        g1_ptr=None, g3_ptr=None, g2_ptr=None, NVFP4: tl.constexpr = False,
    ):
        """The op's kernel (dense, MXFP4, or NVFP4 with its global scales at g*_ptr). Grid (E, cdiv(I, BI)):
        program (e, i) counts e's slots, then runs the I-tile i of expert e on them, BM slots at a time, adding into
        u (zero on entry) atomically."""
        e = tl.program_id(0)
        i0 = tl.program_id(1) * BI
        stop = N * TOP_K
        n_e = _count(indices_ptr, 0, stop, e, BS)
        for c in range(0, tl.cdiv(n_e, BM)):
            tok, wgt, valid = _slots(indices_ptr, weights_ptr, 0, stop, e, c * BM, TOP_K, BM, BS)
            _expert_tile(z_ptr, w1_ptr, w3_ptr, w2_ptr, w1_scale_ptr, w3_scale_ptr, w2_scale_ptr, u_ptr, e, i0, tok,
                         wgt, valid, D, I, ACT, BETA1, BETA2, MXFP4, BM, BI, BD, DOT_PRECISION, DOT_F32, g1_ptr,
                         g3_ptr, g2_ptr, NVFP4)


def _pow2(n: int, lo: int = 16, hi: int | None = None) -> int:
    p = max(lo, 1 << max(0, int(n) - 1).bit_length())
    return min(p, hi) if hi else p


def config(algorithm: str, E: int, I: int, D: int, top_k: int, act: str, beta1: float, beta2: float,
           float_dtype: str, N: int | None = None, mxfp4: bool = False, interpret: bool = False) -> tuple[dict, int]:
    """(constexprs, num_warps) of the `algorithm` kernel for E experts [I, D], top_k slots per token, act and betas
    baked in (launcher and AOT). `N` (the "experts" kernel only) sizes the slot tiles from the average load. Tiles:
    BD = 32 hidden columns, BI = 64 intermediate columns (32 for MXFP4, whose decode needs more registers); an MXFP4
    tile spans whole groups of 32 (I and D are multiples of 32). `interpret`: the CPU interpreter runs the GEMMs
    on bf16 values widened to fp32 (its bf16 dot is wrong)."""
    if algorithm not in ALGORITHMS:
        raise OpInputError(f"k3::moe_experts: unknown algorithm {algorithm!r}, expected one of {ALGORITHMS}")
    if act not in MOE_ACTS:
        raise OpInputError(f"k3::moe_experts attribute act={act!r}: expected one of {MOE_ACTS}")
    lo = 32 if mxfp4 else 16
    const = {"E": int(E), "I": int(I), "D": int(D), "TOP_K": int(top_k), "ACT": MOE_ACTS.index(act),
             "BETA1": float(beta1), "BETA2": float(beta2), "BI": _pow2(I, lo, 32 if mxfp4 else BI),
             "BD": _pow2(D, lo, BD), "DOT_PRECISION": "tf32x3" if float_dtype == "float32" else "tf32",
             "DOT_F32": bool(interpret and float_dtype == "bfloat16")}
    if algorithm == "tokens":
        const.update(BN=BN, BS=_pow2(BN * top_k))
        return const, 4
    slots = int(N or 1) * int(top_k)
    const.update(BM=_pow2(-(-slots // max(1, int(E))), hi=MAX_BM), BS=_pow2(slots, hi=MAX_BS))
    return const, 8 if const["BM"] >= 32 else 4


def launch(algorithm: str, N, E: int, I: int, const: dict, cdiv=lambda a, b: -(-a // b)) -> tuple[tuple, tuple]:
    """(grid, int32 scalars). "tokens": grid (cdiv(N, BN), 1, 1); "experts": grid (E, cdiv(I, BI), 1). Scalars (N,).
    A symbolic N needs the caller's `cdiv` (``tensorrt.plugin.cdiv``)."""
    if algorithm == "tokens":
        return (cdiv(N, const["BN"]), 1, 1), (N,)
    return (E, -(-I // const["BI"]), 1), (N,)


def aot_config(kernel: str, float_dtype: str, attrs: dict, dims: dict):
    """(jit function, constexprs, num_warps) of a plugin kernel: the "tokens" kernel with E, I, D, top_k, act and
    the betas baked in."""
    fp4 = kernel in ("moe_experts_mxfp4", "moe_experts_nvfp4")
    const, num_warps = config("tokens", int(dims["E"]), int(dims["I"]), int(dims["D"]), int(dims["top_k"]),
                              attrs["act"], attrs["beta1"], attrs["beta2"], float_dtype, mxfp4=fp4)
    fn = {"moe_experts_mxfp4": moe_experts_mxfp4_kernel, "moe_experts_nvfp4": moe_experts_nvfp4_kernel}
    return fn.get(kernel, moe_experts_kernel), const, num_warps


def moe_experts_triton(z, weights, indices, w1, w3, w2, act: str, beta1: float, beta2: float, w1_scale=None,
                       w3_scale=None, w2_scale=None, algorithm: str = "experts", scale_2=None):
    """The Triton backend (dense, or MXFP4 when the scales are given: w* then hold the packed bytes). "experts" is
    the op's kernel; "tokens" the TensorRT plugin's (for tests and benchmarks). `scale_2`: NVFP4 (the "experts"
    kernel only): (w1, w3, w2) fp32 global scales [E], with E4M3 scales (float8_e4m3fn or their uint8 bytes)
    [E, out, in/16] (`spec.MOE_EXPERTS_NVFP4`)."""
    if not HAVE_TRITON:
        raise RuntimeError("the Triton moe_experts kernels need the `triton` package")
    mxfp4 = w1_scale is not None
    nvfp4 = scale_2 is not None
    if nvfp4:
        w1_scale, w3_scale, w2_scale = (s.view(torch.uint8) for s in (w1_scale, w3_scale, w2_scale))
        scale_2 = tuple(g.to(torch.float32).contiguous() for g in scale_2)
    z, weights, indices, w1, w3, w2 = (t.contiguous() for t in (z, weights, indices, w1, w3, w2))
    N, D = z.shape
    E, I = w1.shape[0], w1.shape[1]
    u = (torch.empty if algorithm == "tokens" else torch.zeros)(N, D, dtype=torch.float32, device=z.device)
    if N == 0:
        return u.zero_()
    const, num_warps = config(algorithm, E, I, D, indices.shape[1], act, beta1, beta2,
                              dtypes.dtype(z.dtype).name, N, mxfp4, backend.triton_interpret() and not z.is_cuda)
    grid, scalars = launch(algorithm, N, E, I, const)
    scales = tuple(t.contiguous() for t in (w1_scale, w3_scale, w2_scale)) if mxfp4 else (w1, w3, w2)
    if algorithm == "tokens":
        kernel = moe_experts_nvfp4_kernel if nvfp4 else moe_experts_mxfp4_kernel if mxfp4 else moe_experts_kernel
        kernel[grid](z, weights, indices, w1, w3, w2, *(scales if mxfp4 else ()), *(scale_2 or ()), *scalars, u,
                     num_warps=num_warps, **const)
    else:
        g1, g3, g2 = scale_2 or (w1, w3, w2)
        moe_experts_experts_kernel[grid](z, weights, indices, w1, w3, w2, *scales, *scalars, u, g1_ptr=g1, g3_ptr=g3,
                                         g2_ptr=g2, MXFP4=mxfp4, NVFP4=nvfp4, num_warps=num_warps, **const)
    return u


@torch.library.custom_op("k3::moe_experts", mutates_args=())
def _moe_experts_op(z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor,
                    w3: torch.Tensor, w2: torch.Tensor, act: str, beta1: float, beta2: float) -> torch.Tensor:
    check_tensors(MOE_EXPERTS, z, weights, indices, w1, w3, w2, act=act, beta1=beta1, beta2=beta2)
    if backend.resolve(z) == "torch":
        return moe_experts_naive(z, weights, indices, w1, w3, w2, act, beta1, beta2, dtype=torch.float32)
    return moe_experts_triton(z, weights, indices, w1, w3, w2, act, beta1, beta2)


@_moe_experts_op.register_fake
def _(z, weights, indices, w1, w3, w2, act, beta1, beta2):
    return z.new_empty(z.shape[0], z.shape[1], dtype=torch.float32)


@torch.library.custom_op("k3::moe_experts_mxfp4", mutates_args=())
def _moe_experts_mxfp4_op(z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor,
                          w3: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor, w3_scale: torch.Tensor,
                          w2_scale: torch.Tensor, act: str, beta1: float, beta2: float) -> torch.Tensor:
    check_tensors(MOE_EXPERTS_MXFP4, z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, act=act,
                  beta1=beta1, beta2=beta2)
    if backend.resolve(z) == "torch":
        return moe_experts_mxfp4_naive(z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, act, beta1,
                                       beta2, dtype=torch.float32)
    return moe_experts_triton(z, weights, indices, w1, w3, w2, act, beta1, beta2, w1_scale, w3_scale, w2_scale)


@_moe_experts_mxfp4_op.register_fake
def _(z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, act, beta1, beta2):
    return z.new_empty(z.shape[0], z.shape[1], dtype=torch.float32)


@torch.library.custom_op("k3::moe_experts_nvfp4", mutates_args=())
def _moe_experts_nvfp4_op(z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: torch.Tensor,
                          w3: torch.Tensor, w2: torch.Tensor, w1_scale: torch.Tensor, w3_scale: torch.Tensor,
                          w2_scale: torch.Tensor, w1_scale_2: torch.Tensor, w3_scale_2: torch.Tensor,
                          w2_scale_2: torch.Tensor, act: str, beta1: float, beta2: float) -> torch.Tensor:
    # the E4M3 scales may come as their bytes (TensorRT holds them as int8): the same bits
    scales = tuple(s if s.dtype == torch.float8_e4m3fn else s.view(torch.uint8).view(torch.float8_e4m3fn)
                   for s in (w1_scale, w3_scale, w2_scale))
    scale_2 = (w1_scale_2, w3_scale_2, w2_scale_2)
    check_tensors(MOE_EXPERTS_NVFP4, z, weights, indices, w1, w3, w2, *scales, *scale_2, act=act, beta1=beta1,
                  beta2=beta2)
    if backend.resolve(z) == "torch":
        return moe_experts_nvfp4_naive(z, weights, indices, w1, w3, w2, *scales, *scale_2, act, beta1, beta2,
                                       dtype=torch.float32)
    return moe_experts_triton(z, weights, indices, w1, w3, w2, act, beta1, beta2, *scales, scale_2=scale_2)


@_moe_experts_nvfp4_op.register_fake
def _(z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, w1_scale_2, w3_scale_2, w2_scale_2, act, beta1,
      beta2):
    return z.new_empty(z.shape[0], z.shape[1], dtype=torch.float32)


def moe_experts(z, weights, indices, w1, w3, w2, act: str = "situ", beta1: float = 4.0, beta2: float = 25.0):
    """``torch.ops.k3.moe_experts`` with K3's defaults (SiTU-GLU, beta1 = 4, beta2 = 25): fp32 [N, D]."""
    return torch.ops.k3.moe_experts(z, weights, indices, w1, w3, w2, act, float(beta1), float(beta2))


def moe_experts_mxfp4(z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, act: str = "situ",
                      beta1: float = 4.0, beta2: float = 25.0):
    """``torch.ops.k3.moe_experts_mxfp4`` (packed E2M1 weights + E8M0 scales) with K3's defaults: fp32 [N, D]."""
    return torch.ops.k3.moe_experts_mxfp4(z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, act,
                                          float(beta1), float(beta2))
