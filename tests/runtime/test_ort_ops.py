"""The k3 custom-op library of ONNX Runtime (`k3export.runtime.ort_ops`): it builds here, ORT runs its kernel where
the model holds the op's function (checked in ORT's profile), each op matches the naive references in float64, and
the tiny export gives the same logits and states with the library as with the function bodies."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from k3export.converters.onnx import bodies, functions
from k3export.ops import naive
from k3export.runtime import ort_ops
from fused_ref import (l2_norm_case, mla_attend_case, moe_route_experts_case, short_conv_case,  # tests/ on sys.path
                       kda_layer_case)

ort = pytest.importorskip("onnxruntime")
OPSET = 21


def _model(fn, op, inputs, outputs, **attrs):
    """A one-node model of k3 op `op` with its function `fn`; inputs / outputs: (name, numpy array or (dtype, rank))."""
    def info(name, arr):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), None)
    node = helper.make_node(op, [n for n, _ in inputs], [n for n, _ in outputs], domain="k3", plugin_namespace="k3",
                            **attrs)
    graph = helper.make_graph([node], op, [info(n, a) for n, a in inputs], [info(n, a) for n, a in outputs])
    return helper.make_model(graph, functions=[fn],
                             opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("k3", 1)])


def _run(model, feeds, lib):
    """Outputs and the op types ORT ran (its profile), with `lib` registered or (None) without."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="k3ops-") as tmp:  # a failing run leaves its profile here
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = f"{tmp}/profile"
        if lib:
            so.register_custom_ops_library(str(lib))
        s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        out = s.run(None, feeds)
        with open(s.end_profiling()) as f:
            events = json.load(f)
    ran = {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}
    return out, ran


def _t(a):
    return torch.from_numpy(a).double()


def test_situ_glu(kernels):
    rng = np.random.default_rng(0)
    g, u = (rng.normal(0, 6, (3, 7, 5)).astype(np.float32) for _ in range(2))
    m = _model(functions.situ_glu_function(OPSET), "situ_glu", [("gate", g), ("up", u)], [("out", g)],
               beta1=4.0, beta2=25.0)
    (got,), ran = _run(m, {"gate": g, "up": u}, kernels)
    assert ran == {"situ_glu"}
    ref = naive.situ_glu_naive(_t(g), _t(u), 4.0, 25.0).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 5])
