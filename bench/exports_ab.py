"""Two or more exports' decode and prefill side by side, their sessions in one process, in both loading orders.

    python bench/exports_ab.py DIR_A DIR_B                        # ONNX Runtime + k3 ops library, prompt 64
    python bench/exports_ab.py DIR_A DIR_B --runtime openvino --prompt 512 --blocks 100
    python bench/exports_ab.py DIR DIR --pages 4k,2m              # one export, its weights in 4 KiB or 2 MiB pages
    python bench/exports_ab.py UNFUSED_DIR DIR                    # an export without the fused ops (--no-kernels)

Separate processes, interleaved, do not resolve a few percent on a shared host whose pace drifts within minutes.
Here every export gets its own runner in one process (`make_runner`, every core), and decode steps run in
alternating blocks (A B B A ..., a 20 ms pause before each block so that the other session's spinning threads park,
the first step of a block not counted; a decoding restarts from the prompt after 200 steps), then prefills alternate
the same way. The session loaded second ran ~5% faster in either role here, so the whole run is done twice, in each
loading order, each in its own subprocess, and each export's figure is the mean over the two orders of its median
over the first export's. `--pages`: each session's resident memory in the system's 4 KiB pages or collapsed into
2 MiB ones (`k3export.runtime.pages.huge_pages`, what sessions do by default), the 4k sessions' memory told apart by
the address spans that appeared while they loaded. The fused ops are the exporter's choice (`k3export export
--kernels/--no-kernels`): compare an export written without them to one with them. Greedy tokens are not compared
(`validate` and the peers bench do).
Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

#: the runtimes (`k3export.runtime.RUNNERS`) that run an export folder on CPU
ONNX_RUNTIMES = ["ort", "openvino", "openvino-stateless", "openvino-decode-graph"]
#: decode steps a block (the first not counted), and steps before a decoding restarts from the prompt
BLOCK, RESTART = 8, 200


PAGES = ("4k", "2m")


def load(exports: list[str], runtime: str, pages: list[str]) -> list:
    """A runner of each export, in order, the memory of those whose `pages` is 4k left in 4 KiB pages."""
    import os

    from k3export.runtime import Target, make_runner
    from k3export.runtime import pages as mem

    os.environ[mem.ENV_SWITCH] = "0"  # the sessions' own collapse would take every session's memory
    runners, small = [], []
    for e, p in zip(exports, pages):
        before = mem.anonymous_memory()
        runners.append(make_runner(runtime, Target(onnx_dir=e)))
        if p == "4k":
            small += [part for span in mem.anonymous_memory() for part in mem.without(span, before)]
    mem.huge_pages(skip=small)
    return runners


def measure(exports: list[str], runtime: str, prompt_len: int, blocks: int, prefills: int,
            pages: list[str]) -> list[list[float]]:
    """[median decode ms a step, median prefill ms] of each export, with every export's session in this process."""
    import numpy as np

    from k3export.runtime import Decoding, next_tokens

    runners = load(exports, runtime, pages)
    for r in runners:
        r.logits_to_keep = 1
    prompt = np.random.default_rng(0).integers(3, 4000, (1, prompt_len))

    def start(r):
        dec = Decoding(r)
        return dec, next_tokens(dec.feed(prompt))

    live = [start(r) for r in runners]
    steps: list[list[float]] = [[] for _ in exports]
    fills: list[list[float]] = [[] for _ in exports]
    for b in range(blocks + prefills):
        for i in (range(len(exports)) if b % 2 == 0 else reversed(range(len(exports)))):
            time.sleep(0.02)
            if b >= blocks:  # the prefills, after the decode blocks
                t = time.perf_counter()
                next_tokens(Decoding(runners[i]).feed(prompt))
                fills[i].append(time.perf_counter() - t)
                continue
            dec, tok = live[i]
            if dec.mask.shape[1] > prompt_len + RESTART:
                dec, tok = start(runners[i])
            for s in range(BLOCK):
                t = time.perf_counter()
                tok = next_tokens(dec.feed(tok[:, None]))
                if s:
                    steps[i].append(time.perf_counter() - t)
            live[i] = (dec, tok)
    return [[1e3 * statistics.median(steps[i]), 1e3 * statistics.median(fills[i]) if fills[i] else float("nan")]
            for i in range(len(exports))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", help="export folders (the first is the baseline)")
    ap.add_argument("--runtime", choices=ONNX_RUNTIMES, default="ort")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=150, help="decode blocks per export and loading order")
    ap.add_argument("--prefills", type=int, default=20, help="prefills per export and loading order")
    ap.add_argument("--pages", default=None,
                    help="comma list, one per export: 4k (the system's pages) or 2m (collapsed: the default)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    pages = args.pages.split(",") if args.pages else ["2m"] * len(args.exports)
    if len(pages) != len(args.exports) or not set(pages) <= set(PAGES):
        ap.error(f"--pages takes one of {PAGES} per export")
    if args.worker:
        print(json.dumps(measure(args.exports, args.runtime, args.prompt, args.blocks, args.prefills, pages)))
        return
    if len(args.exports) < 2:
        ap.error("give two or more export folders")
    runs = []
    for order in (list(range(len(args.exports))), list(range(len(args.exports)))[::-1]):
        cmd = [sys.executable, __file__, *(args.exports[i] for i in order), "--worker", "--runtime", args.runtime,
               "--prompt", str(args.prompt), "--blocks", str(args.blocks), "--prefills", str(args.prefills),
               "--pages", ",".join(pages[i] for i in order)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"the run in order {order} failed:\n{out.stderr[-3000:]}")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append({i: got[k] for k, i in enumerate(order)})
    labels = [f"{e} ({p} pages)" if args.pages else e for e, p in zip(args.exports, pages)]
    print(f"{args.runtime}, prompt {args.prompt}, every core; decode: medians of {args.blocks} blocks of {BLOCK - 1} "
          f"steps, prefill: of {args.prefills} calls, per loading order")
    print("| export | decode ms, loaded in order | in reverse | x first (mean of orders) | prefill ms, in order "
          "| in reverse | x first |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, e in enumerate(labels):
        (d0, p0), (d1, p1) = runs[0][i], runs[1][i]
        dx = statistics.mean([runs[k][i][0] / runs[k][0][0] for k in (0, 1)])
        px = statistics.mean([runs[k][i][1] / runs[k][0][1] for k in (0, 1)])
        print(f"| {e} | {d0:.3f} | {d1:.3f} | {dx:.3f} | {p0:.2f} | {p1:.2f} | {px:.3f} |")


if __name__ == "__main__":
    main()
