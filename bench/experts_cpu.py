"""The routed experts' CPU kernels under ONNX Runtime: the k3 ops library against the function bodies, and the pace
at which they read the experts' weights against the memory's.

    python bench/experts_cpu.py                        # big_cfg's experts, 1 token (decode) and 64, 2 threads
    python bench/experts_cpu.py --tokens 1 --threads 1 --rounds 15
    python bench/experts_cpu.py --openvino             # and the same nodes under OpenVINO with the k3 extension
    python bench/experts_cpu.py --baseline HEAD        # and the library built from a git revision's C++ sources
    python bench/experts_cpu.py --arch x86-64-v3       # and the library built for another target (here AVX2,
                                                       # what a CPU without AVX-512 runs)

One call runs `--layers` independent ``k3::moe_experts`` nodes, each with its own stacked experts (50 MB a layer at
big_cfg: 64 experts, D = I = 256), so the weights stream from memory as in a decode step; every token picks top-k
distinct experts at random, afresh each call. Rows: the dense fp32 experts with the library and with the function
bodies, and the MXFP4 and NVFP4 experts (random codes and scales; NVFP4's E4M3 scales per 16 and an fp32 global scale
per expert, ``moe_experts_nvfp4``) with the library; with `--baseline REV`, the library built
from that revision's ``k3export/ops/csrc`` beside it, dense and MXFP4; with `--arch TARGET`, the library built for
``-march=TARGET``, dense and MXFP4. Columns: ms per call, GB/s of the selected
experts' bytes (each selected expert counted once), and that over the read pace of `--threads` threads (numpy sums
of 512 MiB, `peers.host_info`: one sequential pass, nothing computed). Medians of `--rounds` interleaved rounds; each
round builds its session afresh and drops it after, since an idle session's spinning thread takes a core from the
one being timed (two cores here). Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from k3export.converters.onnx import bodies
from k3export.runtime import ort_ops, ov_ext
from peers import host_info  # bench/ is the script's folder

OPSET = 21
BETA1, BETA2 = 4.0, 25.0


def _model(layers: list[dict[str, np.ndarray]], op: str, fn=None, **attrs) -> bytes:
    """`len(layers)` independent `op` nodes on one z, each its own weights (initializers) and routing (inputs);
    `attrs`: more attributes of each node."""
    # ranks known (OpenVINO's CPU plugin takes no input of unknown rank), sizes not
    nodes, inputs, outputs, inits = [], [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", "d"])], [], []
    for i, weights in enumerate(layers):
        names = {k: f"{k}_{i}" for k in weights}
        inits += [numpy_helper.from_array(a, names[k]) for k, a in weights.items()]
        inputs += [helper.make_tensor_value_info(f"weights_{i}", TensorProto.FLOAT, ["n", "k"]),
                   helper.make_tensor_value_info(f"indices_{i}", TensorProto.INT64, ["n", "k"])]
        nodes.append(helper.make_node(op, ["z", f"weights_{i}", f"indices_{i}", *names.values()], [f"u_{i}"],
                                      domain="k3", act="situ", beta1=BETA1, beta2=BETA2, **attrs))
        outputs.append(helper.make_tensor_value_info(f"u_{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "experts", inputs, outputs, inits)
    return helper.make_model(graph, functions=[fn] if fn else [], opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid("k3", 1)]).SerializeToString()


class _OpenVino:
    """`model` compiled by OpenVINO's CPU plugin with the k3 extension, behind ORT's ``run(None, feeds)``."""

    def __init__(self, model: bytes, threads: int) -> None:
        import io

        import openvino as ov

        from k3export.runtime.openvino_session import cpu_config

        core = ov.Core()
        core.add_extension(str(ov_ext.library()))
        config = {**cpu_config(core), "INFERENCE_NUM_THREADS": threads}
        self.request = core.compile_model(core.read_model(io.BytesIO(model)), "CPU", config).create_infer_request()
        self._tensor = ov.Tensor

    def run(self, _: None, feeds: dict[str, np.ndarray]) -> None:
        # as OpenVinoSession feeds: tensors over the arrays (numpy arrays fed as they are cost ~60 us each here)
        self.request.infer({name: self._tensor(a) for name, a in feeds.items()})


def open_session(model: bytes, threads: int, library: bool | str | Path) -> ort.InferenceSession | _OpenVino:
    """`model` under ORT (with the k3 ops library when `library`: True for this tree's, a path for another build)
    or, for ``"openvino"``, OpenVINO with the k3 extension; either answers ``run(None, feeds)``."""
    if library == "openvino":
        return _OpenVino(model, threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library:
        so.register_custom_ops_library(str(library if isinstance(library, Path) else ort_ops.build()))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def build_revision(rev: str, folder: Path) -> Path:
    """The k3 ops library built from git revision `rev`'s binding and kernels (its ``ops/csrc``), copied into
    `folder`."""
    root = Path(__file__).resolve().parents[1]
    csrc = ort_ops.SOURCES[0].parent.relative_to(root).as_posix()
    tar = subprocess.run(["git", "-C", str(root), "archive", rev, csrc], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=tar, check=True)
    # every header of that revision's folder (one header of all kernels once, one per op now) in the cache key
    binding = folder / csrc / ort_ops.SOURCES[0].name
    return ort_ops.build(sources=(binding, *sorted(binding.parent.rglob("*.h"))))


def _feeds(rng: np.random.Generator, n: int, layers: int, E: int, K: int, D: int) -> tuple[dict, int]:
    """One call's inputs (each token's top-K distinct experts at random, per layer) and the experts it selects."""
    feeds, chosen = {"z": rng.standard_normal((n, D), np.float32)}, 0
    for i in range(layers):
        idx = np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int64)
        feeds[f"indices_{i}"], feeds[f"weights_{i}"] = idx, np.full((n, K), 1 / K, np.float32)
        chosen += len(np.unique(idx))
    return feeds, chosen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=7, help="MoE layers (big_cfg: 7)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dim", type=int, default=256, help="D, the experts' input width")
    p.add_argument("--inter", type=int, default=256, help="I, the experts' hidden width")
    p.add_argument("--tokens", default="1,64", help="tokens per call, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--openvino", action="store_true", help="also the same nodes under OpenVINO with the k3 extension")
    p.add_argument("--calls", type=int, default=20, help="calls per round and variant")
    p.add_argument("--baseline", metavar="REV", help="also the library built from this git revision's C++ sources")
    p.add_argument("--arch", metavar="TARGET", help="also the library built for -march=TARGET (e.g. x86-64-v3)")
    args = p.parse_args()
    E, K, D, I = args.experts, args.top_k, args.dim, args.inter
    rng = np.random.default_rng(0)
    dense, mxfp4, nvfp4 = [], [], []
    for _ in range(args.layers):
        dense.append({"w1": rng.standard_normal((E, I, D), np.float32) * 0.05,
                      "w3": rng.standard_normal((E, I, D), np.float32) * 0.05,
                      "w2": rng.standard_normal((E, D, I), np.float32) * 0.05})
        packed = {m: rng.integers(0, 256, (E, rows, cols // 2), np.uint8) for m, rows, cols in
                  (("w1", I, D), ("w3", I, D), ("w2", D, I))}
        scales = {m + "_scale": rng.integers(118, 126, (E, a.shape[1], a.shape[2] * 2 // 32), np.uint8)
                  for m, a in packed.items()}
        mxfp4.append({**packed, **scales})
        e4m3 = {m + "_scale": rng.integers(0x28, 0x40, (E, a.shape[1], a.shape[2] * 2 // 16), np.uint8)
                for m, a in packed.items()}  # 2^-2 .. 1.875 x 2^0
        global_scales = {m + "_scale_2": rng.uniform(0.01, 0.02, E).astype(np.float32) for m in packed}
        nvfp4.append({**packed, **e4m3, **global_scales})
    body = bodies.moe_experts_function("k3", "situ", BETA1, BETA2, OPSET)
    # name: (model, with the library, bytes a selected expert holds)
    variants = {"dense, k3 ops library": (_model(dense, "moe_experts"), True, 4 * 3 * I * D),
                "dense, function bodies": (_model(dense, "moe_experts", body), False, 4 * 3 * I * D),
                "MXFP4, k3 ops library": (_model(mxfp4, "moe_experts_mxfp4"), True, 3 * I * D * 17 // 32),
                "MXFP4 on int8 activations (quantize_activations), k3 ops library": (
                    _model(mxfp4, "moe_experts_mxfp4", quantize_activations=1), True, 3 * I * D * 17 // 32),
                "NVFP4, k3 ops library": (_model(nvfp4, "moe_experts_nvfp4"), True, 3 * I * D * 9 // 16 + 12)}
    if args.baseline:
        base = build_revision(args.baseline, Path(tempfile.mkdtemp()))
        variants[f"dense, k3 ops library at {args.baseline}"] = (variants["dense, k3 ops library"][0], base,
                                                                 4 * 3 * I * D)
        variants[f"MXFP4, k3 ops library at {args.baseline}"] = (variants["MXFP4, k3 ops library"][0], base,
                                                                 3 * I * D * 17 // 32)
        q8 = "MXFP4 on int8 activations (quantize_activations), k3 ops library"
        variants[f"{q8} at {args.baseline}"] = (variants[q8][0], base, 3 * I * D * 17 // 32)
    if args.arch:
        other = ort_ops.build(arch=args.arch)
        variants[f"dense, k3 ops library for {args.arch}"] = (variants["dense, k3 ops library"][0], other,
                                                              4 * 3 * I * D)
        variants[f"MXFP4, k3 ops library for {args.arch}"] = (variants["MXFP4, k3 ops library"][0], other,
                                                              3 * I * D * 17 // 32)
    if args.openvino:
        variants["dense, OpenVINO + k3 extension"] = (_model(dense, "moe_experts"), "openvino", 4 * 3 * I * D)
    host = host_info(args.threads)
    pace = host["read_gb_s_threads"]
    print(f"host: {host['cpu']}, {args.threads} threads read {pace:.1f} GB/s; {args.layers} layers of {E} experts "
          f"top-{K}, D = {D}, I = {I}; medians of {args.rounds} rounds of {args.calls} calls")
    for n in (int(t) for t in args.tokens.split(",")):
        times: dict[str, list[float]] = {name: [] for name in variants}
        picked = 0
        for _ in range(args.rounds):
            for name, (model, library, _) in variants.items():
                sess = open_session(model, args.threads, library)
                sess.run(None, _feeds(rng, n, args.layers, E, K, D)[0])  # warm: the arena, the first touch of pages
                elapsed = 0.0
                for _ in range(args.calls):
                    feeds, chosen = _feeds(rng, n, args.layers, E, K, D)
                    t = time.perf_counter()
                    sess.run(None, feeds)
                    elapsed += time.perf_counter() - t
                    picked += chosen
                times[name].append(elapsed / args.calls)
                del sess
        experts_per_call = picked / (args.rounds * args.calls * len(variants))
        print(f"\n{n} token(s) a call, {experts_per_call:.0f} experts read a call")
        print("| variant | ms / call | GB/s | x read pace |\n|---|---:|---:|---:|")
        for name, (_, _, bytes_per_expert) in variants.items():
            sec = statistics.median(times[name])
            gbs = experts_per_call * bytes_per_expert / sec / 1e9
            print(f"| {name} | {sec * 1e3:.3f} | {gbs:.1f} | {gbs / pace:.2f} |")


if __name__ == "__main__":
    main()