def test_kda(kernels, T):
    rng = np.random.default_rng(T)
    B, H, K = 2, 2, 8
    q, k = (rng.normal(size=(B, T, H, K)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.normal(size=(B, T, H, K)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (B, T, H, K)).astype(np.float32)
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    s0 = rng.normal(size=(B, H, K, K)).astype(np.float32)
    feeds = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0)
    m = _model(bodies.kda_function("k3", H, OPSET), "kda", list(feeds.items()), [("o", q), ("final_state", s0)],
               scale=K ** -0.5)
    (o, s1), ran = _run(m, feeds, kernels)
    assert ran == {"kda"}
    ro, rs = naive.kda_naive(*(_t(a) for a in feeds.values()), K ** -0.5)
    np.testing.assert_allclose(o, ro.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s1, rs.numpy(), rtol=1e-5, atol=1e-5)
    (bo, bs), _ = _run(m, feeds, None)  # and the function body agrees
    np.testing.assert_allclose(o, bo, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s1, bs, rtol=1e-5, atol=1e-5)


def test_moe_route(kernels):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 16)).astype(np.float32)
    logits[0, 3] = logits[0, 9]  # a tie: the lower index first
    bias = np.zeros(16, np.float32)
    bias[5:] = rng.normal(size=11).astype(np.float32) * 0.1
    m = _model(functions.moe_route_function(OPSET), "moe_route", [("logits", logits), ("bias", bias)],
               [("weights", logits), ("indices", np.zeros(1, np.int64))], top_k=4, renormalize=1, scale=2.5)
    (w, idx), ran = _run(m, {"logits": logits, "bias": bias}, kernels)
    assert ran == {"moe_route"}
    rw, ri = naive.moe_route_naive(torch.from_numpy(logits), torch.from_numpy(bias), 4, True, 2.5)
    np.testing.assert_array_equal(idx, ri.numpy())
    np.testing.assert_allclose(w, rw.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts(kernels, act):
    rng = np.random.default_rng(2)
    N, D, I, E, top_k = 5, 16, 8, 6, 2
    z = rng.normal(size=(N, D)).astype(np.float32)
    w = rng.uniform(0.1, 1, (N, top_k)).astype(np.float32)
    idx = np.stack([rng.choice(E, top_k, replace=False) for _ in range(N)]).astype(np.int64)
    w1, w3 = (rng.normal(0, 0.5, (E, I, D)).astype(np.float32) for _ in range(2))
    w2 = rng.normal(0, 0.5, (E, D, I)).astype(np.float32)
    feeds = dict(z=z, weights=w, indices=idx, w1=w1, w3=w3, w2=w2)
    m = _model(bodies.moe_experts_function("k3", act, 4.0, 25.0, OPSET), "moe_experts", list(feeds.items()),
               [("u", z)], act=act, beta1=4.0, beta2=25.0)
    (u,), ran = _run(m, feeds, kernels)
    assert ran == {"moe_experts"}
    ref = naive.moe_experts_naive(_t(z), _t(w), torch.from_numpy(idx), _t(w1), _t(w3), _t(w2), act, 4.0, 25.0)
    np.testing.assert_allclose(u, ref.numpy(), rtol=1e-5, atol=1e-5)
    bad = dict(feeds, indices=np.full_like(idx, E))  # an expert id out of range: ORT's error, not a crash
    with pytest.raises(Exception, match="indices"):
        _run(m, bad, kernels)


def _aggregate_model(S, rows, D, softmax_axis=0):
    """The Attention-Residuals aggregate as `graph.K3GraphBuilder.aggregate` writes it: S sources [rows, D] stacked
    by Unsqueeze + Concat, RMSNormalization with gain gamma * w, ReduceSum, Softmax over depth, Mul, ReduceSum."""
    f = TensorProto.FLOAT
    names = [f"v{i}" for i in range(S)]
    nodes = [helper.make_node("Unsqueeze", [n, "axis0"], [f"u{n}"]) for n in names]
    nodes += [helper.make_node("Concat", [f"u{n}" for n in names], ["vals"], axis=0),
              helper.make_node("Mul", ["gamma", "w"], ["gw"]),
              helper.make_node("RMSNormalization", ["vals", "gw"], ["keys"], axis=-1, epsilon=1e-5, stash_type=1),
              helper.make_node("ReduceSum", ["keys", "last"], ["logits"], keepdims=1),
              helper.make_node("Softmax", ["logits"], ["alpha"], axis=softmax_axis),
              helper.make_node("Mul", ["alpha", "vals"], ["weighed"]),
              helper.make_node("ReduceSum", ["weighed", "axis0"], ["out"], keepdims=0)]
    inits = [helper.make_tensor("axis0", TensorProto.INT64, [1], [0]),
             helper.make_tensor("last", TensorProto.INT64, [1], [-1])]
    graph = helper.make_graph(nodes, "aggregate", [helper.make_tensor_value_info(n, f, [rows, D]) for n in names]
                              + [helper.make_tensor_value_info(n, f, [D]) for n in ("gamma", "w")],
                              [helper.make_tensor_value_info("out", f, [rows, D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


@pytest.mark.parametrize("S,rows", [(1, 1), (3, 1), (5, 37)])
def test_attn_res_aggregate_fused(kernels, S, rows):
    """The aggregate's standard ops fused into the library's kernel (`fusions.fuse_attn_res`): ORT runs the one
    kernel, equal to the modeling file's aggregate in float64 and to the standard ops it replaced."""
    from k3export.converters.onnx.fusions import fuse_attn_res
    from k3export.modeling import modeling_k3 as mk

    rng = np.random.default_rng(S)
    D = 48
    feeds = {f"v{i}": rng.normal(0, 3, (rows, D)).astype(np.float32) for i in range(S)}
    feeds.update(gamma=rng.normal(size=D).astype(np.float32), w=rng.normal(size=D).astype(np.float32))
    model = _aggregate_model(S, rows, D)
    (standard,), ran = _run(model, feeds, None)
    assert "attn_res_aggregate" not in ran
    assert fuse_attn_res(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Mul", "attn_res_aggregate"]
    (fused,), ran = _run(model, feeds, kernels)
    assert ran == {"Mul", "attn_res_aggregate"}
    sources = [_t(feeds[f"v{i}"]) for i in range(S)]
    ref = mk.attn_res_aggregate.fallback(sources, _t(feeds["w"])[None], _t(feeds["gamma"]), 1e-5).numpy()
    # fp32 rounding of the S-term sum, and of the D-term dot products behind each logit (summed in any order: a
    # random walk, sqrt(D)) carried through the softmax; fused and standard ops both round, so twice that between them
    atol = max((S + D ** 0.5) * 2.0**-24 * max(np.abs(v).max() for v in feeds.values()), 2e-6)
    np.testing.assert_allclose(fused, ref, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(fused, standard, rtol=1e-5, atol=2 * atol)


def test_fusion_leaves_another_pattern_alone():
    """A subgraph that differs (softmax over the features, not over depth) is not the aggregate: nothing fused."""
    from k3export.converters.onnx.fusions import fuse_attn_res

    model = _aggregate_model(3, 2, 16, softmax_axis=-1)
    before = [n.op_type for n in model.graph.node]
    assert fuse_attn_res(model) == 0 and [n.op_type for n in model.graph.node] == before


def _unfused(tiny, **kwargs):
    """The tiny export's graph as the builder writes it, before the exporter fuses it (``kernels=False``)."""
    from k3export.converters.onnx.export import build_model_proto

    return build_model_proto(tiny.config, "fp32", 27, debug_outputs=True, kernels=False, **kwargs)[0]


def test_fusions_match_every_pattern_the_builder_writes(tiny):
    """Every aggregate `graph.py` writes for the tiny export (two a layer but the first layer's attention, plus the
    output's), every MLA layer's attention ``If`` and every KDA layer's short convolution is fused."""
    from k3export.converters.onnx.fusions import (fuse_attn_res, fuse_l2_norm, fuse_mla_attend, fuse_moe_route_experts,
                                                  fuse_short_conv, fuse_kda_layer)

    model = _unfused(tiny)
    assert tiny.config.use_attn_res
    assert fuse_attn_res(model) == 2 * tiny.config.num_hidden_layers
    mla_layers = tiny.config.attn_types.count("mla")
    assert mla_layers and fuse_mla_attend(model) == mla_layers
    assert not [n for n in model.graph.node if n.op_type == "If"]  # MLA's query-block choice was the only one
    # each reads its layer's present key / value halves in place: the cache is no longer joined, transposed or cut
    assert [helper.get_attribute_value(a) for n in model.graph.node if n.op_type == "mla_attend"
            for a in n.attribute if a.name == "halves"] == [1] * mla_layers
    kda_layers = tiny.config.attn_types.count("kda")
    assert kda_layers and fuse_short_conv(model) == kda_layers
    assert not [n for n in model.graph.node if n.op_type in ("Sum", "GatherElements")]  # the taps' sum, the window
    assert fuse_l2_norm(model) == 2 * kda_layers  # q and k
    assert not [n for n in model.graph.node if n.op_type in ("Sqrt", "Div")]
    assert fuse_kda_layer(model) == kda_layers  # the conv, the split, the norms and the recurrence
    assert not [n for n in model.graph.node if n.op_type in ("short_conv", "l2_norm", "kda")]
    assert not [n for n in model.graph.node if n.op_type == "Softmax"
                and any(a.name == "axis" and a.i == 0 for a in n.attribute)]  # no softmax over depth is left
    moe_layers = [n.op_type for n in model.graph.node].count("moe_experts")
    assert moe_layers and fuse_moe_route_experts(model) == moe_layers  # each router with its experts
    assert not [n for n in model.graph.node if n.op_type in ("moe_route", "moe_experts")]


def test_tiny_export_holds_the_fused_ops_and_the_library_runs_them(ort_lib, export_dir, tiny):
    """The export writes every fused op (``kernels``, the functions form's default) with its function, and a session
    with the library runs their kernels: the file as it is, nothing rewritten at load."""
    import tempfile

    from k3export.artifacts import load_export
    from k3export.runtime.ort_session import ort_session

    model = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    layers, kda_layers = tiny.config.num_hidden_layers, tiny.config.attn_types.count("kda")
    mla_layers, moe_layers = tiny.config.attn_types.count("mla"), ops.count("moe_route_experts")
    assert ops.count("attn_res_aggregate") == 2 * layers and ops.count("mla_attend") == mla_layers
    assert ops.count("kda_layer") == kda_layers and moe_layers and "If" not in ops
    assert not {"short_conv", "l2_norm", "kda", "moe_route", "moe_experts"} & set(ops)
    functions = {(f.name, f.overload) for f in model.functions}
    assert {("mla_attend", ""), ("kda_layer", ""), ("short_conv", ""), ("l2_norm", ""),
            ("moe_route_experts", "")} <= functions
    assert {f"s{len(n.input) - 1}" for n in model.graph.node if n.op_type == "attn_res_aggregate"} == \
        {o for name, o in functions if name == "attn_res_aggregate"}
    with tempfile.TemporaryDirectory(prefix="k3ops-") as tmp:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = f"{tmp}/profile"
        ort_ops.register(so)
        s = ort_session(export_dir / "model.onnx", so, k3_ops=True)
        ids = np.array([[3, 4, 5]], np.int64)
        s.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                     **load_export(export_dir).manifest.initial_state(1)})
        with open(s.end_profiling()) as f:
            ran = [e["args"]["op_name"] for e in json.load(f)
                   if e.get("cat") == "Node" and "op_name" in e.get("args", {})]
    assert ran.count("attn_res_aggregate") >= 2 * layers
    assert ran.count("mla_attend") >= mla_layers and "If" not in ran
    assert ran.count("kda_layer") >= kda_layers and not {"short_conv", "l2_norm", "kda"} & set(ran)
    assert ran.count("moe_route_experts") >= moe_layers and not {"moe_route", "moe_experts"} & set(ran)


def test_an_export_without_fused_ops_runs_and_says_how_to_reexport(ort_lib, export_dir, tiny, tmp_path, caplog,
                                                                   monkeypatch):
    """``--no-kernels`` (or an export written before the exporter fused): the library runs it as written, with the
    logits of the fused export, and says once how to write the fused ops."""
    from k3export.converters.onnx import export_onnx
    from k3export.runtime.ort_runner import OrtRunner

    export_onnx(tiny, tmp_path / "unfused", dtype="fp32", debug_outputs=True, kernels=False)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "unfused" / "model.onnx"), load_external_data=False).graph.node}
    assert not ops & {"attn_res_aggregate", "mla_attend", "kda_layer", "moe_route_experts"}
    monkeypatch.setenv(ort_ops.ENV_SWITCH, "1")
    ids = np.array([[3, 4, 5, 6]], np.int64)
    logits = {}
    with caplog.at_level("WARNING"):
        for folder in (export_dir, tmp_path / "unfused", tmp_path / "unfused"):
            runner = OrtRunner(folder)
            assert runner.ort.k3_ops
            logits[folder] = np.array(runner.forward(ids, runner.initial_state(1), np.ones_like(ids)).logits)
    told = [r.getMessage() for r in caplog.records if "fused ops" in r.getMessage()]
    assert len(told) == 1 and "unfused" in told[0] and "--kernels" in told[0]
    np.testing.assert_allclose(logits[tmp_path / "unfused"], logits[export_dir], rtol=0, atol=1e-4)


def test_a_kda_layer_whose_q_is_read_elsewhere_is_not_fused_whole(tiny):
    """`fuse_kda_layer` leaves a KDA layer alone when its normalised q is also a graph output (the node that
    makes it must stay), and fuses the others; the graph stays in topological order either way."""
    from k3export.converters.onnx.fusions import fuse_l2_norm, fuse_short_conv, fuse_kda_layer

    model = _unfused(tiny)
    kda_layers = tiny.config.attn_types.count("kda")
    assert fuse_short_conv(model) == kda_layers and fuse_l2_norm(model) == 2 * kda_layers
    first = next(n for n in model.graph.node if n.op_type == "kda")
    model.graph.output.append(helper.make_tensor_value_info(first.input[0], TensorProto.FLOAT, None))
    assert fuse_kda_layer(model) == kda_layers - 1
    assert [n.op_type for n in model.graph.node].count("kda") == 1
    made = {i for n in model.graph.node for i in n.input} - {o for n in model.graph.node for o in n.output}
    for node in model.graph.node:  # every node after the nodes that make its inputs (the rest: inputs, weights)
        assert set(node.input) <= made, node.name
        made |= set(node.output)


def test_a_router_whose_indices_are_read_elsewhere_is_not_fused(tiny):
    """`fuse_moe_route_experts` leaves a router alone when its indices are also a graph output (the node that makes
    them must stay), and fuses the others."""
    from k3export.converters.onnx.fusions import fuse_moe_route_experts

    model = _unfused(tiny)
    routers = [n for n in model.graph.node if n.op_type == "moe_route"]
    assert len(routers) > 1
    model.graph.output.append(helper.make_tensor_value_info(routers[0].output[1], TensorProto.INT64, None))
    assert fuse_moe_route_experts(model) == len(routers) - 1
    assert [n.op_type for n in model.graph.node].count("moe_experts") == 1


def test_a_state_window_exports_short_conv_is_left_alone(tiny, tmp_path):
    """With a state window (docs/state.md) the conv's rows also feed the window of conv states: the pattern
    differs, and nothing of it is fused."""
    from k3export.converters.onnx import export_onnx
    from k3export.converters.onnx.fusions import fuse_short_conv

    export_onnx(tiny, tmp_path / "w4", dtype="fp32", state_window=4)
    model = onnx.load(str(tmp_path / "w4" / "model.onnx"), load_external_data=False)
    sums = len([n for n in model.graph.node if n.op_type == "Sum"])
    assert fuse_short_conv(model) == 0 and len([n for n in model.graph.node if n.op_type == "Sum"]) == sums > 0


def _fused_model(op, inputs, outputs, **attrs):
    """A one-node model of the library's fused node `op` (no function: only the library runs it)."""
    node = helper.make_node(op, [n for n, _ in inputs], outputs, domain="k3", **attrs)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                     for n, a in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("k3", 1)])


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_short_conv(kernels, T, masked):
    """The library's short convolution (`fusions.fuse_short_conv` writes it) against float64 numpy
    (`fused_ref.short_conv_case`), with and without the window's `start`."""
    inputs, attrs, (y_ref, window) = short_conv_case(T, masked)
    (y, present), ran = _run(_fused_model("short_conv", inputs, ["y", "present"], **attrs), dict(inputs), kernels)
    assert ran == {"short_conv"}
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(present, window)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_kda_layer(kernels, T, masked):
    """The library's short conv + q / k L2 norm + KDA in one node (`fusions.fuse_kda_layer` writes it) against
    float64 (`fused_ref.kda_layer_case`: numpy's conv and norm, the naive recurrence)."""
    inputs, attrs, (o_ref, window, s_ref) = kda_layer_case(T, masked)
    (o, present, s1), ran = _run(_fused_model("kda_layer", inputs, ["o", "present", "final_state"], **attrs),
                                 dict(inputs), kernels)
    assert ran == {"kda_layer"}
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s1, s_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(present, window)


