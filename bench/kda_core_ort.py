"""KDA's core in plain ONNX Runtime (no k3 library, default session options): the standard form's
``ai.onnx::LinearAttention-27`` against ``com.microsoft::GatedDeltaNet`` with K3's gate fused.

    python bench/kda_core_ort.py                         # big_cfg's KDA (H 8, K = V 64), 6 layers, T 1 and 64
    python bench/kda_core_ort.py --tokens 1,64,512 --threads 2 --rounds 9

Both graphs start from the same raw inputs a K3 layer has after its short convs: q, k [B, T, H*K] not yet
L2-normed, v, the gate's pre-activation f = f_b_proj(f_a) [B, T, H*K], beta's logit [B, T, H], and per layer
``A_log`` [H] and ``dt_bias`` [H*K].

- ``standard``: what ``export --form standard`` writes: q, k L2-normed by standard ops (``ReduceSum`` / ``Sqrt`` /
  ``Div``), g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) and sigmoid(beta) as standard ops, then one
  ``LinearAttention-27`` (``gated_delta``, decay per key dimension); ORT 1.32 expands its function body into a
  ``Scan``. State [B, H, K, V], as the manifest has it.
- ``gdn``: one ``GatedDeltaNet`` (``gate_activation='kda'``, ``gate_lower_bound``, ``qk_l2_norm=1``,
  ``beta_activation='sigmoid'``), the raw inputs straight in; its state is V-major [B, H, V, K], fed as such.

Before timing, both graphs' outputs and states are checked against a float64 recurrence (`k3export.ops.naive`);
a mismatch stops the bench. Columns: ms per call (`--layers` KDA cores in one graph, each with its own state), the
ORT nodes run per call, and standard over gdn. Medians of `--rounds` interleaved rounds, each session built afresh.
Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

H, K = 8, 64  # big_cfg: linear_attn_config num_heads, head_dim
BOUND = -5.0  # K3's gate_lower_bound


def _graph(kind: str, layers: int, chunk: int = 0, opset: int = 27):
    """The model of `kind` (standard / gdn) over `layers` KDA cores sharing the inputs, each with its own state;
    `chunk` > 0: GatedDeltaNet's ``chunk_size`` (else its default)."""
    from onnx import TensorProto as TP, helper

    f32 = TP.FLOAT
    nodes, inits, outs = [], [], []
    n = helper.make_node
    c = {"eps": helper.make_tensor("eps", f32, [], [1e-6]), "bound": helper.make_tensor("bound", f32, [], [BOUND]),
         "axes": helper.make_tensor("axes", TP.INT64, [1], [-1]),
         "heads": helper.make_tensor("heads", TP.INT64, [4], [0, 0, H, K]),
         "flat": helper.make_tensor("flat", TP.INT64, [3], [0, 0, H * K])}
    inits += list(c.values())
    if kind == "standard":
        for x in ("q", "k"):  # L2 norm per head: x / sqrt(sum(x^2) + 1e-6), as `graph.K3GraphBuilder.l2norm`
            nodes += [n("Reshape", [x, "heads"], [f"{x}4"]), n("Mul", [f"{x}4", f"{x}4"], [f"{x}sq"]),
                      n("ReduceSum", [f"{x}sq", "axes"], [f"{x}ss"], keepdims=1),
                      n("Add", [f"{x}ss", "eps"], [f"{x}e"]),
                      n("Sqrt", [f"{x}e"], [f"{x}r"]), n("Div", [f"{x}4", f"{x}r"], [f"{x}n4"]),
                      n("Reshape", [f"{x}n4", "flat"], [f"{x}n"])]
        nodes.append(n("Sigmoid", ["beta_logit"], ["beta"]))
    else:  # GatedDeltaNet's [B, S, H, D] spelling (rank 3 would read as token-major [tokens, heads, size])
        nodes += [n("Reshape", [x, "heads"], [f"{x}4"]) for x in ("q", "k", "v", "f")]
        # state_update_active = 0: no compact transitions wanted, so ORT may pick its faster engines
        inits.append(helper.make_tensor("no_capture", TP.INT32, [1], [0]))
    for i in range(layers):
        a_log = np.random.default_rng(100 + i).uniform(-1, 1, H).astype(np.float32)
        dt_bias = np.random.default_rng(200 + i).uniform(-1, 1, H * K).astype(np.float32)
        inits += [helper.make_tensor(f"a_log{i}", f32, [H], a_log),
                  helper.make_tensor(f"dt_bias{i}", f32, [H * K], dt_bias)]
        if kind == "standard":
            inits.append(helper.make_tensor(f"a{i}", f32, [H * K], np.repeat(np.exp(a_log), K)))
            nodes += [n("Add", ["f", f"dt_bias{i}"], [f"fb{i}"]), n("Mul", [f"fb{i}", f"a{i}"], [f"fa{i}"]),
                      n("Sigmoid", [f"fa{i}"], [f"fs{i}"]), n("Mul", [f"fs{i}", "bound"], [f"g{i}"]),
                      n("LinearAttention", ["qn", "kn", "v", f"s{i}", f"g{i}", "beta"], [f"o{i}", f"s{i}_out"],
                        update_rule="gated_delta", q_num_heads=H, kv_num_heads=H, scale=K ** -0.5)]
        else:
            nodes.append(n("GatedDeltaNet", ["q4", "k4", "v4", "", "f4", "beta_logit", f"s{i}", f"a_log{i}",
                                             f"dt_bias{i}", "", "no_capture"],
                           [f"o{i}", f"s{i}_out"], domain="com.microsoft", gate_activation="kda",
                           gate_lower_bound=BOUND, qk_l2_norm=1, beta_activation="sigmoid", scale=K ** -0.5,
                           update_rule="gated_delta", **({"chunk_size": chunk} if chunk else {})))
        outs += [f"o{i}", f"s{i}_out"]
    vi = helper.make_tensor_value_info
    inputs = [vi(x, f32, ["B", "T", H * K]) for x in ("q", "k", "v", "f")] + [vi("beta_logit", f32, ["B", "T", H])]
    inputs += [vi(f"s{i}", f32, ["B", H, K, K]) for i in range(layers)]
    graph = helper.make_graph(nodes, kind, inputs, [helper.make_tensor_value_info(o, f32, None) for o in outs], inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if kind == "gdn" else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=11)


