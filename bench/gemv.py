"""One fp32 row times a weight on CPU in PyTorch eager, every form side by side (what `K3Linear`'s decode uses).

    python bench/gemv.py                 # the big_cfg projection shapes, 2 threads, 9 interleaved rounds
    python bench/gemv.py --threads 1 --rounds 15
    python bench/gemv.py --big           # Kimi-Linear-48B's MLP shapes (170 MB)

A decode step multiplies one row by each of ~84 MB of projection weights, which do not fit in cache, so every
form streams its weights from memory: the weights here are ~110 MB of the model's shapes, read once per round.
``read`` (``w.sum(-1)``: one pass, no multiply) is the memory's own pace, the ceiling of a one-pass product.
Prints GB/s of weights per form and its ratio to `K3Linear`'s (``embedding_bag`` bags over the weight stored
[in, out], `k3export.ops.cpu_bags.row_linear`). Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from k3export.ops.cpu_bags import row_linear as _row_linear  # K3Linear's one-row product on CPU

#: [out, in] and count: shapes of big_cfg's decode projections, about 110 MB of fp32
SHAPES = [((512, 512), 40), ((1024, 512), 20), ((512, 1024), 10), ((4096, 512), 1)]
#: Kimi-Linear-48B's MLP, about 170 MB: past a few MB vecdot's weight-sized temporary gets fresh pages every call
BIG_SHAPES = [((9216, 2304), 1), ((2304, 9216), 1)]


def forms(ws: list[torch.Tensor], wts: list[torch.Tensor],
          xs: dict[int, torch.Tensor]) -> dict[str, Callable[[], None]]:
    """name -> one pass over every weight; `wts` are the same weights stored transposed ([in, out])."""
    try:  # oneDNN's own blocked layout for a one-row input
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
    except (RuntimeError, AttributeError):
        packed = []

    def each(fn: Callable[[torch.Tensor, torch.Tensor], object], weights: list[torch.Tensor], dim: int):
        return lambda: [fn(w, xs[w.shape[dim]]) for w in weights]

    def onednn(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x[None], w, None, "none", [], "")

    found = {
        "read": each(lambda w, x: w.sum(-1), ws, 1),
        "vecdot": each(lambda w, x: torch.linalg.vecdot(w, x), ws, 1),
        "F.linear": each(lambda w, x: F.linear(x[None], w), ws, 1),
        "mv": each(lambda w, x: torch.mv(w, x), ws, 1),
        "x @ w.T stored": each(lambda w, x: x[None] @ w, wts, 0),
        "K3Linear (bags)": each(lambda w, x: _row_linear(x, w.t()), wts, 0),
        "conv1d": each(lambda w, x: F.conv1d(w.view(w.shape[0], 1, -1), x.view(1, 1, -1)), ws, 1),
        "oneDNN linear": each(onednn, ws, 1),
    }
    if packed:
        found["oneDNN linear, packed"] = each(onednn, packed, 1)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--big", action="store_true", help="Kimi-Linear-48B's MLP shapes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(shape, generator=gen) for shape, n in (BIG_SHAPES if args.big else SHAPES)
          for _ in range(n)]
    wts = [w.t().contiguous() for w in ws]
    xs = {n: torch.randn(n, generator=gen) for n in {w.shape[1] for w in ws}}
    mb = sum(w.numel() for w in ws) * 4 / 1e6
    ref = ws[0].double() @ xs[ws[0].shape[1]].double()
    err = float((_row_linear(xs[ws[0].shape[1]], wts[0].t()).double() - ref).abs().max())
    fns = forms(ws, wts, xs)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in list(fns.items()):
        try:
            fn()
        except (RuntimeError, IndexError) as e:  # e.g. a torch without oneDNN
            print(f"{name}: unavailable ({str(e).splitlines()[0][:80]})")
            del fns[name], times[name]
    for _ in range(args.rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["K3Linear (bags)"])
    print(f"{mb:.0f} MB of fp32 weights, {args.threads} threads, medians of {args.rounds} interleaved rounds "
          f"(K3Linear max |error| vs float64 {err:.1e})")
    print("| form | ms | GB/s | speed x K3Linear |\n|---|---:|---:|---:|")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {t * 1e3:.2f} | {mb / t / 1e3:.1f} | {base / t:.2f} |")


if __name__ == "__main__":
    main()