def test_kda_layer_refuses_a_mismatched_x(ort_lib):
    """x must hold q | k | v for g's heads and initial_state's V: one line saying so, not a read past the end."""
    inputs, attrs, _ = kda_layer_case(1, False)
    feeds = dict(inputs)
    feeds["x"] = feeds["x"][..., :-1].copy()
    feeds["state"] = feeds["state"][:, :-1].copy()
    feeds["taps"] = feeds["taps"][:, :-1].copy()
    model = _fused_model("kda_layer", [(n, feeds[n]) for n, _ in inputs], ["o", "present", "final_state"],
                         **attrs)
    with pytest.raises(Exception, match=r"kda_layer: g \[B, T, H, K\], initial_state \[B, H, K, V\] and x"):
        _run(model, feeds, ort_lib)


@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("N", [1, 6])
def test_moe_route_experts(kernels, mxfp4, N):
    """The router and the routed experts in one node (`fusions.fuse_moe_route_experts` writes it; ORT's MXFP4 form
    ``moe_route_experts_mxfp4`` on the packed bytes) against float64 (`fused_ref.moe_route_experts_case`: the
    routing and the experts slot by slot)."""
    op = "moe_route_experts_mxfp4" if mxfp4 else "moe_route_experts"
    inputs, attrs, (ref,) = moe_route_experts_case(mxfp4, N)
    (u,), ran = _run(_fused_model(op, inputs, ["u"], **attrs), dict(inputs), kernels)
    assert ran == {op}
    np.testing.assert_allclose(u, ref, rtol=1e-5, atol=2e-6 * np.abs(ref).max())


