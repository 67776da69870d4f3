"""Kernel benchmarks for k3export.ops (CUDA only).

    python bench/kernels.py [--heads 96] [--dim 128] [--prefill 4096] [--batches 1,8,32]

Prints, from one run: the k3::kda decode step (fused recurrent kernel) and prefill (chunked
kernel) against the modeling file's PyTorch code and, when importable, flash-linear-attention's
fused_recurrent_kda / chunk_kda (ratios = their time / ours); the decode kernel's achieved
memory bandwidth as a fraction of peak (default peak 4.8 TB/s, H200); SiTU-GLU and moe_route
against their torch references. On a machine without CUDA it exits with a message (code 2).
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


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to measure here.",
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
