"""ONNX Runtime peak RSS (and speed) of an MXFP4 export against the bf16 export of the same model.

    python bench/mxfp4_rss.py                      # big_cfg.json model, prompt 64 + 32 greedy steps, 2 threads
    python bench/mxfp4_rss.py --quick              # a small config, seconds
    python bench/mxfp4_rss.py --forms              # then time the candidate ORT forms of the expert loop

Writes a released-layout checkpoint of the config (random valid MXFP4 experts), exports it four ways (routed
experts mxfp4 or dense; other weights bf16 or fp32) and runs each export on ONNX Runtime in its own subprocess:
session build, prefill of the prompt, greedy decode. The graph each child runs is prepared beforehand as
`runtime.ort_session` prepares it (MXFP4 experts rewritten into the 9-bit form, `mxfp4.ort_model`, in a file ORT
maps; bf16 exports through `lowp.emulate_low_precision`, ORT's CPU provider having no bf16 kernels), so the child
imports only numpy and onnxruntime (not torch) and its peak RSS (``VmHWM``) is ONNX Runtime's. A fifth run holds
the 9-bit experts the other way measured, copied in with ``add_external_initializers``. Runs are interleaved and
repeated ``--reps`` times; medians are printed, with the ratios against the dense export of the same dtype.
Target: MXFP4 / bf16 peak RSS <= 0.6. Greedy tokens of an MXFP4 export must equal those of the dense export of
the same dtype (the same values). Not part of CI.

``--forms`` times ``k3::moe_experts`` bodies alone (CPU time, one thread, the config's expert shapes), one
per way ORT could hold the experts: fp32 (dequantised at load), the chosen 8-bit ``GatherBlockQuantized``, 8-bit
``DequantizeLinear``, 8-bit Cast+Mul, ``MatMulNBits`` 8-bit, the 4.25-bit packed bytes decoded through a table,
and ``GatherBlockQuantized`` on FLOAT4E2M1. docs/mxfp4.md records the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BIG_CFG = HERE / "big_cfg.json"  # the repository's copy of ../shared/bench/big_cfg.json
MiB = 2**20
VARIANTS = {  # name -> (experts, dtype)
    "mxfp4-bf16": ("mxfp4", "bf16"), "dense-bf16": ("dense", "bf16"),
    "mxfp4-fp32": ("mxfp4", "fp32"), "dense-fp32": ("dense", "fp32"),
}
#: the measured alternative way of holding the 8-bit form: numpy arrays handed over with add_external_initializers
#: (ONNX Runtime copies them: twice the experts at session build) instead of a file it maps
COPY = "mxfp4-bf16-copy"


def bench_config(path: Path | None, quick: bool) -> Any:
    """big_cfg.json over `K3Config.tiny()` (every K3 feature on), or with --quick the released-layout fixture."""
    from k3export.converters.checkpoints.synthetic import released_tiny_config
    from k3export.modeling import K3Config

    if quick or path is None or not path.is_file():
        return released_tiny_config(num_experts=32, vocab_size=512)
    over = json.loads(path.read_text())
    lac = dict(K3Config.tiny().linear_attn_config)
    lac.update(over.get("linear_attn_config") or {})
    return K3Config.tiny(**{**over, "linear_attn_config": lac})


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


# ================================================================================================== worker
def prepare(folder: Path) -> Path:
    """The graph ONNX Runtime runs for an export, saved beside it with the root of its external data: the MXFP4
    experts rewritten into the 8-bit form (`mxfp4.ort_model`, its file kept here: `ort_session` unlinks it once
    mapped), a bf16 export emulated (`lowp.emulate_low_precision`). The worker then needs neither k3export nor
    torch, so its RSS is ONNX Runtime's own."""
    import onnx

    from k3export.converters.onnx.lowp import emulate_low_precision
    from k3export.converters.onnx.mxfp4 import has_mxfp4, ort_model

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    if json.loads((folder / "state_manifest.json").read_text())["dtype"] == "bfloat16":
        model = emulate_low_precision(model)
    root = folder
    if has_mxfp4(model):
        model, root = ort_model(model, folder, folder.parent / f"{folder.name}.experts.q8", "experts.q8.")
    path = folder.parent / f"{folder.name}.ort.onnx"
    path.write_bytes(model.SerializeToString())
    (folder.parent / f"{folder.name}.ort.json").write_text(json.dumps({"root": str(root)}))
    return path


