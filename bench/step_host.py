"""Where a decode step's time goes between the runtime and the host: the runtime's own call (ONNX Runtime's
``run_with_iobinding`` / ``run``, OpenVINO's ``infer``) against everything around it (k3export's Python: the feeds,
the IO binding, the output buffers, the greedy choice).

    python bench/step_host.py EXPORT_DIR                           # ort and openvino, prompt 64, 2 threads
    python bench/step_host.py EXPORT_DIR --runtimes ort --steps 200 --rounds 7

Each round decodes `--steps` greedy steps after a `--prompt`-token prefill with every runtime in turn (one runner
each, loaded once, all in this process), timing each step and the runtime calls inside it. The table has the
medians over rounds of the per-step means: the step, the runtime's call, and the rest, which the runtime's kernels
do not see (it includes the Python running on caches the step has just flushed). Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

CALLS: dict[str, list[tuple[str, str]]] = {
    # runtime: (module, "Class.method") of the calls that run the graph
    "ort": [("onnxruntime", "InferenceSession.run_with_iobinding"), ("onnxruntime", "InferenceSession.run")],
    "openvino": [("openvino", "InferRequest.infer")],
}


@contextmanager
def timed_calls(runtime: str, spent: list[float]) -> Iterator[None]:
    """Every call of `runtime`'s graph-running methods adds its seconds to ``spent[0]`` while inside."""
    import importlib

    saved: list[tuple[Any, str, Callable]] = []
    for module, path in CALLS[runtime]:
        cls_name, method = path.split(".")
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, method)

        def wrapper(self, *args, _original=original, **kwargs):
            t = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t

        saved.append((cls, method, original))
        setattr(cls, method, wrapper)
    try:
        yield
    finally:
        for cls, method, original in saved:
            setattr(cls, method, original)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", help="an export folder (the functions form `export` writes)")
    ap.add_argument("--runtimes", default="ort,openvino", help=f"comma list of {', '.join(CALLS)}")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    runtimes = args.runtimes.split(",")
    if not set(runtimes) <= set(CALLS):
        ap.error(f"--runtimes takes {', '.join(CALLS)}")

    import numpy as np

    from k3export.runtime import Decoding, OrtRunner, next_tokens
    from k3export.runtime.openvino_runner import OpenVinoRunner

    runners = {"ort": lambda: OrtRunner(args.export, threads=args.threads),
               "openvino": lambda: OpenVinoRunner(args.export, threads=args.threads)}
    loaded = {name: runners[name]() for name in runtimes}
    prompt = np.random.default_rng(0).integers(3, 4000, (1, args.prompt))
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in runtimes}
    for r in range(args.rounds):
        for name in (runtimes if r % 2 == 0 else runtimes[::-1]):
            runner = loaded[name]
            runner.logits_to_keep = 1
            dec = Decoding(runner)
            tok = next_tokens(dec.feed(prompt))
            tok = next_tokens(dec.feed(tok[:, None]))  # one step untimed: the step's buffers settle
            spent = [0.0]
            with timed_calls(name, spent):
                t = time.perf_counter()
                for _ in range(args.steps):
                    tok = next_tokens(dec.feed(tok[:, None]))
                total = time.perf_counter() - t
            rows[name].append((total / args.steps, spent[0] / args.steps))
    print(f"{args.export}: prompt {args.prompt}, {args.steps} greedy steps, {args.threads} threads, medians of "
          f"{args.rounds} interleaved rounds")
    print("| runtime | step ms | the runtime's call ms | outside it us | outside, of the step |")
    print("|---|---:|---:|---:|---:|")
    for name in runtimes:
        step = statistics.median(s for s, _ in rows[name])
        call = statistics.median(c for _, c in rows[name])
        rest = statistics.median(s - c for s, c in rows[name])
        print(f"| {loaded[name].describe()} | {step * 1e3:.3f} | {call * 1e3:.3f} | {rest * 1e6:.0f} | "
              f"{rest / step:.1%} |")


if __name__ == "__main__":
    main()