def test_moe_route_experts_refuses_logits_of_other_experts(ort_lib):
    """logits must score w1's experts, for z's tokens: one line saying so, not an expert read past the end."""
    inputs, attrs, _ = moe_route_experts_case(False)
    feeds = dict(inputs)
    feeds["logits"] = np.concatenate([feeds["logits"], feeds["logits"][:, :1]], axis=1)
    feeds["bias"] = np.concatenate([feeds["bias"], feeds["bias"][:1]])
    model = _fused_model("moe_route_experts", [(n, feeds[n]) for n, _ in inputs], ["u"], **attrs)
    with pytest.raises(Exception, match=r"moe_route_experts: logits \[N, E\], z \[N, D\] and w1 \[E, I, D\]"):
        _run(model, feeds, ort_lib)


@pytest.mark.parametrize("rows,n", [(1, 64), (37, 20), (1024, 64)])  # 1024 x 64: split over the pool
def test_l2_norm(kernels, rows, n):
    """The library's L2 normalisation (`fusions.fuse_l2_norm` writes it) against float64 numpy."""
    inputs, attrs, (ref,) = l2_norm_case(rows, n)
    (got,), ran = _run(_fused_model("l2_norm", inputs, ["y"], **attrs), dict(inputs), kernels)
    assert ran == {"l2_norm"}
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("halves,T", [(False, 4), (True, 4), (True, 6)])
def test_mla_attend(kernels, masked, halves, T):
    """The library's MLA attention (`fusions.fuse_mla_attend` writes it) against float64 numpy
    (`fused_ref.mla_attend_case`): the causal mask alone, or a padding mask per row with any_key; the latents
    transposed, or the cache's halves read in place (a few queries) or through a transposed copy (more)."""
    inputs, attrs, (ref,) = mla_attend_case(masked, halves, T)
    (got,), ran = _run(_fused_model("mla_attend", inputs, ["out"], **attrs), dict(inputs), kernels)
    assert ran == {"mla_attend"} and got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)
    if masked:
        assert not got[1, :, 0].any()  # the query that sees no key gives 0