def worker(args: argparse.Namespace) -> None:
    """One export on ONNX Runtime, in its own process (onnxruntime and numpy only): build, prefill, greedy
    decode, fed by state_manifest.json; one JSON line."""
    import numpy as np
    import onnxruntime as ort

    folder = Path(args.worker)
    copy = folder.name == COPY
    folder = folder.with_name(folder.name.removesuffix("-copy"))
    manifest = json.loads((folder / "state_manifest.json").read_text())
    root = json.loads((folder.parent / f"{folder.name}.ort.json").read_text())["root"]
    base = _status("VmRSS")  # interpreter + numpy + onnxruntime
    t0 = time.perf_counter()
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = args.threads, 1, 3
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", root)
    graph = (folder.parent / f"{folder.name}.ort.onnx").read_bytes()
    if copy:
        import onnx

        names, values = [], []
        for t in onnx.load_from_string(graph).graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if ext.get("location", "").endswith(".experts.q8"):
                dt = np.uint8 if t.data_type == onnx.TensorProto.UINT8 else np.float32
                arr = np.fromfile(Path(root) / ext["location"], dt, int(ext["length"]) // np.dtype(dt).itemsize,
                                  offset=int(ext["offset"])).reshape(tuple(t.dims))
                names.append(t.name)
                values.append(ort.OrtValue.ortvalue_from_numpy(arr))
        so.add_external_initializers(names, values)
    sess = ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])
    if copy:
        del names, values, arr
    t1 = time.perf_counter()
    outs = [o.name for o in sess.get_outputs()]
    states = manifest["states"]
    state = {s["name"]: np.zeros([1 if d == "batch" else 0 if isinstance(d, str) else d for d in s["shape"]],
                                 np.float32) for s in states}  # bf16 states: emulated in fp32
    past_axis = {s["name"]: s["shape"].index("past_sequence_length") for s in states
                 if "past_sequence_length" in s["shape"]}
    vocab = manifest["outputs"][0]["shape"][-1]

    def step(ids: list[int]) -> int:
        nonlocal state
        past = next((state[n].shape[a] for n, a in past_axis.items()), 0)
        feeds = {"input_ids": np.array([ids], np.int64), **state}
        if any(i["name"] == "attention_mask" for i in manifest["inputs"]):
            feeds["attention_mask"] = np.ones((1, past + len(ids)), np.int64)
        out = dict(zip(outs, sess.run(None, feeds)))
        state = {s["name"]: out[s["present"]] for s in states}
        return int(out["logits"][0, -1].argmax())

    prompt = [(7 * i + 3) % vocab for i in range(args.prompt)]
    tokens = [step(prompt)]
    t2 = time.perf_counter()
    for _ in range(args.steps):
        tokens.append(step([tokens[-1]]))
    t3 = time.perf_counter()
    print(json.dumps({"build_s": t1 - t0, "prefill_s": t2 - t1, "decode_tok_s": args.steps / max(t3 - t2, 1e-9),
                      "vm_hwm": _status("VmHWM"), "base": base, "rss_anon": _status("RssAnon"),
                      "rss_file": _status("RssFile"), "tokens": tokens}), flush=True)


