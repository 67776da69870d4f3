"""ONNX Runtime's CPU ``Mul`` / ``Div`` of a tensor by a one-element constant, by the tensor's and the constant's
shapes: a tensor whose last dimension is 1 times a rank-0 or rank-1 scalar goes element by element in ORT 1.32,
which is why the bodies write SiTU-GLU's scalars as ``[1, 1]`` (`bodies.situ_glu_nodes`, docs/speed.md).

    python bench/ort_broadcast.py                  # 2 threads, chains of 200 nodes, medians of 30 runs
    python bench/ort_broadcast.py --threads 1

Each cell is one session of a chain of nodes ``y = op(y, c)`` (graph optimisations off, so nothing is folded),
timed whole; the figure is microseconds a node. Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

TENSORS = ([1, 8, 256, 1], [8, 256, 1], [1, 2048], [8, 256])
CONSTANTS = ([], [1], [1, 1])


def chain(op: str, x_shape: list[int], c_shape: list[int], nodes: int) -> bytes:
    body = [helper.make_node(op, ["x" if i == 0 else f"y{i - 1}", "c"], [f"y{i}"]) for i in range(nodes)]
    graph = helper.make_graph(body, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(f"y{nodes - 1}", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones(c_shape, np.float32), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()


def us_per_node(op: str, x_shape: list[int], c_shape: list[int], threads: int, nodes: int, runs: int) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(chain(op, x_shape, c_shape, nodes), so, providers=["CPUExecutionProvider"])
    feeds = {"x": np.random.default_rng(0).random(x_shape, np.float32)}
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / nodes * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    print(f"ONNX Runtime {ort.__version__}, {args.threads} threads: us a node")
    print("| tensor | constant | Mul | Div |")
    print("|---|---|---:|---:|")
    for x_shape in TENSORS:
        for c_shape in CONSTANTS:
            cells = [us_per_node(op, x_shape, c_shape, args.threads, args.nodes, args.runs) for op in ("Mul", "Div")]
            print(f"| {x_shape} | {c_shape} | {cells[0]:.1f} | {cells[1]:.1f} |")


if __name__ == "__main__":
    main()