def test_long_padded_prompt_same_with_and_without_the_library(ort_lib, export_dir, monkeypatch):
    """A prompt longer than `MLA_QUERY_BLOCK`, left-padded in a batch of two: the function bodies attend in blocks of
    queries (the ``If``'s other branch), the library's session in its one kernel; logits and states agree."""
    from k3export.modeling.contract import MLA_QUERY_BLOCK
    from k3export.runtime.ort_runner import OrtRunner

    T = MLA_QUERY_BLOCK + 9
    ids = np.random.default_rng(11).integers(3, 500, (2, T))
    mask = np.ones((2, T), np.int64)
    mask[1, :20] = 0
    runs = {}
    for use in (True, False):
        monkeypatch.setenv(ort_ops.ENV_SWITCH, "1" if use else "0")
        runner = OrtRunner(export_dir)
        assert runner.ort.k3_ops is use
        out = runner.forward(ids, runner.initial_state(2), mask)
        runs[use] = (np.array(out.logits), {k: np.array(v) for k, v in out.state.items()})
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=0, atol=1e-4)
    for name, value in runs[True][1].items():
        np.testing.assert_allclose(value, runs[False][1][name], rtol=0, atol=1e-4, err_msg=name)


def test_export_without_attention_mask_fuses_and_agrees(ort_lib, tiny, tmp_path):
    """An export without the attention_mask input writes MLA's attention without ``any_key`` (a causal [T, S] mask,
    fill -inf) and the short convs without ``start``: fused all the same, and a prompt past `MLA_QUERY_BLOCK` gives
    the bodies' logits (with the library: its kernels; without: the fused ops' function bodies)."""
    from k3export.artifacts import load_export
    from k3export.converters.onnx import export_onnx
    from k3export.converters.onnx.fusions import fuse
    from k3export.modeling.contract import MLA_QUERY_BLOCK
    from k3export.runtime.ort_session import ort_session

    graph = _unfused(tiny, attention_mask=False)
    kda = tiny.config.attn_types.count("kda")  # its short conv and q / k L2 norms, then those with the recurrence
    moe = [n.op_type for n in graph.graph.node].count("moe_experts")  # each with its router
    assert moe and fuse(graph) == 2 * tiny.config.num_hidden_layers + len(tiny.config.attn_types) + 3 * kda + moe
    export_onnx(tiny, tmp_path / "nomask", dtype="fp32", attention_mask=False)
    path = tmp_path / "nomask" / "model.onnx"
    written = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]
    assert written.count("kda_layer") == kda and written.count("moe_route_experts") == moe
    feeds = {"input_ids": np.arange(3, 3 + MLA_QUERY_BLOCK + 12)[None],
             **load_export(tmp_path / "nomask").manifest.initial_state(1)}
    logits = {}
    for use in (True, False):
        so = ort.SessionOptions()
        if use:
            ort_ops.register(so)
        logits[use] = ort_session(path, so, k3_ops=use).run(["logits"], feeds)[0]
    np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-4)


