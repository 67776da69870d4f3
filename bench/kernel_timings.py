"""Kernel benchmarks for k3export.ops (CUDA only).

    python bench/kernel_timings.py [--heads 96] [--dim 128] [--prefill 4096] [--batches 1,8,32]

Prints, from one run: the k3::kda decode step (fused recurrent kernel) and prefill (chunked
kernel) against the modeling file's PyTorch code and, when importable, flash-linear-attention's
fused_recurrent_kda / chunk_kda (ratios = their time / ours); the decode kernel's achieved
memory bandwidth as a fraction of peak (default peak 4.8 TB/s, H200); SiTU-GLU and moe_route
against their torch references; k3::moe_experts (bf16 and MXFP4 experts, both kernels: the op's
expert-parallel one and the TensorRT plugin's token-block one) against the modeling file's grouped
PyTorch code, with the achieved bandwidth of the expert weights read (each selected expert once) as a
fraction of peak. On a machine without CUDA it exits with a message (code 2).
"""

from __future__ import annotations

import argparse
import sys


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--dim", type=int, default=128, help="head dim K = V")
    p.add_argument("--prefill", type=int, default=4096, help="prefill length T")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    p.add_argument("--peak-tbps", type=float, default=4.8, help="peak HBM bandwidth in TB/s (H200: 4.8)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens for situ_glu / moe_route")
    p.add_argument("--experts", type=int, default=256, help="routed experts E for moe_experts (K3: 896)")
    p.add_argument("--expert-dims", default="3072,3584", help="moe_experts I,D (K3: intermediate 3072, latent 3584)")
    p.add_argument("--top-k", type=int, default=16, help="experts per token for moe_experts (K3: 16)")
    p.add_argument("--moe-tokens", default="1,8,64,512", help="token counts for moe_experts")
    return p.parse_args(argv)


def _bench(fn, reps=50):
    import torch

    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=reps) * 1e-3
    except Exception:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps * 1e-3


def _fla():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda  # type: ignore

        return chunk_kda, fused_recurrent_kda
    except Exception:
        return None, None


def _inputs(B, T, H, D, dtype, device="cuda"):
    import torch

    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=device, dtype=dtype)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, D, device=device) - 2)
    beta = torch.sigmoid(torch.randn(B, T, H, device=device))
    h0 = torch.randn(B, H, D, D, device=device) * 0.1
    return q, k, v, g, beta, h0


def _fla_call(fn, q, k, v, g, beta, h0, scale):
    return fn(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=True)


def _expert_bytes(indices, I, D, mxfp4):
    """Bytes of the expert weights a call must read: every distinct selected expert's w1, w3, w2 once (MXFP4: the
    packed bytes and the E8M0 scales)."""
    n = int(indices.unique().numel())
    per = 3 * I * D * (0.5 + 1 / 32) if mxfp4 else 3 * I * D * 2
    return n, n * per


