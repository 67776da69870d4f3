"""ONNX Runtime session options for a k3export export, measured side by side (how `ORT_SESSION_OPTIONS` is chosen).

    python bench/ort_options.py                          # big_cfg fp32 export, prompt 64 + 128 steps, 3 rounds
    python bench/ort_options.py --export DIR --steps 64 --rounds 5
    python bench/ort_options.py --export DIR --standard STD_DIR --variants openvino-standard,openvino-k3-ext

Each variant runs in its own subprocess (its own peak RSS), variants interleaved round by round; the report
gives medians of session creation, prefill and per-step decode time, and each variant's ratio to ORT's defaults
(all graph optimisations, ``--threads`` intra-op threads with spinning, sequential executor). The export is
built once from random weights (`peers.bench_config`) unless ``--export`` names one. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: variant -> what it changes from the defaults
VARIANTS = {
    "default": "ORT_ENABLE_ALL, spinning, sequential",
    "extended": "graph_optimization_level = ORT_ENABLE_EXTENDED",
    "basic": "graph_optimization_level = ORT_ENABLE_BASIC",
    "no-spin": "session.intra_op.allow_spinning = 0",
    "parallel": "execution_mode = ORT_PARALLEL, 2 inter-op threads",
    "one-thread": "intra_op_num_threads = 1",
    "no-arena": "enable_cpu_mem_arena = False",
    "no-mem-pattern": "enable_mem_pattern = False (what k3export's exports recommend, RuntimeConfig.session_options)",
    "saved-optimized": "load the model ORT saved after optimising it (optimized_model_filepath)",
    "decode-graph": "batch and sequence_length fixed to 1: a decode-only graph (its prefill runs token by token)",
    "dynamic-block": "session.dynamic_block_base = 4 (ORT splits parallel loops into shrinking blocks)",
    "pinned": "the caller on CPU 0 and each ORT worker thread on a CPU of its own (session.intra_op_thread_affinities)",
    "runner": "k3export's OrtRunner(bind=False): the export's options, InferenceSession.run on numpy feeds",
    "runner-bound": "k3export's OrtRunner (default): the export's options, IO binding into reused state buffers, "
                    "the k3 ops' function bodies",
    "runner-k3-ops": "k3export's OrtRunner with K3EXPORT_ORT_OPS=1: as runner-bound, the k3 ops as native kernels "
                     "(k3export.runtime.ort_ops), the fused ops the export writes among them",
    "runner-k3-ops-unfused": "as runner-k3-ops, on the same weights exported without the fused ops (--unfused DIR, "
                             "export --no-kernels)",
    "openvino-standard": "k3export's OpenVinoRunner (stateful) on the standard-form export of the same weights "
                         "(--standard DIR, form inlined): what OpenVINO runs without the k3 extension",
    "openvino-k3-ext": "k3export's OpenVinoRunner (stateful, its default) on the export itself (functions "
                       "form): the k3 ops as the extension's operations (k3export.runtime.ov_ext)",
    "openvino-k3-ext-unfused": "as openvino-k3-ext, on the export without the fused ops (--unfused DIR)",
    "openvino-k3-ext-stateless": "as openvino-k3-ext, every state fed and fetched (OpenVinoRunner(stateful=False))",
    "openvino-k3-ext-decode-graph": "as openvino-k3-ext, its one-token steps on a second model compiled for batch "
                                    "and sequence_length 1 (OpenVinoRunner(decode_graph=True), --runtime "
                                    "openvino-decode-graph)",
}
#: the variants timed through one of k3export's runners (`runner_worker`), not a bare ORT session
RUNNER_VARIANTS = ("runner", "runner-bound", "runner-k3-ops", "runner-k3-ops-unfused", "openvino-standard",
                   "openvino-k3-ext", "openvino-k3-ext-unfused", "openvino-k3-ext-stateless",
                   "openvino-k3-ext-decode-graph")


def session_options(variant: str, threads: int, saved: Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1 if variant == "one-thread" else threads
    so.inter_op_num_threads = 1
    if variant in ("extended", "basic"):
        so.graph_optimization_level = {"extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                       "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}[variant]
    elif variant == "no-spin":
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif variant == "parallel":
        so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        so.inter_op_num_threads = 2
    elif variant == "no-arena":
        so.enable_cpu_mem_arena = False
    elif variant == "no-mem-pattern":
        so.enable_mem_pattern = False
    elif variant == "saved-optimized":  # already optimised offline: skip it at load
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    elif variant == "dynamic-block":
        so.add_session_config_entry("session.dynamic_block_base", "4")
    elif variant == "pinned" and threads > 1:  # ORT numbers processors from 1; the caller runs ORT's thread 0
        os.sched_setaffinity(0, {0})
        so.add_session_config_entry("session.intra_op_thread_affinities", ";".join(map(str, range(2, threads + 1))))
    return so


def decode_graph(model: Path) -> bytes:
    """`model` with its batch and sequence_length dimensions fixed to 1 (weights stay in the export's files), so
    ORT folds the shape arithmetic and the one-token branches of the ``If`` nodes at load."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    for value in [*proto.graph.input, *proto.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in ("batch", "sequence_length"):
                dim.Clear()
                dim.dim_value = 1
    return proto.SerializeToString()


def runner_worker(args: argparse.Namespace) -> None:
    """The same timing through k3export's own runner (`k3export.runtime.ort_runner.OrtRunner`)."""
    import numpy as np

    from k3export.runtime import ort_ops
    from k3export.runtime.loop import Decoding, next_tokens
    from k3export.runtime.ort_runner import OrtRunner

    from k3export.runtime import ov_ext

    import onnx  # noqa: F401 - imported before the load is timed, by every variant

    native = args.worker.startswith("runner-k3-ops")
    unfused = args.worker.endswith("-unfused")
    if unfused and not args.unfused:
        sys.exit(f"{args.worker}: name the export written with --no-kernels with --unfused DIR")
    export = args.unfused if unfused else args.export
    os.environ[ort_ops.ENV_SWITCH] = "1" if native else "0"
    os.environ[ov_ext.ENV_SWITCH] = "1" if args.worker.startswith("openvino-k3-ext") else "0"
    if native and ort_ops.library() is None:  # said why; timing the bodies under this name would mislead
        sys.exit(1)
    t0 = time.perf_counter()
    if args.worker.startswith("openvino-k3-ext") and ov_ext.library() is None:
        sys.exit(1)  # the library did not build (said why): timing something else under this name would mislead
    if args.worker.startswith("openvino"):
        from k3export.runtime.openvino_runner import OpenVinoRunner

        if args.worker == "openvino-standard" and not args.standard:
            sys.exit("openvino-standard: name the inlined-form export with --standard DIR")
        runner = OpenVinoRunner(args.standard if args.worker == "openvino-standard" else export,
                                threads=args.threads, stateful=args.worker != "openvino-k3-ext-stateless",
                                decode_graph=args.worker == "openvino-k3-ext-decode-graph")
    else:
        runner = OrtRunner(export, threads=args.threads, bind=args.worker != "runner")
    runner.logits_to_keep = 1
    t_load = time.perf_counter() - t0
    prompt = np.random.default_rng(0).integers(3, args.vocab, (1, args.prompt_len))

    Decoding(runner).feed(prompt)  # warm-up
    prefills = []
    for _ in range(args.prefills):  # the median of a few: one prefill is a single sample of a shared machine
        d = Decoding(runner)
        t = time.perf_counter()
        tok = next_tokens(d.feed(prompt))
        prefills.append(time.perf_counter() - t)
    t_prefill = statistics.median(prefills)
    steps, tokens = [], [int(tok[0])]
    for _ in range(args.steps):
        t = time.perf_counter()
        tok = next_tokens(d.feed(tok[:, None]))
        steps.append(time.perf_counter() - t)
        tokens.append(int(tok[0]))
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"variant": args.worker, "load_s": t_load, "prefill_s": t_prefill,
                      "step_s": statistics.median(steps), "peak_rss": hwm, "tokens": tokens}))


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import onnxruntime as ort

    if args.worker in RUNNER_VARIANTS:
        return runner_worker(args)

    export = Path(args.export)
    model = export / "model.onnx"
    saved = Path(args.saved)
    if args.worker == "saved-optimized":
        model = saved
    t0 = time.perf_counter()
    so = session_options(args.worker, args.threads, saved)
    if args.worker == "decode-graph":  # from bytes: its external data stays in the export folder
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(export))
        sess = ort.InferenceSession(decode_graph(model), so, providers=["CPUExecutionProvider"])
    else:
        sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    t_load = time.perf_counter() - t0
    outs = [o.name for o in sess.get_outputs()]
    def fresh() -> dict:  # batch 1, nothing cached
        return {i.name: np.zeros([d if isinstance(d, int) else (1 if j == 0 else 0) for j, d in enumerate(i.shape)],
                                 np.float32) for i in sess.get_inputs() if i.name not in ("input_ids", "attention_mask")}

    state = fresh()
    names = list(state)

    def run(tokens: list[int], past: int) -> int:
        if args.worker == "decode-graph":
            for i, t in enumerate(tokens[:-1]):
                run([t], past + i)
            past, tokens = past + len(tokens) - 1, tokens[-1:]
        feeds = {"input_ids": np.asarray([tokens], np.int64),
                 "attention_mask": np.ones((1, past + len(tokens)), np.int64), **state}
        o = sess.run(outs, feeds)
        state.update(zip(names, o[1:]))
        return int(o[0][0, -1].argmax())

    prompt = [int(t) for t in np.random.default_rng(0).integers(3, args.vocab, args.prompt_len)]
    run(prompt, 0)  # warm-up, then start again
    state.update(fresh())
    t = time.perf_counter()
    tok = run(prompt, 0)
    t_prefill = time.perf_counter() - t
    steps = []
    for i in range(args.steps):
        t = time.perf_counter()
        tok = run([tok], args.prompt_len + i)
        steps.append(time.perf_counter() - t)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"variant": args.worker, "load_s": t_load, "prefill_s": t_prefill,
                      "step_s": statistics.median(steps), "peak_rss": hwm}))