def run_worker(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", str(folder), "--prompt", str(args.prompt), "--steps",
           str(args.steps), "--threads", str(args.threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"worker {folder.name} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ============================================================================================ expert forms
def forms(config: Any, reps: int) -> None:
    """CPU time of one ``moe_experts`` call (1 and 64 tokens, one thread) for each ORT form of the experts."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from onnx import TensorProto as TP, helper, numpy_helper

    from k3export.converters.checkpoints.mxfp4 import E2M1_VALUES, decode_mxfp4
    from k3export.converters.onnx.bodies import Body, gather_expert, moe_experts_nodes
    from k3export.artifacts.expert_views import Q8_SCALE, q8_from_packed
    from k3export.converters.onnx.mxfp4 import ort_expert

    E, D, I = config.num_experts, config.expert_input_size, config.moe_intermediate_size
    K = config.num_experts_per_token
    gen = torch.Generator().manual_seed(0)
    mats = {}
    for w, (o, i) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
        mats[w] = (torch.randint(0, 256, (E, o, i // 2), generator=gen, dtype=torch.int32).to(torch.uint8).numpy(),
                   torch.randint(122, 125, (E, o, i // 32), generator=gen, dtype=torch.int32).to(torch.uint8).numpy())
    lut = np.stack([np.array(E2M1_VALUES, np.float32)[np.arange(256) & 15],
                    np.array(E2M1_VALUES, np.float32)[np.arange(256) >> 4]], -1)
    exp2 = np.exp2(np.minimum(np.arange(256.0) - 127, 127)).astype(np.float32)

    def dequant(p, s):
        return np.stack([decode_mxfp4(torch.from_numpy(p[e]), torch.from_numpy(s[e]), torch.float32).numpy()
                         for e in range(E)])

    def const(b: Body, a: np.ndarray) -> str:
        return b.op("Constant", [], value=numpy_helper.from_array(a, f"{b.prefix}k{b._n}"))

    def dq8(b, w, e, like):
        s = b.op("Gather", [w[1], e], axis=0)
        zp = b.op("ConstantOfShape", [b.op("Shape", [s])], value=helper.make_tensor("zp", TP.UINT8, [1], [128]))
        return b.op("DequantizeLinear", [b.op("Gather", [w[0], e], axis=0), s, zp], axis=-1, block_size=32)

    def cast8(b, w, e, like):
        v = b.op("Sub", [b.op("Cast", [b.op("Gather", [w[0], e], axis=0)], to=TP.FLOAT), b.const(128.0, TP.FLOAT)])
        v = b.op("Mul", [b.op("Reshape", [v, b.const([0, -1, 32])]),
                         b.op("Unsqueeze", [b.op("Gather", [w[1], e], axis=0), b.const([-1])])])
        return b.op("Reshape", [v, b.const([0, -1])])

    def nibble(b, w, e, like):
        v = b.op("Gather", [const(b, lut), b.op("Cast", [b.op("Gather", [w[0], e], axis=0)], to=TP.INT32)])
        s = b.op("Gather", [const(b, exp2), b.op("Cast", [b.op("Gather", [w[1], e], axis=0)], to=TP.INT32)])
        v = b.op("Mul", [b.op("Reshape", [v, b.const([0, -1, 32])]), b.op("Unsqueeze", [s, b.const([-1])])])
        return b.op("Reshape", [v, b.const([0, -1])])

    def gbq4(b, w, e, like):
        r = b.op("GatherBlockQuantized", [w[0], b.op("Unsqueeze", [e, b.const([0])]), w[1]], domain="com.microsoft",
                 bits=4, block_size=32, gather_axis=0, quantize_axis=2)
        return b.op("Squeeze", [r, b.const([0])])

    shapes = {"w1": (I, D), "w3": (I, D), "w2": (D, I)}

    def mnb8(b, w, e, like):  # a marker: the Gemm that consumes it becomes MatMulNBits (MnbBody)
        return ("mnb", b.op("Gather", [w[0], e], axis=0), b.op("Gather", [w[1], e], axis=0), *shapes[w[0]])

    def gemm_as_matmulnbits(self, op_type, inputs, n_out=1, **attrs):  # Body.op while building matmulnbits8
        if op_type == "Gemm" and isinstance(inputs[1], tuple):
            _, q, s, n, k = inputs[1]
            return body_op(self, "MatMulNBits", [inputs[0], q, s], domain="com.microsoft", K=k, N=n, bits=8,
                           block_size=32)
        return body_op(self, op_type, inputs, n_out, **attrs)

    body_op = Body.op

    def model(form: str):
        inits, args_ = [], []
        for w, (p, s) in mats.items():
            if form == "fp32":
                inits.append(numpy_helper.from_array(dequant(p, s), w))
                args_.append(w)
                continue
            if form == "nibble":
                q, sc = p, s
            elif form == "gbq4":
                t = TP()
                t.name, t.data_type, t.raw_data = w, TP.FLOAT4E2M1, p.tobytes()
                t.dims.extend([E, p.shape[1], p.shape[2] * 2])
                inits += [t, numpy_helper.from_array(np.exp2(s.astype(np.float32) - 127), w + "_s")]
                args_.append((w, w + "_s"))
                continue
            else:
                q, sc = q8_from_packed(p), np.take(Q8_SCALE, s)
                if form == "matmulnbits8":
                    q = q.reshape(E, q.shape[1], -1, 32)
            inits += [numpy_helper.from_array(q, w), numpy_helper.from_array(sc, w + "_s")]
            args_.append((w, w + "_s"))
        expert = {"fp32": gather_expert, "gbq8": ort_expert, "dq8": dq8, "cast8": cast8, "nibble": nibble,
                  "gbq4": gbq4, "matmulnbits8": mnb8}[form]
        b = Body("m_")
        Body.op = gemm_as_matmulnbits if form == "matmulnbits8" else body_op
        try:
            b.out(moe_experts_nodes(b, "z", "w", "idx", *args_, config.hidden_act, 4.0, 25.0, expert=expert), "u")
        finally:
            Body.op = body_op
        f = TP.FLOAT
        graph = helper.make_graph(b.nodes, "forms", [helper.make_tensor_value_info("z", f, None),
                                                     helper.make_tensor_value_info("w", f, None),
                                                     helper.make_tensor_value_info("idx", TP.INT64, None)],
                                  [helper.make_tensor_value_info("u", f, None)], inits)
        opsets = [helper.make_opsetid("", 27), helper.make_opsetid("com.microsoft", 1)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=11)

    names = ["fp32", "gbq8", "dq8", "cast8", "matmulnbits8", "nibble", "gbq4"]
    bits = {"fp32": 32, "gbq8": 9, "dq8": 9, "cast8": 9, "matmulnbits8": 9, "nibble": 4.25, "gbq4": 36}
    sessions = {}
    for name in names:
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
        sessions[name] = ort.InferenceSession(model(name).SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {n: {"z": rng.standard_normal((n, D)).astype(np.float32), "w": rng.random((n, K)).astype(np.float32),
                 "idx": np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int64)} for n in (1, 64)}
    ref = {n: sessions["fp32"].run(None, f)[0] for n, f in feeds.items()}
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in names for n in feeds}
    for _ in range(reps):
        for m in names:
            for n, f in feeds.items():
                inner = 20 if n == 1 else 2
                t0 = time.process_time()
                for _ in range(inner):
                    out = sessions[m].run(None, f)[0]
                times[(m, n)].append((time.process_time() - t0) / inner)
                if not np.array_equal(out, ref[n]):
                    raise SystemExit(f"form {m} differs from fp32 by {np.abs(out - ref[n]).max()}")
    print(f"\nexpert forms: E={E} D={D} I={I} top-{K}, one thread, CPU ms per moe_experts call (median of {reps})")
    print(f"{'form':14s} {'bits/w':>7s} {'1 token':>9s} {'64 tokens':>10s}  x fp32")
    for m in names:
        t1, t64 = (statistics.median(times[(m, n)]) * 1e3 for n in (1, 64))
        f1, f64 = (statistics.median(times[("fp32", n)]) * 1e3 for n in (1, 64))
        print(f"{m:14s} {bits[m]:7.2f} {t1:9.3f} {t64:10.3f}  {t1 / f1:.2f} / {t64 / f64:.2f}")


# ================================================================================================== main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=BIG_CFG, help="config overrides over K3Config.tiny() (JSON)")
    ap.add_argument("--quick", action="store_true", help="a small config, one repetition")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--forms", action="store_true", help="also time the ORT forms of the expert loop")
    ap.add_argument("--work-dir", type=Path, default=None, help="default: a temporary folder, removed")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from k3export.converters.checkpoints.synthetic import write_checkpoint
    from k3export.converters.onnx import export_onnx
    from k3export.info import weight_bytes_by_form

    config = bench_config(args.config, args.quick)
    reps = 1 if args.quick else args.reps
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="k3-mxfp4-rss-"))
    try:
        t = time.perf_counter()
        src = write_checkpoint(work / "released", config, layout="kimi_k3", expert_mode="random", vision=False,
                               tokenizer=False)
        for name, (experts, dtype) in VARIANTS.items():
            shutil.rmtree(work / name, ignore_errors=True)
            export_onnx(src, work / name, dtype=dtype, experts=experts)
            prepare(work / name)
        print(f"checkpoint + 4 exports in {time.perf_counter() - t:.1f}s under {work}")
        rows: dict[str, list[dict[str, Any]]] = {n: [] for n in [*VARIANTS, COPY]}
        for _ in range(reps):
            for name in rows:
                rows[name].append(run_worker(work / name, args))
        forms_bytes = weight_bytes_by_form(config)
        print(f"\nmodel: {config.num_hidden_layers} layers, {config.num_experts} experts "
              f"top-{config.num_experts_per_token}; prompt {args.prompt} + {args.steps} greedy steps, "
              f"{args.threads} threads, median of {reps}")
        print("peak RSS: the worker's VmHWM; 'above base': minus its RSS before the session (python, numpy, "
              "onnxruntime)")
        print(f"{'export':15s} {'files MiB':>9s} {'peak RSS':>9s} {'above base':>10s} {'anon':>7s} {'file':>7s} "
              f"{'build s':>8s} {'prefill tok/s':>13s} {'decode tok/s':>12s}")
        med: dict[str, dict[str, float]] = {}
        for name, runs in rows.items():
            m = {k: statistics.median(r[k] for r in runs) for k in ("vm_hwm", "base", "rss_anon", "rss_file",
                                                                   "build_s", "prefill_s", "decode_tok_s")}
            m["own"] = statistics.median(r["vm_hwm"] - r["base"] for r in runs)
            med[name] = m
            size = sum(p.stat().st_size for p in (work / name.removesuffix("-copy")).iterdir()) / MiB
            print(f"{name:15s} {size:9.1f} {m['vm_hwm'] / MiB:9.1f} {m['own'] / MiB:10.1f} "
                  f"{m['rss_anon'] / MiB:7.1f} {m['rss_file'] / MiB:7.1f}"
                  f" {m['build_s']:8.2f} {args.prompt / m['prefill_s']:13.1f} {m['decode_tok_s']:12.1f}")
        print()
        for dtype in ("bf16", "fp32"):
            a, b = med[f"mxfp4-{dtype}"], med[f"dense-{dtype}"]
            same = all(r["tokens"] == s["tokens"] for r, s in zip(rows[f"mxfp4-{dtype}"], rows[f"dense-{dtype}"]))
            print(f"mxfp4 / dense ({dtype}): peak RSS {a['vm_hwm'] / b['vm_hwm']:.2f}x, above base "
                  f"{a['own'] / b['own']:.2f}x" + (" (target <= 0.6x)" if dtype == "bf16" else "")
                  + f", prefill {b['prefill_s'] / a['prefill_s']:.2f}x"
                  + f", decode {a['decode_tok_s'] / b['decode_tok_s']:.2f}x"
                  f", greedy tokens {'identical' if same else 'DIFFER'}")
        a, b = med[COPY], med["mxfp4-bf16"]
        print(f"8-bit experts copied in (add_external_initializers) instead of mapped: peak RSS "
              f"{a['vm_hwm'] / b['vm_hwm']:.2f}x, above base {a['own'] / b['own']:.2f}x")
        print(f"predicted weight bytes (k3export.info): ORT resident mxfp4 {forms_bytes.ort_mxfp4 / MiB:.1f} MiB, "
              f"dense {forms_bytes.ort_dense / MiB:.1f} MiB")
        if args.forms:
            forms(config, reps)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
