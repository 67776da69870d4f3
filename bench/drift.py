"""Error growth with position: fp32 vs bf16 carried state on the tiny K3, up to 4096 tokens (a table).

The same token stream is fed to three runners that all carry their state through `chunk`-token calls
(chunk 1 = true token-by-token decode; the default 64 keeps the run to about a minute on 2 cores):

    fp32            fp32 model, fp32 state                          (what an fp32 export does)
    bf16-recurrent  fp32 model, KDA recurrent state rounded to bf16 between calls
    bf16-state      fp32 model, every carried state (conv, recurrent, latent) rounded to bf16
and compares logits and states with a float64 copy of the model (the reference; its norms and routing
still compute in fp32, as the model code asks, so the floor is fp32-ish).

    python bench/drift.py [--tokens 4096] [--chunk 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from k3export.modeling import tiny_model
from k3export.runtime import TorchRunner, to_numpy
from k3export.validate.compare import Tolerances, compare
from k3export.validate.mutations import StateCastRunner


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = tiny_model(args.seed)
    ref = TorchRunner(tiny_model(args.seed).double(), name="fp64", hidden=False)
    runners = {
        "fp32": TorchRunner(model, hidden=False),
        "bf16-recurrent": StateCastRunner(TorchRunner(model, hidden=False), torch.bfloat16, ("recurrent_state",)),
        "bf16-state": StateCastRunner(TorchRunner(model, hidden=False), torch.bfloat16),
    }
    ids = np.random.default_rng(args.seed).integers(3, model.config.vocab_size, (1, args.tokens))
    tol = Tolerances("float64").for_kind("logits")  # metrics only; the verdict is not used here
    marks = sorted({p for p in (64, 128, 256, 512, 1024, 2048, 4096, args.tokens) if p <= args.tokens})
    rows: list[tuple] = []
    states = {k: None for k in runners}
    ref_state = None
    t0 = time.perf_counter()
    for start in range(0, args.tokens, args.chunk):
        chunk = ids[:, start:start + args.chunk]
        r = ref.prefill(chunk, ref_state)
        ref_state = r.state
        end = start + chunk.shape[1]
        report = any(start < m <= end for m in marks)
        for name, runner in runners.items():
            o = runner.prefill(chunk, states[name])
            states[name] = o.state
            if not report:
                continue
            err = {"logits": compare(to_numpy(o.logits), to_numpy(r.logits), "logits", tol).rms_rel}
            for s in ref.manifest.states:
                m = compare(to_numpy(o.state[s.name]), to_numpy(r.state[s.name]), s.group, tol)
                err[s.group] = max(err.get(s.group, 0.0), m.rms_rel)
            rows.append((end, name, err))
    seconds = time.perf_counter() - t0

    kinds = ["logits", "conv_state", "recurrent_state", "latent"]
    print(f"tiny K3, {args.tokens} tokens in {args.chunk}-token calls, rms_rel vs float64 reference "
          f"(states: worst layer); {seconds:.1f} s")
    print(f"{'position':>8}  {'runner':<15}" + "".join(f"{k:>17}" for k in kinds))
    for end, name, err in rows:
        print(f"{end:>8}  {name:<15}" + "".join(f"{err.get(k, float('nan')):>17.2e}" for k in kinds))
    last = {name: err for end, name, err in rows if end == rows[-1][0]}
    ratio = last["bf16-state"]["logits"] / max(last["fp32"]["logits"], 1e-30)
    print(f"at {rows[-1][0]} tokens: bf16 state / fp32 state logits error = {ratio:.0f}x")


if __name__ == "__main__":
    main()