def _feeds(tokens: int, layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = {x: rng.standard_normal((1, tokens, H * K)).astype(np.float32) for x in ("q", "k", "v", "f")}
    f["beta_logit"] = rng.standard_normal((1, tokens, H)).astype(np.float32)
    for i in range(layers):
        f[f"s{i}"] = (rng.standard_normal((1, H, K, K)) * 0.1).astype(np.float32)
    return f


def _for(kind: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`feeds` (states [B, H, K, V]) as `kind` takes them: GatedDeltaNet's states V-major [B, H, V, K]."""
    if kind == "standard":
        return feeds
    return {n: np.ascontiguousarray(x.transpose(0, 1, 3, 2)) if n.startswith("s") else x for n, x in feeds.items()}


def _reference(feeds: dict[str, np.ndarray], layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer `layer`'s (o [B, T, H*K], state [B, H, K, V]) by the float64 recurrence, from the raw inputs."""
    import torch

    from k3export.ops.naive import kda_naive

    def l2(x):
        x = x.reshape(1, -1, H, K).astype(np.float64)
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    a_log = np.random.default_rng(100 + layer).uniform(-1, 1, H).astype(np.float32).astype(np.float64)
    dt_bias = np.random.default_rng(200 + layer).uniform(-1, 1, H * K).astype(np.float32).astype(np.float64)
    f = (feeds["f"].astype(np.float64) + dt_bias).reshape(1, -1, H, K)
    g = BOUND / (1 + np.exp(-np.exp(a_log)[:, None] * f))
    beta = 1 / (1 + np.exp(-feeds["beta_logit"].astype(np.float64)))
    v = feeds["v"].reshape(1, -1, H, K).astype(np.float64)
    o, s = kda_naive(*(torch.from_numpy(x) for x in (l2(feeds["q"]), l2(feeds["k"]), v, g, beta,
                                                     feeds[f"s{layer}"].astype(np.float64))), K ** -0.5)
    return o.numpy().reshape(1, -1, H * K), s.numpy()


def _session(model, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _nodes_run(model, feeds, threads: int) -> int:
    """Nodes ORT's profiler records in one call (after its optimisations and function expansion)."""
    import json
    import os
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "p")
        s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        s.run(None, feeds)
        s.run(None, feeds)
        events = json.loads(open(s.end_profiling()).read())
    last = [e for e in events if e.get("name") == "model_run"][-1]
    return sum(1 for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
               and last["ts"] <= e["ts"] <= last["ts"] + last["dur"])


def check(kind: str, model, feeds, layers: int, threads: int) -> float:
    """Largest abs error of `kind`'s outputs and states against the float64 recurrence (raises beyond 1e-4)."""
    got = _session(model, threads).run(None, _for(kind, feeds))
    worst = 0.0
    for i in range(layers):
        o, s = _reference(feeds, i)
        state = got[2 * i + 1] if kind == "standard" else got[2 * i + 1].transpose(0, 1, 3, 2)  # V-major
        worst = max(worst, float(np.abs(got[2 * i].reshape(o.shape) - o).max()), float(np.abs(state - s).max()))
    if not worst < 1e-4:
        raise SystemExit(f"{kind}: {worst:.2e} from the float64 recurrence")
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,64", help="comma-separated sequence lengths (1: a decode step)")
    p.add_argument("--layers", type=int, default=6, help="KDA cores per graph (big_cfg: 6 KDA layers)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="calls timed per round (after 3 warm-up calls)")
    p.add_argument("--gdn-chunk", type=int, default=0, help="GatedDeltaNet's chunk_size (0: its default)")
    args = p.parse_args()
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}, H {H}, K = V {K}, {args.layers} layers, {args.threads} threads, "
          f"GatedDeltaNet chunk_size {args.gdn_chunk or 'default'}")
    print("| tokens | standard (LinearAttention-27) ms | nodes | gdn (GatedDeltaNet, kda gate) ms | nodes | "
          "standard / gdn | max err vs float64 (standard / gdn) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    models = {kind: _graph(kind, args.layers, args.gdn_chunk) for kind in ("standard", "gdn")}
    for tokens in (int(t) for t in args.tokens.split(",")):
        feeds = _feeds(tokens, args.layers)
        errs = {kind: check(kind, m, feeds, args.layers, args.threads) for kind, m in models.items()}
        times: dict[str, list[float]] = {kind: [] for kind in models}
        for _ in range(args.rounds):
            for kind, model in models.items():  # interleaved, each session built afresh
                s, fed = _session(model, args.threads), _for(kind, feeds)
                for _ in range(3):
                    s.run(None, fed)
                t = time.perf_counter()
                for _ in range(args.calls):
                    s.run(None, fed)
                times[kind].append((time.perf_counter() - t) / args.calls * 1e3)
                del s
        med = {kind: statistics.median(v) for kind, v in times.items()}
        nodes = {kind: _nodes_run(m, _for(kind, feeds), args.threads) for kind, m in models.items()}
        print(f"| {tokens} | {med['standard']:.3f} | {nodes['standard']} | {med['gdn']:.3f} | {nodes['gdn']} | "
              f"{med['standard'] / med['gdn']:.2f} | {errs['standard']:.1e} / {errs['gdn']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
