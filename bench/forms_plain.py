"""Each graph form's export on a bare ``onnxruntime.InferenceSession(path)``: default session options, no k3 library,
no k3export in the loop (what a user without k3export runs), fed the manifest's inputs.

    python bench/forms_plain.py DIR [DIR ...]                    # prompt 64, then 32 greedy steps, 5 rounds
    python bench/forms_plain.py DIR DIR --steps 64 --rounds 7

The exports are timed in interleaved rounds (each round runs every export once: a prefill, then greedy decode steps
with the presents fed back); medians of prefill ms and decode ms a step, and whether each export's greedy tokens
equal the first one's. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def run(session, states: list[dict], prompt: int, steps: int) -> tuple[float, float, list[int]]:
    """(prefill ms, decode ms a step, greedy tokens) of one prefill of `prompt` tokens and `steps` decode steps."""
    import numpy as np

    state = {s["name"]: np.zeros([1 if d == "batch" else 0 if isinstance(d, str) else d for d in s["shape"]],
                                 s["dtype"]) for s in states}
    presents = [s["present"] for s in states]
    ids, seen = (np.arange(prompt)[None] * 7 + 3) % 4000, prompt
    t0 = time.perf_counter()
    out = session.run(["logits", *presents], {"input_ids": ids, "attention_mask": np.ones((1, seen), np.int64), **state})
    prefill = time.perf_counter() - t0
    tokens = []
    t1 = time.perf_counter()
    for _ in range(steps):
        state, ids = dict(zip(state, out[1:])), out[0][:, -1:].argmax(-1)
        tokens.append(int(ids[0, 0]))
        seen += 1
        out = session.run(["logits", *presents], {"input_ids": ids, "attention_mask": np.ones((1, seen), np.int64),
                                                  **state})
    return prefill * 1e3, (time.perf_counter() - t1) / max(steps, 1) * 1e3, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", type=Path)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import onnxruntime as ort

    sessions = {d: (ort.InferenceSession(str(d / "model.onnx")),
                    json.loads((d / "state_manifest.json").read_text())["states"]) for d in args.exports}
    times: dict[Path, list[tuple[float, float]]] = {d: [] for d in args.exports}
    tokens: dict[Path, list[int]] = {}
    for _ in range(args.rounds):
        for d, (session, states) in sessions.items():
            prefill, step, tokens[d] = run(session, states, args.prompt, args.steps)
            times[d].append((prefill, step))
    first = tokens[args.exports[0]]
    print(f"| export | form | prefill {args.prompt} ms | decode ms a step | tokens = first's |")
    print("|---|---|---:|---:|---|")
    for d in args.exports:
        form = json.loads((d / "runtime_config.json").read_text()).get("graph_form", "functions")
        print(f"| {d.name} | {form} | {statistics.median(t[0] for t in times[d]):.1f} | "
              f"{statistics.median(t[1] for t in times[d]):.2f} | {tokens[d] == first} |")


if __name__ == "__main__":
    main()