def test_tiny_export_same_with_and_without_the_library(ort_lib, export_dir, monkeypatch):
    """Prefill then decode of the tiny fp32 export: logits and every state within fp32 tolerance of the function
    bodies' run, and the session says which it ran."""
    from k3export.runtime.loop import Decoding
    from k3export.runtime.ort_runner import OrtRunner

    ids = np.random.default_rng(5).integers(3, 500, (2, 8))
    runs = {}
    for use in (True, False):
        monkeypatch.setenv(ort_ops.ENV_SWITCH, "1" if use else "0")
        runner = OrtRunner(export_dir)
        assert runner.ort.k3_ops is use
        d = Decoding(runner)
        steps = [d.feed(ids[:, :5])] + [d.feed(ids[:, i:i + 1]) for i in range(5, ids.shape[1])]
        runs[use] = [(np.array(s.logits), {k: np.array(v) for k, v in s.state.items()}) for s in steps]
    for (lw, sw), (lo, so) in zip(runs[True], runs[False]):
        np.testing.assert_allclose(lw, lo, rtol=0, atol=1e-4)
        assert sw.keys() == so.keys()
        for name in sw:
            np.testing.assert_allclose(sw[name], so[name], rtol=0, atol=1e-4, err_msg=name)


def test_on_by_default_for_the_cpu_provider_alone(ort_lib, export_dir, monkeypatch):
    """No switch: a CPU session runs the library (and says so); ``K3EXPORT_ORT_OPS=0`` keeps the bodies; a session whose
    providers include another is not given CPU kernels (its bodies run on that provider)."""
    from k3export.runtime.ort_runner import OrtRunner

    monkeypatch.delenv(ort_ops.ENV_SWITCH, raising=False)
    runner = OrtRunner(export_dir)
    assert runner.ort.k3_ops and "k3 ops library" in runner.describe()
    monkeypatch.setenv(ort_ops.ENV_SWITCH, "0")
    assert not OrtRunner(export_dir).ort.k3_ops
    monkeypatch.delenv(ort_ops.ENV_SWITCH)
    seen = []
    monkeypatch.setattr(ort_ops, "register", lambda so: seen.append(so) or True)
    monkeypatch.setattr(ort.InferenceSession, "__init__", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(RuntimeError, match="stop"):
        OrtRunner(export_dir, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert seen == []


def test_kernels_option_overrides_the_environment(ort_lib, export_dir, tiny, monkeypatch):
    """``OrtRunner(kernels=...)`` decides whatever ``K3EXPORT_ORT_OPS`` says (the variable only sets the default), and
    both ways decode the tiny export as the float64 PyTorch model does."""
    import copy

    from k3export.runtime.loop import Decoding
    from k3export.runtime.ort_runner import OrtRunner

    ids = np.random.default_rng(7).integers(3, 500, (1, 6))
    model = copy.deepcopy(tiny).double()
    with torch.no_grad():
        want = model(torch.as_tensor(ids)).logits.numpy()
    for env, kernels in (("0", True), ("1", False)):
        monkeypatch.setenv(ort_ops.ENV_SWITCH, env)
        runner = OrtRunner(export_dir, kernels=kernels)
        assert runner.ort.k3_ops is kernels and ("k3 ops library" in runner.describe()) is kernels
        np.testing.assert_allclose(Decoding(runner).feed(ids).logits, want, rtol=0, atol=2e-4)
    monkeypatch.setenv(ort_ops.ENV_SWITCH, "0")
    assert not OrtRunner(export_dir).ort.k3_ops  # no option: the environment's default


def test_only_fp32_graphs_take_the_library(tiny_k3, export_dir, tmp_path):
    """A bf16 export is not the fp32 kernels' (registered, they would replace its k3 functions' schemas): the
    session keeps the function bodies; the fp32 export takes them."""
    from k3export.converters.onnx import export_onnx

    export_onnx(tiny_k3, tmp_path / "bf16", dtype="bf16")
    assert not ort_ops.takes(onnx.load(str(tmp_path / "bf16" / "model.onnx"), load_external_data=False))
    assert ort_ops.takes(onnx.load(str(export_dir / "model.onnx"), load_external_data=False))


def test_8bit_experts_keep_the_function_bodies():
    """``k3::moe_experts`` with 9 inputs that are not an export's FLOAT4E2M1 / E8M0 initializers (ORT's 8-bit form,
    ``model.genai.onnx``) is not the library's: the session keeps the function bodies."""
    inits = [helper.make_tensor(f"x{i}", TensorProto.UINT8 if i < 6 else TensorProto.FLOAT, [1], [1])
             for i in range(3, 9)]
    node = helper.make_node("moe_experts", [f"x{i}" for i in range(9)], ["u"], domain="k3")
    graph = helper.make_graph([node], "g", [], [], initializer=inits)
    assert not ort_ops.takes(helper.make_model(graph))


def test_no_compiler_falls_back_in_one_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(ort_ops.BuildError, match="no C.. compiler"):
        ort_ops.build(tmp_path)
    monkeypatch.setattr(ort_ops, "cache_root", lambda folder: tmp_path)
    ort_ops.library.cache_clear()
    try:
        so = ort.SessionOptions()
        assert ort_ops.register(so) is False
        lines = [r.getMessage() for r in caplog.records if "k3 ops unavailable" in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0] and "function bodies run" in lines[0]
    finally:
        ort_ops.library.cache_clear()
