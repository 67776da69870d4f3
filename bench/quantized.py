"""Quantized dense projections (``export --quantize int8|int4``): what each runtime reads fastest, and what the
exports cost in next-token quality and buy in decode speed.

    python bench/quantized.py matmul [--k 2048 --n 2048 --threads 2]   # one projection, one token at a time
    python bench/quantized.py model [--steps 64 --context 128]          # big_cfg exports: quality + decode

``matmul``: one [1, K] x [N, K]^T product as an fp32 ``Gemm``, as ``com.microsoft::MatMulNBits`` (int8 / int4,
block 32, ``accuracy_level`` 0 and 4), and as ``DequantizeLinear`` (opset 21, blocked int8 / int4) + ``Gemm``,
each on ONNX Runtime and OpenVINO's CPU plugin: microseconds per call (median of 5 runs of ``--calls`` calls).

``model``: the bench/big_cfg.json model (random weights, as bench/peers.py) exported in fp32 and with
``--quantize int8`` / ``int4``; for each, on ONNX Runtime: the quality figures against the PyTorch fp32 model over
the repository's own docs (one token a UTF-8 byte; windows of
``--context``, second half scored, `k3export.validate.text_quality`), and greedy decode tok/s (prompt 64,
``--steps`` steps, median of 3, interleaved). Random weights make flat next-token distributions: the figures say how
far each export is from the fp32 model, not how a trained model would fare. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _one_node(kind: str, k: int, n: int, bits: int = 8, accuracy: int = 0) -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from k3export.converters.onnx.quantize import quantize_blocks

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])
    opsets = [helper.make_opsetid("", 21)]
    if kind == "fp32":
        nodes, inits = [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], [numpy_helper.from_array(w, "w")]
    elif kind == "nbits":
        blocks, scales = quantize_blocks(w, bits, 32)
        nodes = [helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                  block_size=32, accuracy_level=accuracy)]
        inits = [numpy_helper.from_array(blocks, "b"), numpy_helper.from_array(scales, "s")]
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    else:  # blocked DequantizeLinear of signed codes, then the product
        blocks, scales = quantize_blocks(w, bits, 32)
        codes = blocks.astype(np.int16)
        if bits == 4:
            codes = np.stack([codes & 15, codes >> 4], -1).reshape(n, -1)
        codes = (codes.reshape(n, -1)[:, :k] - (1 << (bits - 1))).astype(np.int8)
        q = helper.make_tensor("q", TensorProto.INT8 if bits == 8 else TensorProto.INT4, [n, k],
                               codes.tobytes() if bits == 8 else _pack_int4(codes), raw=True)
        nodes = [helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=1, block_size=32),
                 helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)]
        inits = [q, numpy_helper.from_array(scales, "s")]
    model = helper.make_model(helper.make_graph(nodes, "one", [x], [y], inits), opset_imports=opsets)
    model.ir_version = 10
    return model.SerializeToString()


def _pack_int4(codes: np.ndarray) -> bytes:
    u = (codes.reshape(-1).astype(np.int16) & 15).astype(np.uint8)
    return (u[0::2] | (u[1::2] << 4)).tobytes()


def _time(call, calls: int) -> float:
    for _ in range(20):
        call()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def matmul(args: argparse.Namespace) -> None:
    import onnxruntime as ort
    import openvino as ov

    x = np.random.default_rng(1).standard_normal((1, args.k)).astype(np.float32)
    cases = [("fp32 Gemm", "fp32", 8, 0), ("MatMulNBits int8, accuracy 0", "nbits", 8, 0),
             ("MatMulNBits int8, accuracy 4", "nbits", 8, 4), ("MatMulNBits int4, accuracy 0", "nbits", 4, 0),
             ("MatMulNBits int4, accuracy 4", "nbits", 4, 4), ("DequantizeLinear int8 + Gemm", "dq", 8, 0),
             ("DequantizeLinear int4 + Gemm", "dq", 4, 0)]
    core = ov.Core()
    core.set_property("CPU", {"INFERENCE_NUM_THREADS": args.threads})
    rows = []
    for label, kind, bits, acc in cases:
        blob = _one_node(kind, args.k, args.n, bits, acc)
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        try:
            s = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
            t_ort = _time(lambda: s.run(None, {"x": x}), args.calls)
        except Exception as exc:  # noqa: BLE001 - a form a runtime cannot read: say so in the table
            t_ort = f"fails: {str(exc).splitlines()[0][:60]}"
        try:
            c = core.compile_model(core.read_model(blob, b""), "CPU")
            req = c.create_infer_request()
            t_ov = _time(lambda: req.infer({"x": x}), args.calls)
        except Exception as exc:  # noqa: BLE001
            t_ov = f"fails: {str(exc).splitlines()[0][:60]}"
        rows.append((label, t_ort, t_ov))
    print(f"one [1, {args.k}] x [{args.n}, {args.k}]^T product, {args.threads} threads, us per call (median of 5 x "
          f"{args.calls})")
    print("| form | ONNX Runtime | OpenVINO |\n|---|---:|---:|")
    for label, a, b in rows:
        print(f"| {label} | {a if isinstance(a, str) else f'{a:.1f}'} | {b if isinstance(b, str) else f'{b:.1f}'} |")


def model(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import peers  # bench/peers.py: the same big_cfg model

    from k3export.converters.onnx import export_onnx
    from k3export.modeling import K3ForCausalLM
    from k3export.modeling.models import randomize_weights
    from k3export.runtime import OrtRunner, TorchRunner
    from k3export.runtime.loop import greedy_decode
    from k3export.validate.text_quality import limits_for, run_quality, windows

    torch.set_num_threads(args.threads)
    config = peers.bench_config(peers.BIG_CFG)
    torch.manual_seed(0)
    m = K3ForCausalLM(config).eval()
    randomize_weights(m, 0)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    wins = windows(peers.docs_tokens(), args.context)[: args.windows]
    forms = {"fp32": None, "int8": "int8", "int4": "int4"}
    runners = {}
    for name, q in forms.items():
        out = work / f"export-{name}"
        if not (out / "model.onnx").is_file():
            export_onnx(m, out, dtype="fp32", quantize=q, overwrite=True)
        runners[name] = OrtRunner(out, threads=args.threads) if _takes_threads() else OrtRunner(out)
        runners[name].name = f"ort-{name}"
    reference = TorchRunner(m)
    limits = {r.name: limits_for("float32", forms[k]) for k, r in runners.items()}
    quality = run_quality(reference, list(runners.values()), wins, limits)
    prompt = np.random.default_rng(0).integers(3, config.vocab_size, (1, 64))
    speeds: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(3):
        for k, r in runners.items():
            greedy_decode(r, prompt, 4)  # warm
            res = greedy_decode(r, prompt, args.steps)
            speeds[k].append(args.steps / res.decode_seconds)
    sizes = {k: sum(p.stat().st_size for p in (work / f"export-{k}").glob("model.onnx.data.*")) for k in runners}
    rows = []
    print(f"big_cfg ({sum(p.numel() for p in m.parameters()) / 1e6:.0f}M parameters, random weights), ONNX Runtime "
          f"{args.threads} threads; quality over {len(wins)} windows of {args.context} tokens of the repository docs")
    print("| export | weights | decode tok/s | PPL | ln(PPL/ref) | mean KLD +- err | KLD p99 | KLD max | top-1 | "
          "RMS dp |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, r in runners.items():
        f = quality[r.name].figures
        tps = statistics.median(speeds[k])
        rows.append({"export": k, "weight_bytes": sizes[k], "decode_tok_s": tps, **(f.to_dict() if f else {})})
        print(f"| {k} | {sizes[k] / 2**20:.0f} MiB | {tps:.1f} | {f.ppl:.2f} | {f.ln_ppl_ratio:.2e} | "
              f"{f.kld_mean:.2e} +- {f.kld_stderr:.1e} | {f.kld_p99:.2e} | {f.kld_max:.2e} | {f.top1_agree:.4f} | "
              f"{f.delta_p_rms:.2e} |")
    if args.json:
        for row in rows:
            row.pop("kld_by_position", None)
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _takes_threads() -> bool:
    import inspect

    from k3export.runtime import OrtRunner

    return "threads" in inspect.signature(OrtRunner.__init__).parameters


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("matmul")
    a.add_argument("--k", type=int, default=2048)
    a.add_argument("--n", type=int, default=2048)
    a.add_argument("--calls", type=int, default=200)
    a.add_argument("--threads", type=int, default=2)
    b = sub.add_parser("model")
    b.add_argument("--steps", type=int, default=64)
    b.add_argument("--context", type=int, default=128)
    b.add_argument("--windows", type=int, default=16)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--work-dir", default=str(HERE.parent.parent / "quantized-bench"))
    b.add_argument("--json")
    args = p.parse_args(argv)
    (matmul if args.what == "matmul" else model)(args)


if __name__ == "__main__":
    main()