def build_export(work: Path, form: str = "functions", kernels: bool = True) -> Path:
    """big_cfg with random weights (seed 0: the same weights for every form) exported in fp32, graph form `form`
    (`kernels`: with the fused ops)."""
    import torch

    from k3export.converters.onnx import export_onnx
    from k3export.modeling import K3ForCausalLM
    from peers import BIG_CFG, bench_config

    torch.manual_seed(0)
    model = K3ForCausalLM(bench_config(BIG_CFG)).eval()
    out = work / (("onnx" if form == "functions" else f"onnx-{form}") + ("" if kernels else "-unfused"))
    export_onnx(model, out, dtype="fp32", form=form, kernels=kernels if form == "functions" else None)
    return out


def save_optimized(export: Path, saved: Path, threads: int) -> None:
    import onnxruntime as ort

    so = session_options("default", threads, saved)
    so.optimized_model_filepath = str(saved)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", saved.name + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(export / "model.onnx"), so, providers=["CPUExecutionProvider"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", help="an fp32 export folder (default: build big_cfg's)")
    p.add_argument("--standard", help="the same weights exported with --form inlined (the openvino-standard "
                                      "variant; default: built beside big_cfg's export when that is built here)")
    p.add_argument("--unfused", help="the same weights exported with --no-kernels (the -unfused variants; default: "
                                     "built beside big_cfg's export when that is built here)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefills", type=int, default=1, help="prefills timed per run, their median reported (k3export's "
                                                            "runners only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--saved", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="k3-ort-options-") as tmp:
        export = Path(args.export) if args.export else build_export(Path(tmp))
        if not args.export and "openvino-standard" in variants:
            args.standard = str(build_export(Path(tmp), form="inlined"))
        if not args.export and any(v.endswith("-unfused") for v in variants):
            args.unfused = str(build_export(Path(tmp), kernels=False))
        saved = Path(tmp) / "optimized.onnx"
        if "saved-optimized" in variants:
            save_optimized(export, saved, args.threads)
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants:
                cmd = [sys.executable, __file__, "--worker", v, "--export", str(export), "--saved", str(saved),
                       "--prompt-len", str(args.prompt_len), "--steps", str(args.steps),
                       "--threads", str(args.threads), "--vocab", str(args.vocab),
                       "--prefills", str(args.prefills)] + (
                       ["--standard", args.standard] if args.standard else []) + (
                       ["--unfused", args.unfused] if args.unfused else [])
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    print(f"{v}: failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
                    continue
                runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"  round {r + 1} {v:16s} step {runs[v][-1]['step_s'] * 1e3:6.2f} ms", file=sys.stderr)
    med = {v: {k: statistics.median(x[k] for x in rs) for k in ("load_s", "prefill_s", "step_s")} | {
        "peak_rss": max(x["peak_rss"] for x in rs)} for v, rs in runs.items() if rs}
    first = "default" if "default" in med else next(iter(med), "default")
    base = med.get(first)
    print(f"\nprompt {args.prompt_len} + {args.steps} greedy steps, {args.threads} threads, medians of "
          f"{args.rounds} interleaved rounds")
    greedy = {v: rs[0]["tokens"] for v, rs in runs.items() if rs and "tokens" in rs[0]}
    if len(greedy) > 1:
        same = len({tuple(t) for t in greedy.values()}) == 1
        print(f"greedy tokens of {', '.join(greedy)}: {'identical' if same else 'DIFFERENT'}")
    print(f"| variant | load s | prefill ms | decode ms/step | peak RSS MiB | decode speed x {first} | what |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for v, m in med.items():
        x = f"{base['step_s'] / m['step_s']:.2f}" if base else "-"
        print(f"| {v} | {m['load_s']:.2f} | {m['prefill_s'] * 1e3:.1f} | {m['step_s'] * 1e3:.2f} "
              f"| {m['peak_rss'] / 2**20:.0f} | {x} | {VARIANTS[v]} |")


if __name__ == "__main__":
    main()
