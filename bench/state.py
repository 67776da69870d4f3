"""Kept state, measured side by side on ONNX Runtime CPU: prompt-lookup speculation vs plain greedy decode (rejected
drafts taken back by feeding the accepted tokens again, and through an export's state window), the time to first
token with a cached system prompt vs without, and the bytes of a saved state per token of context.

    python bench/state.py                       # big_cfg.json (random weights) fp32 export, 3 interleaved rounds
    python bench/state.py --config tiny --rounds 5 --system 2048 --steps 128

Every variant runs in this one process, interleaved round by round (plain, speculative, plain, ...), so a machine
shared with other work slows both alike; medians are reported with each ratio. The weights are random: how often a
draft is accepted depends on the model (a random model's greedy output falls into loops that prompt lookup then
predicts; a trained model repeats a code-editing or summarising prompt), so the acceptance rate is printed beside
the speed-up. Speculation's tokens are checked equal to plain greedy decoding's on every round. Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

K = 4  # draft tokens per round, and the state window that takes them all back


def _model(config: str):
    import torch

    from k3export.modeling import K3ForCausalLM, tiny_model

    if config == "tiny":
        return tiny_model(seed=0), "tiny (K3Config.tiny, 6 layers, hidden 64)"
    from peers import BIG_CFG, bench_config  # bench/peers.py, beside this script

    cfg = bench_config(BIG_CFG)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    return model, f"big_cfg.json ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=("big", "tiny"), default="big")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=128, help="tokens generated per decode run")
    ap.add_argument("--system", type=int, default=2048, help="tokens of the cached system prompt")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from k3export.artifacts import State
    from k3export.converters.onnx import export_onnx
    from k3export.runtime.ort_runner import OrtRunner
    from k3export.runtime.loop import greedy_decode
    from k3export.runtime.speculate import PromptLookup, speculative_decode

    model, what = _model(args.config)
    vocab = model.config.vocab_size
    work = Path(tempfile.mkdtemp(prefix="k3export-bench-state-"))
    export_onnx(model, work / "onnx", dtype="fp32")
    export_onnx(model, work / "window", dtype="fp32", state_window=K)
    runner = OrtRunner(work / "onnx", threads=args.threads)
    windowed = OrtRunner(work / "window", threads=args.threads)
    runner.logits_to_keep = windowed.logits_to_keep = 1
    rng = np.random.default_rng(0)
    block = rng.integers(3, vocab, 48).tolist()  # a text given to edit or summarise: repeated in the prompt
    prompt = block * 4 + block[:16]
    system = rng.integers(3, vocab, args.system).tolist()
    question = rng.integers(3, vocab, 16).tolist()
    state_path = work / "system.k3state"
    runner.prefill(np.asarray([system], np.int64)).save(state_path)

    class Oracle(PromptLookup):
        """Proposes plain greedy decoding's own next tokens: every draft accepted (the verify path's ceiling)."""

        truth: list = []

        def propose(self, history, cur):  # noqa: ANN001, ANN202
            at = len(history) + 1 - len(prompt)
            return self.truth[at:at + self.k]

    plain_s, plain_w_s, spec_s, spec_w_s, oracle_s, accept, cold, warm = [], [], [], [], [], [], [], []
    calls = []
    for r in range(args.rounds):
        t = time.perf_counter()
        plain = greedy_decode(runner, np.asarray([prompt]), args.steps - 1)
        plain_s.append(plain.decode_seconds / (args.steps - 1))
        plain_w = greedy_decode(windowed, np.asarray([prompt]), args.steps - 1)  # what the window costs a step
        plain_w_s.append(plain_w.decode_seconds / (args.steps - 1))
        res = speculative_decode(runner, prompt, args.steps, set(), PromptLookup(k=K))
        res_w = speculative_decode(windowed, prompt, args.steps, set(), PromptLookup(k=K))
        for label, got in (("speculation", res), ("speculation with the state window", res_w),
                           ("plain decoding of the window export", plain_w)):
            tokens = got.tokens if isinstance(got.tokens, list) else got.tokens[0].tolist()
            if tokens != plain.tokens[0].tolist():
                raise SystemExit(f"round {r}: {label}'s tokens differ from plain greedy decoding's")
        spec_s.append(res.decode_seconds / (args.steps - 1))  # the first token comes from the prefill in both
        spec_w_s.append(res_w.decode_seconds / (args.steps - 1))
        calls.append((res.calls, res_w.calls, len(res.rounds)))
        accept.append(res.accepted / max(1, res.proposed))
        oracle = Oracle(k=K)
        oracle.truth = plain.tokens[0].tolist()
        best = speculative_decode(runner, prompt, args.steps, set(), oracle)
        if best.tokens != oracle.truth:
            raise SystemExit(f"round {r}: the oracle draft's tokens differ from plain greedy decoding's")
        oracle_s.append(best.decode_seconds / (args.steps - 1))
        t = time.perf_counter()  # time to first token: without the cache, the whole prompt
        runner.prefill(np.asarray([system + question], np.int64))
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()  # with it: read the state file, feed the question
        runner.prefill(np.asarray([question], np.int64), State.load(state_path, runner))
        warm.append(time.perf_counter() - t)
        print(f"round {r + 1}: plain {1 / plain_s[-1]:.1f} tok/s, prompt-lookup {1 / spec_s[-1]:.1f} tok/s "
              f"(accepted {accept[-1]:.0%}), with the state window {1 / spec_w_s[-1]:.1f} tok/s (plain decode of the "
              f"window export {1 / plain_w_s[-1]:.1f} tok/s), all-accepted draft {1 / oracle_s[-1]:.1f} tok/s, "
              f"TTFT {cold[-1] * 1e3:.0f} ms -> {warm[-1] * 1e3:.0f} ms", flush=True)

    sizes = {}
    for n in (args.system // 4, args.system):
        p = work / f"s{n}.k3state"
        runner.prefill(np.asarray([system[:n]], np.int64)).save(p)
        sizes[n] = p.stat().st_size
    lo, hi = sorted(sizes)
    med = statistics.median
    print(f"\nmodel: {what}, fp32 export, onnxruntime CPU, {args.threads} threads; machine shared with other work "
          f"(contended): each ratio is of medians over {args.rounds} interleaved rounds")
    print(f"decode, repetitive prompt of {len(prompt)} tokens, {args.steps} tokens: plain {1 / med(plain_s):.1f} "
          "tok/s, "
          f"prompt-lookup {1 / med(spec_s):.1f} tok/s -> {med(plain_s) / med(spec_s):.2f}x "
          f"(draft tokens accepted: {med(accept):.0%}; token-identical on every round); a draft always right (plain "
          f"greedy's own tokens, k={K}) {1 / med(oracle_s):.1f} tok/s -> {med(plain_s) / med(oracle_s):.2f}x")
    spec_calls, window_calls, rounds = calls[-1]
    print(f"state window (export --state-window {K}): prompt-lookup {1 / med(spec_w_s):.1f} tok/s -> "
          f"{med(plain_s) / med(spec_w_s):.2f}x plain, {med(spec_s) / med(spec_w_s):.2f}x prompt-lookup without it "
          f"({window_calls} calls for {rounds} verify rounds, against {spec_calls}); plain decoding of the window "
          f"export {med(plain_s) / med(plain_w_s):.2f}x as fast as of the plain export (its W + 1 kda calls per layer)")
    print(f"time to first token, {args.system}-token system prompt + {len(question)}-token question: "
          f"{med(cold) * 1e3:.0f} ms from scratch, {med(warm) * 1e3:.0f} ms from the saved state -> "
          f"{med(cold) / med(warm):.1f}x")
    print(f"saved state: {sizes[lo]} bytes at {lo} tokens, {sizes[hi]} bytes at {hi} tokens = "
          f"{sizes[hi] / hi:.0f} bytes per token of context; {(sizes[hi] - sizes[lo]) / (hi - lo):.0f} bytes per "
          f"added token (the MLA latent cache; the KDA state is constant: "
          f"{sizes[lo] - lo * (sizes[hi] - sizes[lo]) / (hi - lo):.0f} bytes)")


if __name__ == "__main__":
    main()
