"""Nodes ONNX Runtime runs in one decode step of an export, by operator, from ORT's own profiler.

    python bench/ort_nodes.py EXPORT_DIR [EXPORT_DIR ...]          # prompt 64, then the second decode step
    python bench/ort_nodes.py DIR --top 20 --threads 2
    python bench/ort_nodes.py --openvino DIR                       # OpenVINO: OpenVinoRunner's compiled operations,
                                                                   # their times in one decode step, and one k3 op's
                                                                   # cost in each runtime
    python bench/ort_nodes.py DIR --k3-ops both                    # with and without the k3 custom-op library

Every node the CPU provider executes in the step is counted (the nodes inside the branch an ``If`` takes as well
as the ``If`` itself), after ORT's graph optimisations: the figure that per-node overhead scales with. Kernel
times come from the profiler, which adds its own cost to every node (~4 us here, against ~0.4 us for a one-vector
``Mul`` unprofiled): the "less profiler" column takes off that cost, measured in the same run on a chain of 500
such ``Mul`` nodes profiled and not. Not part of CI.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import tempfile
import time
from pathlib import Path



def decode_step_nodes(export: Path, threads: int, prompt: int,
                      k3_ops: bool = True) -> tuple[collections.Counter, collections.Counter]:
    """(nodes by operator, profiled microseconds by operator) of the second decode step after a `prompt`-token
    prefill of `export`'s model.onnx, run by k3export's ORT session (the export's session options; `k3_ops`: with
    the k3 custom-op library where it builds, `k3export.runtime.ort_ops`)."""
    import numpy as np

    from k3export.artifacts import load_export
    from k3export.runtime.ort_session import OrtSession

    exp = load_export(export)
    with tempfile.TemporaryDirectory(prefix="k3-ort-nodes-") as tmp:
        options = {**exp.runtime.session_options, "enable_profiling": True,
                   "profile_file_prefix": os.path.join(tmp, "profile")}
        session = OrtSession(exp.ort_form_path or exp.model_path, threads=threads, options=options, k3_ops=k3_ops)
        state = exp.manifest.initial_state(1)
        for past, ids in ((0, np.arange(3, 3 + prompt)), (prompt, [5]), (prompt + 1, [6])):
            feeds = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, past + len(ids)), np.int64),
                     **state}
            out = session.run(feeds)
            state = {s.name: out[s.present] for s in exp.manifest.states}
        events = json.loads(Path(session.session.end_profiling()).read_text())
    last = [e for e in events if e.get("name") == "model_run"][-1]
    step = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
            and last["ts"] <= e["ts"] <= last["ts"] + last["dur"]]
    count, micros = collections.Counter(), collections.Counter()
    for e in step:
        count[e["args"]["op_name"]] += 1
        micros[e["args"]["op_name"]] += e["dur"]
    return count, micros


def profiler_cost_us(threads: int, nodes: int = 500) -> float:
    """Microseconds ORT's profiler adds to each node: a chain of `nodes` one-vector ``Mul`` nodes, its profiled mean
    kernel time less its unprofiled time per node (medians of 100 runs)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    chain = [helper.make_node("Mul", ["x" if i == 0 else f"y{i - 1}", "c"], [f"y{i}"]) for i in range(nodes)]
    graph = helper.make_graph(chain, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 512])],
                              [helper.make_tensor_value_info(f"y{nodes - 1}", TensorProto.FLOAT, None)],
                              [helper.make_tensor("c", TensorProto.FLOAT, [512], np.ones(512, np.float32))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    feeds = {"x": np.ones((1, 512), np.float32)}
    with tempfile.TemporaryDirectory(prefix="k3-ort-nodes-") as tmp:
        per_node = []
        for profiled in (False, True):
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            so.enable_profiling, so.profile_file_prefix = profiled, os.path.join(tmp, "chain")
            session = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            walls = []
            for _ in range(100):
                t = time.perf_counter()
                session.run(None, feeds)
                walls.append(time.perf_counter() - t)
            if not profiled:
                per_node.append(sorted(walls)[len(walls) // 2] / nodes * 1e6)
            else:
                events = json.loads(Path(session.end_profiling()).read_text())
                kernels = sorted(e["dur"] for e in events if e.get("cat") == "Node" and
                                 e["name"].endswith("_kernel_time"))
                per_node.append(kernels[len(kernels) // 2])
    return per_node[1] - per_node[0]


def kda_chain_us(threads: int, nodes: int = 50) -> dict[str, float]:
    """Microseconds a ``k3::kda`` node takes at decode shapes (batch 1, one token, 8 heads of 64) in a chain of
    `nodes` (each one's state feeding the next), per runtime: ONNX Runtime with the k3 ops library and OpenVINO with
    the k3 extension, the same kernel behind both (medians of 200 runs of the chain)."""
    import numpy as np
    from onnx import TensorProto, helper

    from experts_cpu import open_session  # bench/ is the script's folder

    H, K = 8, 64
    shapes = {"q": ["b", "t", H, K], "k": ["b", "t", H, K], "v": ["b", "t", H, K], "g": ["b", "t", H, K],
              "beta": ["b", "t", H], "s": ["b", H, K, K]}
    chain = [helper.make_node("kda", ["q", "k", "v", "g", "beta", "s" if i == 0 else f"s{i - 1}"], [f"o{i}", f"s{i}"],
                              domain="k3", scale=K ** -0.5) for i in range(nodes)]
    graph = helper.make_graph(chain, "kda_chain",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in shapes.items()],
                              [helper.make_tensor_value_info(f"s{nodes - 1}", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("k3", 1)])
    rng = np.random.default_rng(0)
    feeds = {n: rng.uniform(-0.1, 0.1, [1 if isinstance(x, str) else x for x in d]).astype(np.float32)
             for n, d in shapes.items()}
    feeds["g"] -= 0.2
    per_node = {}
    # one session alive at a time: an idle ORT session's spinning thread takes a core from the other
    for name, library in (("ORT + k3 ops library", True), ("OpenVINO + k3 extension", "openvino")):
        session = open_session(model.SerializeToString(), threads, library)
        for _ in range(20):
            session.run(None, feeds)
        walls = []
        for _ in range(200):
            t = time.perf_counter()
            session.run(None, feeds)
            walls.append(time.perf_counter() - t)
        per_node[name] = sorted(walls)[len(walls) // 2] / nodes * 1e6
        del session
    return per_node


@functools.cache
def _k3_ops() -> list[str]:
    """The k3 operations OpenVINO's extension runs, longest name first (so a name that holds another wins)."""
    from k3export.ops.spec import LIBRARY_SPECS

    return sorted(LIBRARY_SPECS, key=len, reverse=True)


def _k3_op(node_name: str) -> str:
    """The k3 operation a Reference layer of OpenVINO's runtime model runs, from its name (the ONNX node's)."""
    return next((n for n in _k3_ops() if n in node_name), "other")


def openvino_nodes(export: Path, threads: int, prompt: int,
                   decode_graph: bool = False) -> tuple[collections.Counter, dict, float, str]:
    """Operations of `export`'s model as `OpenVinoRunner` compiles it for OpenVINO's CPU plugin (its runtime model;
    a graph without ``If`` runs each of them every call), by type, without parameters, results and constants;
    ({executed operation type: (count, microseconds)} of the 32nd decode step after a `prompt`-token prefill,
    from the plugin's own per-operation counters, ``PERF_COUNT``, the k3 extension's by operation); the median
    step's wall time in microseconds (steps 9-32, counters on); and the runner's description. `decode_graph`: the
    model compiled for one token, which decodes in ``openvino-decode-graph``."""
    import statistics

    import numpy as np

    from k3export.runtime.openvino_runner import OpenVinoRunner

    runner = OpenVinoRunner(export, threads=threads, properties={"PERF_COUNT": True}, decode_graph=decode_graph)
    request = runner.ov.one_token.request if decode_graph else runner.ov.request  # the request that decodes
    ops = request.get_compiled_model().get_runtime_model().get_ordered_ops()
    types = (op.get_rt_info()["layerType"].astype(str) for op in ops)
    count = collections.Counter(t for t in types if t not in ("Parameter", "Result", "Const"))
    out = runner.prefill(np.arange(3, 3 + prompt)[None])
    walls = []
    for step in range(32):  # the first steps after a prefill run slower (first touches): the 32nd is profiled
        t = time.perf_counter()
        out = runner.forward(np.array([[5 + step]]), out.state, np.ones((1, prompt + step + 1), np.int64))
        walls.append(time.perf_counter() - t)
    timed: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for info in request.get_profiling_info():
        if info.status.name == "EXECUTED":
            kind = f"Reference: {_k3_op(info.node_name)}" if info.node_type == "Reference" else info.node_type
            timed[kind][0] += 1
            timed[kind][1] += info.real_time.total_seconds() * 1e6
    return count, dict(timed), statistics.median(walls[8:]) * 1e6, runner.describe()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("exports", nargs="+", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--openvino", action="store_true", help="OpenVINO's compiled operations and their times instead")
    p.add_argument("--decode-graph", action="store_true",
                   help="with --openvino: the model compiled for one token (`openvino-decode-graph`) that decodes")
    p.add_argument("--k3-ops", choices=("on", "off", "both"), default="on",
                   help="ORT with the k3 custom-op library (on, where it builds), without it, or both")
    args = p.parse_args()
    for export in args.exports if args.openvino else ():
        count, timed, wall, how = openvino_nodes(export, args.threads, args.prompt, args.decode_graph)
        print(f"\n{export}: {sum(count.values())} operations in OpenVINO's compiled model ({len(count)} types; {how})")
        print("| operation | count |")
        print("|---|---:|")
        for op, n in count.most_common(args.top):
            print(f"| {op} | {n} |")
        print(f"\none decode step, {sum(us for _, us in timed.values()) / 1e3:.1f} ms in its operations (the plugin's "
              f"counters; Reference: the k3 extension's operations) of a {wall / 1e3:.1f} ms step")
        print("| executed operation | count | us |")
        print("|---|---:|---:|")
        for op, (n, us) in sorted(timed.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"| {op} | {n} | {us:.0f} |")
    if args.openvino:
        chain = kda_chain_us(args.threads)
        print("\none k3::kda node at decode shapes, in a chain of 50: " +
              ", ".join(f"{name} {us:.1f} us" for name, us in chain.items()))
    uses = {"on": (True,), "off": (False,), "both": (False, True)}[args.k3_ops]
    cost = None if args.openvino else profiler_cost_us(args.threads)
    for export, use in ((e, u) for e in (() if args.openvino else args.exports) for u in uses):
        count, micros = decode_step_nodes(export, args.threads, args.prompt, use)
        less = {op: micros[op] - n * cost for op, n in count.items()}
        print(f"\n{export} ({'with' if use else 'without'} the k3 ops library): {sum(count.values())} nodes in one decode step "
              f"({len(count)} operators, profiled kernel time {sum(micros.values()) / 1e3:.1f} ms, "
              f"{sum(less.values()) / 1e3:.1f} ms less the profiler's {cost:.1f} us a node)")
        print("| operator | nodes | profiled us | less profiler |")
        print("|---|---:|---:|---:|")
        for op, n in count.most_common(args.top):
            print(f"| {op} | {n} | {micros[op]} | {less[op]:.0f} |")


if __name__ == "__main__":
    main()
