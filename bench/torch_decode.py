"""PyTorch eager greedy decode on the benchmark model (bench/big_cfg.json), as bench/peers.py's TorchRunner drives it.

    python bench/torch_decode.py                      # ms/step median of 128 decode steps after a 64-token prompt
    python bench/torch_decode.py --baseline HEAD      # and the modeling file of a git revision, side by side
    python bench/torch_decode.py --no-kernels         # the modeling files' PyTorch functions alone
    python bench/torch_decode.py --profile            # plus a torch.profiler and a cProfile top list of decode

Random fp32 weights (`randomize_weights`), batch 1, `torch.set_num_threads(--threads)` (2 by default), k3export's
kernels (`k3export.ops.KERNELS`) plugged into every variant's hooks, as `k3export.K3ForCausalLM` gets them. Each
variant (the working tree's modeling file, and with --baseline the revision's; on an unchanged tree that pair
is the noise floor) gets the same weights and the same prompt. The variants alternate over --repeats rounds, in
reversed order every other round (whichever runs first in a round runs a few percent slower), and the medians
are printed. Every round also reports prefill tokens/s and checks that the variants decode the same greedy tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # the git repository (--baseline reads its revisions)

def bench_config(modeling_pkg, path: Path):
    """big_cfg.json over `K3Config.tiny()` (as bench/peers.py `bench_config` builds it)."""
    K3Config = modeling_pkg.K3Config
    over = json.loads(path.read_text())
    lac = dict(K3Config.tiny().linear_attn_config)
    lac.update(over.get("linear_attn_config") or {})
    return K3Config.tiny(**{**over, "linear_attn_config": lac})


def load_revision(rev: str, tmp: Path):
    """The modeling package of git revision `rev` (every file it held there), as a separate package."""
    name = "k3_modeling_" + "".join(c if c.isalnum() else "_" for c in rev)
    pkg = tmp / name
    pkg.mkdir()
    files = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "k3export/modeling/"], check=True,
                           capture_output=True, text=True).stdout.split()
    for path in (f for f in files if f.endswith(".py")):
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                             text=True).stdout
        (pkg / Path(path).name).write_text(src)
    sys.path.insert(0, str(tmp))
    return importlib.import_module(name)


def plug_in(runners: list) -> None:
    """Register k3export's kernels into each variant's modeling file (a revision's hooks that lack a kernel's name
    never call it)."""
    import k3export.ops as ops

    for r in runners:
        for name, kernel in ops.KERNELS.items():
            sys.modules[type(r.model).__module__].register_kernel(name, kernel)


class Runner:
    """One model, driven as TorchRunner drives it: model(input_ids=..., use_cache=True, cache=..., logits_to_keep=1)."""

    def __init__(self, label: str, pkg, config_path: Path, state: dict | None, seed: int) -> None:
        self.label = label
        torch.manual_seed(seed)
        self.model = pkg.K3ForCausalLM(bench_config(pkg, config_path)).eval()
        if state is None:
            from k3export.modeling import randomize_weights

            randomize_weights(self.model, seed)
        else:
            self.model.load_state_dict(state)
        self.cache = None

    @torch.inference_mode()
    def run(self, tokens: list[int]) -> int:
        kw = {"cache": self.cache} if self.cache is not None else {}
        out = self.model(input_ids=torch.tensor([tokens]), use_cache=True, logits_to_keep=1, **kw)
        self.cache = out.cache
        return int(out.logits[0, -1].argmax())

    def round(self, prompt: list[int], steps: int) -> tuple[float, float, list[int]]:
        """(prefill tokens/s, median ms per decode step, greedy tokens) of one prefill + `steps` decode steps."""
        self.cache = None
        t = time.perf_counter()
        tok = self.run(prompt)
        prefill = len(prompt) / (time.perf_counter() - t)
        times, out = [], [tok]
        for _ in range(steps):
            t = time.perf_counter()
            tok = self.run([tok])
            times.append(time.perf_counter() - t)
            out.append(tok)
        return prefill, 1e3 * statistics.median(times), out


def profile(runner: Runner, prompt: list[int], steps: int, top: int) -> None:
    runner.cache = None
    tok = runner.run(prompt)
    for _ in range(4):
        tok = runner.run([tok])
    from torch.profiler import ProfilerActivity, profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            tok = runner.run([tok])
    print(f"\n== torch.profiler, {runner.label}, {steps} decode steps (self CPU time)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        tok = runner.run([tok])
    pr.disable()
    print(f"\n== cProfile, {runner.label}, {steps} decode steps (tottime)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "bench" / "big_cfg.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", metavar="REV", help="also time the modeling file of this git revision")
    ap.add_argument("--no-kernels", action="store_true",
                    help="plug no kernels in: time the modeling files' PyTorch functions alone")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    import k3export.modeling as current

    config_path = Path(args.config)
    runners = [Runner("working tree", current, config_path, None, args.seed)]
    tmp = tempfile.TemporaryDirectory()
    if args.baseline:
        state = runners[0].model.state_dict()
        runners.insert(0, Runner(f"baseline {args.baseline}", load_revision(args.baseline, Path(tmp.name)),
                                 config_path, state, args.seed))
    if not args.no_kernels:
        plug_in(runners)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(3, runners[0].model.config.vocab_size, (args.prompt,), generator=gen).tolist()
    print(f"threads {torch.get_num_threads()}, prompt {args.prompt}, {args.steps} decode steps, "
          f"{sum(p.numel() for p in runners[0].model.parameters()) / 1e6:.1f}M parameters")

    for r in runners:  # warm-up (weight layouts the kernels prepare, allocator)
        r.round(prompt[:8], 4)
    results: dict[str, list[tuple[float, float]]] = {r.label: [] for r in runners}
    for i in range(args.repeats):
        tokens = []
        for r in runners if i % 2 == 0 else runners[::-1]:  # ABBA: the first of a round runs slower
            prefill, ms, out = r.round(prompt, args.steps)
            results[r.label].append((prefill, ms))
            tokens.append(out)
            print(f"  round {i}: {r.label:>24}: prefill {prefill:7.1f} tok/s   decode {ms:6.2f} ms/step "
                  f"({1e3 / ms:6.1f} tok/s)", flush=True)
        if len(tokens) > 1:
            same = sum(a == b for a, b in zip(*tokens))
            print(f"  round {i}: greedy tokens agree {same}/{len(tokens[0])}")
    print("\nmedians:")
    for label, rs in results.items():
        ms = statistics.median(m for _, m in rs)
        pf = statistics.median(p for p, _ in rs)
        print(f"  {label:>24}: decode {ms:6.2f} ms/step = {1e3 / ms:6.1f} tok/s   prefill {pf:7.1f} tok/s")
    if args.profile:
        for r in runners:
            profile(r, prompt, 32, args.top)


if __name__ == "__main__":
    main()