def bench_moe_experts(args, peak: float) -> None:
    """k3::moe_experts on bf16 and MXFP4 experts: both Triton kernels, the modeling file's grouped PyTorch code,
    and the achieved bandwidth of the expert weights read."""
    import sys as _sys

    import torch

    import k3export.ops.registry  # noqa: F401
    from k3export.modeling.modeling_k3 import moe_experts as moe_modeling
    from k3export.ops.naive import mxfp4_dequant_naive

    experts = _sys.modules["k3export.ops.moe_experts"]
    E, k = args.experts, args.top_k
    I, D = (int(x) for x in args.expert_dims.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = (torch.empty(E, I, D, device="cuda", dtype=torch.bfloat16).normal_(0, D ** -0.5, generator=gen)
              for _ in range(2))
    w2 = torch.empty(E, D, I, device="cuda", dtype=torch.bfloat16).normal_(0, I ** -0.5, generator=gen)
    packed = [torch.randint(0, 256, (E, o, i // 2), device="cuda", dtype=torch.uint8, generator=gen)
              for o, i in ((I, D), (I, D), (D, I))]
    scales = [torch.randint(118, 124, (E, o, i // 32), device="cuda", dtype=torch.uint8, generator=gen)
              for o, i in ((I, D), (I, D), (D, I))]
    print(f"\n== moe_experts (E={E}, I={I}, D={D}, top-{k}, SiTU-GLU; bf16 z) ==")
    for N in [int(t) for t in args.moe_tokens.split(",") if t]:
        z = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        indices = torch.rand(N, E, device="cuda", generator=gen).topk(k, dim=-1).indices
        weights = torch.rand(N, k, device="cuda", generator=gen)
        attrs = ("situ", 4.0, 25.0)
        t_ref = _bench(lambda: moe_modeling.fallback(z, weights, indices, w1, w3, w2, *attrs), reps=10)
        ref = moe_modeling.fallback(z, weights, indices, w1, w3, w2, *attrs)
        for fmt in ("bf16", "mxfp4"):
            mx = fmt == "mxfp4"
            n_sel, nbytes = _expert_bytes(indices, I, D, mx)
            ws = (*packed, *scales) if mx else (w1, w3, w2)
            if mx:  # the reference on the dequantised selected experts (only for checking)
                sel = indices.unique()
                deq = [mxfp4_dequant_naive(w[sel], s[sel], torch.bfloat16) for w, s in zip(packed, scales)]
                ref_fmt = moe_modeling.fallback(z, weights, torch.searchsorted(sel, indices), *deq, *attrs)
                del deq
            else:
                ref_fmt = ref
            for algorithm in experts.ALGORITHMS:
                def run(algorithm=algorithm):
                    return experts.moe_experts_triton(z, weights, indices, *ws[:3], *attrs, *ws[3:],
                                                      algorithm=algorithm)
                t = _bench(run, reps=20)
                out = run()
                rel = float((out - ref_fmt).norm() / ref_fmt.norm().clamp_min(1e-30))
                bw = nbytes / t
                print(f"N={N:4d} {fmt:5s} {algorithm:7s}: {t * 1e6:9.1f} us  {n_sel:4d} experts read, "
                      f"{nbytes / 1e9:7.3f} GB -> {bw / 1e12:5.2f} TB/s = {bw / peak:6.1%} of peak  "
                      f"(torch grouped bf16 / ours {t_ref / t:6.2f}x; rel err {rel:.1e})")
        del z


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/kernel_timings.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to measure here.",
              file=sys.stderr)
        return 2
    import functools

    from k3export.modeling.modeling_k3 import kda_chunked as kda_chunk_torch, kda_recurrent as kda_recurrent_torch
    from k3export.ops.kda import kda_triton
    from k3export.ops.moe_route import moe_route_triton
    from k3export.ops.naive import moe_route_naive, situ_glu_naive
    from k3export.ops.situ_glu import situ_glu_triton

    kda_recurrent_triton = functools.partial(kda_triton, algorithm="recurrent")
    kda_chunk_triton = functools.partial(kda_triton, algorithm="chunk")
    situ_glu_torch = functools.partial(situ_glu_naive, dtype=torch.float32)

    torch.manual_seed(0)
    H, D = args.heads, args.dim
    scale = D ** -0.5
    chunk_fla, rec_fla = _fla()
    print(f"device: {torch.cuda.get_device_name()}  H={H} K=V={D}  fla: {'yes' if rec_fla else 'not importable'}")

    print("\n== kda decode step (T=1, bf16 q/k/v, fp32 state) ==")
    for B in [int(b) for b in args.batches.split(",") if b]:
        inp = _inputs(B, 1, H, D, torch.bfloat16)
        t_ours = _bench(lambda: kda_recurrent_triton(*inp, scale))
        t_ref = _bench(lambda: kda_recurrent_torch(*inp, scale))
        # bytes: state read + write (fp32) + q, k, g (fp32), v, o, beta
        nbytes = B * H * D * D * 4 * 2 + B * H * D * (2 + 2 + 4 + 2 + 2) + B * H * 4
        bw = nbytes / t_ours
        line = (f"B={B:3d}: ours {t_ours * 1e6:8.1f} us  torch {t_ref * 1e6:8.1f} us  (torch/ours {t_ref / t_ours:6.2f}x)"
                f"  bandwidth {bw / 1e12:5.2f} TB/s = {bw / (args.peak_tbps * 1e12):5.1%} of peak")
        if rec_fla is not None:
            try:
                t_fla = _bench(lambda: _fla_call(rec_fla, *inp, scale))
                line += f"  fla {t_fla * 1e6:8.1f} us (fla/ours {t_fla / t_ours:5.2f}x)"
            except Exception as e:  # report, keep going
                line += f"  fla failed: {type(e).__name__}: {e}"
        print(line)

    print(f"\n== kda prefill (B=1, T={args.prefill}) ==")
    for dtype in (torch.bfloat16, torch.float32):
        inp = _inputs(1, args.prefill, H, D, dtype)
        t_ours = _bench(lambda: kda_chunk_triton(*inp, scale), reps=10)
        t_ref = _bench(lambda: kda_chunk_torch(*inp, scale), reps=3)
        tok_s = args.prefill / t_ours
        line = (f"{str(dtype):15s}: ours {t_ours * 1e3:8.2f} ms ({tok_s:,.0f} tok/s)  torch {t_ref * 1e3:8.2f} ms"
                f"  (torch/ours {t_ref / t_ours:6.2f}x)")
        if chunk_fla is not None:
            try:
                t_fla = _bench(lambda: _fla_call(chunk_fla, *inp, scale), reps=10)
                line += f"  fla {t_fla * 1e3:8.2f} ms (fla/ours {t_fla / t_ours:5.2f}x)"
            except Exception as e:
                line += f"  fla failed: {type(e).__name__}: {e}"
        print(line)
        o1, s1 = kda_chunk_triton(*inp, scale)
        o2, s2 = kda_chunk_torch(*inp, scale)
        rel = float((o1.float() - o2.float()).norm() / o2.float().norm())
        print(f"{'':15s}  ours vs torch chunk: rel err o {rel:.2e}")

    print(f"\n== situ_glu ([{args.tokens}, 3072] bf16) ==")
    gate = torch.randn(args.tokens, 3072, device="cuda", dtype=torch.bfloat16) * 4
    up = torch.randn_like(gate) * 4
    t_ours = _bench(lambda: situ_glu_triton(gate, up, 4.0, 25.0))
    t_ref = _bench(lambda: situ_glu_torch(gate, up, 4.0, 25.0))
    bw = gate.numel() * 2 * 3 / t_ours
    print(f"ours {t_ours * 1e6:8.1f} us  torch {t_ref * 1e6:8.1f} us  (torch/ours {t_ref / t_ours:5.2f}x)"
          f"  bandwidth {bw / 1e12:5.2f} TB/s = {bw / (args.peak_tbps * 1e12):5.1%} of peak")

    print(f"\n== moe_route ([{args.tokens}, 896] fp32, top-16) ==")
    logits = torch.randn(args.tokens, 896, device="cuda")
    bias = torch.randn(896, device="cuda") * 0.1
    t_ours = _bench(lambda: moe_route_triton(logits, bias, 16, True, 1.0))
    t_ref = _bench(lambda: moe_route_naive(logits, bias, 16, True, 1.0))
    w1, i1 = moe_route_triton(logits, bias, 16, True, 1.0)
    w2, i2 = moe_route_naive(logits, bias, 16, True, 1.0)
    print(f"ours {t_ours * 1e6:8.1f} us  torch {t_ref * 1e6:8.1f} us  (torch/ours {t_ref / t_ours:5.2f}x)"
          f"  indices equal: {bool(torch.equal(i1, i2))}")

    bench_moe_experts(args, args.peak_tbps * 1e12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
