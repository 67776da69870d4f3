"""The k3 extension library of OpenVINO (`k3export.runtime.ov_ext`, ``ops/csrc/ov_k3.cpp`` over ``ops/csrc/kernels/``): it
builds here against the openvino wheel, OpenVINO's ONNX frontend turns each ``k3`` node into the library's
operation (seen in the compiled model), each op matches the naive references of ``ops/naive.py`` and a float64
computation, the tiny export's functions form (the file ONNX Runtime runs) runs in OpenVINO with the library as in
ONNX Runtime and the PyTorch model over prefill + decode, and so does an MXFP4 export on its 4-bit bytes; a kernel
with a sign flipped fails the same comparison, and a library that cannot be built is one logged line."""

import io
import shutil

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from k3export.ops import naive
from k3export.ops.sources import CSRC, binding_sources
from k3export.runtime import ov_ext
from fused_ref import (aggregate_atol, attn_res_aggregate_case, l2_norm_case, mla_attend_case,  # tests/ on sys.path
                       moe_route_experts_case, short_conv_case, kda_layer_case)
from moe_ref import dense_case, experts_f64, mxfp4_case, mxfp4_f64

ov = pytest.importorskip("openvino")
OPSET = 21


@pytest.fixture(scope="module")
def lib():
    try:
        return ov_ext.build()
    except ov_ext.BuildError as exc:  # no compiler / no headers in the openvino wheel: nothing to test
        pytest.skip(f"k3 OpenVINO extension not buildable here: {exc}")


def _model(op, inputs, outputs, initializers=(), **attrs):
    """A one-node model of k3 op `op` (no function body: OpenVINO reads it through the library only); inputs /
    outputs: (name, numpy array)."""
    def info(name, arr):  # of a known rank: OpenVINO's CPU plugin takes no input of a dynamic rank
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), [None] * arr.ndim)
    names = [n for n, _ in inputs] + [t.name for t in initializers]
    node = helper.make_node(op, names, [n for n, _ in outputs], domain="k3", plugin_namespace="k3", **attrs)
    graph = helper.make_graph([node], op, [info(n, a) for n, a in inputs], [info(n, a) for n, a in outputs],
                              initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("k3", 1)])


def _run(model, feeds, lib):
    """The outputs of `model` compiled by OpenVINO's CPU plugin with `lib`, and the k3 operations its frontend made
    of the model's nodes (each run by the plugin as a reference layer: the operation's `evaluate`)."""
    core = ov.Core()
    core.add_extension(str(lib))
    graph = core.read_model(io.BytesIO(model.SerializeToString()))
    compiled = core.compile_model(graph, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2})
    out = compiled(feeds)
    k3 = {op.get_type_name() for op in graph.get_ops() if op.get_type_info().version_id == "k3"}
    # the CPU plugin runs an operation it has no kernel of through its `evaluate`: a "Reference" layer
    layers = [op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()]
    assert layers.count("Reference") == len(k3)
    return [np.array(out[o]) for o in compiled.outputs], k3


def _t(a):
    return torch.from_numpy(a).double()


def test_situ_glu(lib):
    rng = np.random.default_rng(0)
    g, u = (rng.normal(0, 6, (3, 7, 5)).astype(np.float32) for _ in range(2))
    (got,), ran = _run(_model("situ_glu", [("gate", g), ("up", u)], [("out", g)], beta1=4.0, beta2=25.0),
                       {"gate": g, "up": u}, lib)
    assert ran == {"situ_glu"}
    ref = naive.situ_glu_naive(_t(g), _t(u), 4.0, 25.0).numpy()
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    f64 = 4 * np.tanh(g64 / 4) / (1 + np.exp(-g64)) * 25 * np.tanh(u64 / 25)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, f64, rtol=1e-5, atol=1e-5)


def _kda64(q, k, v, g, beta, s0, scale):
    """KDA in float64, token by token, from its definition (independent of the naive reference)."""
    B, T, H, _ = q.shape
    o, S = np.zeros(v.shape), s0.astype(np.float64).copy()
    for b in range(B):
        for h in range(H):
            for t in range(T):
                St = np.exp(g[b, t, h])[:, None] * S[b, h]
                St = St + beta[b, t, h] * np.outer(k[b, t, h], v[b, t, h] - k[b, t, h] @ St)
                S[b, h] = St
                o[b, t, h] = (scale * q[b, t, h]) @ St
    return o, S


def _kda_case(T, seed=None):
    rng = np.random.default_rng(T if seed is None else seed)
    B, H, K = 2, 2, 8
    q, k = (rng.normal(size=(B, T, H, K)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.normal(size=(B, T, H, K)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (B, T, H, K)).astype(np.float32)
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    s0 = rng.normal(size=(B, H, K, K)).astype(np.float32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0), K ** -0.5


def _check_kda(lib, T):
    feeds, scale = _kda_case(T)
    m = _model("kda", list(feeds.items()), [("o", feeds["v"]), ("final_state", feeds["initial_state"])], scale=scale)
    (o, s1), ran = _run(m, feeds, lib)
    assert ran == {"kda"}
    ro, rs = naive.kda_naive(*(_t(a) for a in feeds.values()), scale)
    fo, fs = _kda64(*feeds.values(), scale)
    for got, ref, f64 in ((o, ro.numpy(), fo), (s1, rs.numpy(), fs)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, f64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 5])
def test_kda(lib, T):
    _check_kda(lib, T)


def test_moe_route(lib):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 16)).astype(np.float32)
    logits[0, 3] = logits[0, 9]  # a tie: the lower index first
    bias = np.zeros(16, np.float32)
    bias[5:] = rng.normal(size=11).astype(np.float32) * 0.1
    m = _model("moe_route", [("logits", logits), ("bias", bias)],
               [("weights", logits), ("indices", np.zeros((1, 1), np.int64))], top_k=4, renormalize=1, scale=2.5)
    (w, idx), ran = _run(m, {"logits": logits, "bias": bias}, lib)
    assert ran == {"moe_route"}
    rw, ri = naive.moe_route_naive(torch.from_numpy(logits), torch.from_numpy(bias), 4, True, 2.5)
    np.testing.assert_array_equal(idx, ri.numpy())
    np.testing.assert_allclose(w, rw.numpy(), rtol=1e-6, atol=1e-6)
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))  # float64: the chosen experts' sigmoids, renormalised
    chosen = np.take_along_axis(s, idx, 1)
    np.testing.assert_allclose(w, 2.5 * chosen / chosen.sum(1, keepdims=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("N,top_k,E,D,I", [(1, 2, 6, 16, 8), (37, 3, 9, 40, 20), (6, 2, 5, 200, 136)])
def test_moe_experts(lib, N, top_k, E, D, I, act):
    feeds = dense_case(N, top_k, E, D, I, N * 100 + D)
    m = _model("moe_experts", list(feeds.items()), [("u", feeds["z"])], act=act, beta1=4.0, beta2=25.0)
    (u,), ran = _run(m, feeds, lib)
    assert ran == {"moe_experts"}
    ref32 = naive.moe_experts_naive(*(torch.from_numpy(a) for a in feeds.values()), act, 4.0, 25.0,
                                    dtype=torch.float32).numpy()
    ref64 = experts_f64(*feeds.values(), act)
    scale = np.abs(ref64).max()
    np.testing.assert_allclose(u, ref64, rtol=1e-5, atol=2e-6 * scale)
    np.testing.assert_allclose(u, ref32, rtol=1e-5, atol=2e-6 * scale)
    # an expert id out of range: OpenVINO's error, not a crash
    bad = dict(feeds, indices=np.full_like(feeds["indices"], E))
    with pytest.raises(Exception, match="indices"):
        _run(m, bad, lib)


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("N,top_k,E,D,I", [(1, 2, 6, 32, 32), (37, 3, 9, 32, 96), (6, 2, 5, 160, 288)])
def test_mxfp4_experts(lib, N, top_k, E, D, I, act):
    """The export's node form: 9 inputs, the experts FLOAT4E2M1 [E, out, in] and FLOAT8E8M0 [E, out, in/32]
    initializers, which OpenVINO's frontend reads as f4e2m1 / f8e8m0 constants (4.25 bits a weight)."""
    case = mxfp4_case(N, top_k, E, D, I, N * 100 + D)
    z, weights, idx = case["z"], case["weights"], case["indices"]
    shapes = {"w1": (E, I, D), "w3": (E, I, D), "w2": (E, D, I)}
    packed, scales = {m: case[m] for m in shapes}, {m: case[m + "_scale"] for m in shapes}
    inits = [helper.make_tensor(m, TensorProto.FLOAT4E2M1, shapes[m], packed[m].tobytes(), raw=True)
             for m in shapes] + [
        helper.make_tensor(m + "_scale", TensorProto.FLOAT8E8M0, scales[m].shape, scales[m].tobytes(), raw=True)
        for m in shapes]
    feeds = dict(z=z, weights=weights, indices=idx)
    m = _model("moe_experts", list(feeds.items()), [("u", z)], inits, act=act, beta1=4.0, beta2=25.0)
    assert len(m.graph.node[0].input) == 9
    (u,), ran = _run(m, feeds, lib)
    assert ran == {"moe_experts"}
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    ref32 = naive.moe_experts_mxfp4_naive(*t.values(), *(torch.from_numpy(packed[m]) for m in shapes),
                                          *(torch.from_numpy(scales[m]) for m in shapes), act, 4.0, 25.0,
                                          dtype=torch.float32).numpy()
    ref64 = experts_f64(z, weights, idx, *(mxfp4_f64(packed[m], scales[m]) for m in shapes), act)
    scale = np.abs(ref64).max()
    np.testing.assert_allclose(u, ref64, rtol=1e-5, atol=2e-6 * scale)
    np.testing.assert_allclose(u, ref32, rtol=1e-5, atol=2e-6 * scale)


def test_a_flipped_sign_fails(lib, tmp_path):
    """The kda comparison above catches a kernel whose delta rule adds k^T S instead of subtracting it."""
    src = tmp_path / "csrc"
    shutil.copytree(CSRC, src)
    kernels = (src / "kernels" / "kda.h").read_text()
    planted = kernels.replace("kv[j] = (vt[j] - kv[j]) * bt", "kv[j] = (vt[j] + kv[j]) * bt")
    assert planted != kernels
    (src / "kernels" / "kda.h").write_text(planted)
    bad = ov_ext.build(tmp_path / "root", sources=binding_sources(src / "ov_k3.cpp"))
    assert bad != lib
    for T in (1, 5):
        with pytest.raises(AssertionError):
            _check_kda(bad, T)


def _fused(op, case, lib):
    """OpenVINO's run of the library's fused node `op` (`fusions` writes it) on `case` (`fused_ref`), and the
    case's float64 outputs."""
    inputs, attrs, refs = case
    model = _model(op, inputs, [(f"out{i}", r.astype(np.float32)) for i, r in enumerate(refs)], **attrs)
    got, k3 = _run(model, dict(inputs), lib)
    assert k3 == {op}
    return got, refs


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_short_conv(lib, T, masked):
    (y, present), (y_ref, window) = _fused("short_conv", short_conv_case(T, masked), lib)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(present, window)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_kda_layer(lib, T, masked):
    (o, present, s1), (o_ref, window, s_ref) = _fused("kda_layer", kda_layer_case(T, masked), lib)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s1, s_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(present, window)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("halves,T", [(False, 4), (True, 4), (True, 6)])
def test_mla_attend(lib, masked, halves, T):
    (got,), (ref,) = _fused("mla_attend", mla_attend_case(masked, halves, T), lib)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("rows,n", [(1, 64), (37, 20), (1024, 64)])
def test_l2_norm(lib, rows, n):
    (got,), (ref,) = _fused("l2_norm", l2_norm_case(rows, n), lib)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("S,rows", [(1, 1), (3, 1), (5, 37)])
def test_attn_res_aggregate(lib, S, rows):
    case = attn_res_aggregate_case(S, rows)
    (got,), (ref,) = _fused("attn_res_aggregate", case, lib)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=aggregate_atol(case[0]))


@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("N", [1, 6])
def test_moe_route_experts(lib, mxfp4, N):
    """The router and the routed experts in one operation, on fp32 experts or (as the frontend reads an MXFP4 export)
    on FLOAT4E2M1 / FLOAT8E8M0 initializers, against float64 (`fused_ref.moe_route_experts_case`)."""
    inputs, attrs, (ref,) = moe_route_experts_case(mxfp4, N)
    fed, inits = inputs, []
    if mxfp4:  # the experts as the export holds them: [E, out, in] elements, two a byte; the scales E8M0
        fed = inputs[:3]
        inits = [helper.make_tensor(n, TensorProto.FLOAT8E8M0 if n.endswith("_scale") else TensorProto.FLOAT4E2M1,
                                    a.shape if n.endswith("_scale") else (*a.shape[:-1], 2 * a.shape[-1]),
                                    a.tobytes(), raw=True) for n, a in inputs[3:]]
    model = _model("moe_route_experts", fed, [("u", ref.astype(np.float32))], inits, **attrs)
    (u,), k3 = _run(model, dict(fed), lib)
    assert k3 == {"moe_route_experts"}
    np.testing.assert_allclose(u, ref, rtol=1e-5, atol=2e-6 * np.abs(ref).max())


def _steps(runner, ids, prompt):
    """Prefill `prompt` tokens of `ids`, then decode the rest one at a time: (logits, state) as float32 numpy."""
    from k3export.runtime.loop import Decoding

    d = Decoding(runner)
    steps = [d.feed(ids[:, :prompt])] + [d.feed(ids[:, i:i + 1]) for i in range(prompt, ids.shape[1])]
    return [(np.array(s.logits, np.float32), {k: np.array(v, np.float32) for k, v in s.state.items()})
            for s in steps]


def test_tiny_functions_form_as_ort_and_pytorch(lib, tiny, export_dir, monkeypatch):
    """Prefill of 8 then 4 decode steps of the tiny fp32 export as written (functions form): OpenVINO with the
    library, the file's fused ops its operations, equals ONNX Runtime running the file's function bodies
    (logits and every state) and the PyTorch model (logits)."""
    monkeypatch.setenv("K3EXPORT_ORT_OPS", "0")  # ORT's own kernels, not the same library's
    from k3export.runtime import TorchRunner
    from k3export.runtime.openvino_runner import OpenVinoRunner
    from k3export.runtime.ort_runner import OrtRunner

    ids = np.random.default_rng(5).integers(3, 500, (2, 12))
    runner = OpenVinoRunner(export_dir)
    assert runner.k3_ext and runner.stateful and "k3 extension" in runner.describe()
    layers = [op.get_rt_info()["layerType"].astype(str) for op in runner.ov.compiled.get_runtime_model().get_ops()]
    c = tiny.config
    kda, mla = c.attn_types.count("kda"), c.attn_types.count("mla")
    # situ_glu (6), each MoE layer's router and experts in one (5); and the fused aggregates (two a layer), MLA
    # attentions, and each KDA layer's short conv, q / k L2 norms and recurrence in one
    assert "If" not in layers and layers.count("Reference") == 6 + 5 + 2 * c.num_hidden_layers + mla + kda
    assert kda and mla
    got = _steps(runner, ids, 8)
    for ref in (OrtRunner(export_dir), TorchRunner(tiny)):
        want = _steps(ref, ids, 8)
        for (gl, gs), (wl, ws) in zip(got, want):
            np.testing.assert_allclose(gl, wl, rtol=0, atol=1e-4, err_msg=ref.name)
            if ref.name == "ort":
                assert gs.keys() == ws.keys()
                for name in ws:
                    np.testing.assert_allclose(gs[name], ws[name], rtol=0, atol=1e-4, err_msg=name)


def test_the_export_is_read_as_written_and_one_without_fused_ops_runs_unfused(lib, tiny, export_dir, tmp_path,
                                                                             caplog):
    """OpenVINO reads the file as it is: nothing written into the export's folder (it may be read-only). An export
    without the fused ops (``--no-kernels``, or written before the exporter fused) runs with the extension's own
    operations alone, says once how to re-export, and gives ONNX Runtime's logits."""
    from k3export.converters.onnx import export_onnx
    from k3export.runtime.openvino_runner import OpenVinoRunner
    from k3export.runtime.ort_runner import OrtRunner

    def listing(folder):
        return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()}

    before, folder_mtime = listing(export_dir), export_dir.stat().st_mtime_ns
    fused = OpenVinoRunner(export_dir)
    assert listing(export_dir) == before and export_dir.stat().st_mtime_ns == folder_mtime
    del fused
    export_onnx(tiny, tmp_path / "unfused", dtype="fp32", debug_outputs=True, kernels=False)
    with caplog.at_level("WARNING"):
        runner = OpenVinoRunner(tmp_path / "unfused")
    said = [r.getMessage() for r in caplog.records if "fused ops" in r.getMessage()]
    assert len(said) == 1 and "--kernels" in said[0]
    layers = [op.get_rt_info()["layerType"].astype(str) for op in runner.ov.compiled.get_runtime_model().get_ops()]
    assert layers.count("Reference") == 4 + 6 + 5 + 5  # kda, situ_glu, moe_route, experts: nothing fused
    ids = np.random.default_rng(8).integers(3, 500, (1, 10))
    for (gl, _), (wl, _) in zip(_steps(runner, ids, 8), _steps(OrtRunner(export_dir), ids, 8)):
        np.testing.assert_allclose(gl, wl, rtol=0, atol=1e-4)


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "stateless"])
def test_every_validation_scenario_passes(lib, tiny, export_dir, stateful):
    """`validate`'s scenarios (decode, chunked prefill, a left-padded batch of 2) on the functions form through the
    library (the default), both forms, against the PyTorch model, every layer's hidden state compared, greedy tokens
    equal."""
    from k3export.runtime import TorchRunner
    from k3export.runtime.openvino_runner import OpenVinoRunner
    from k3export.validate import Tolerances, make_scenarios, validate

    runner = OpenVinoRunner(export_dir, stateful=stateful)
    assert runner.k3_ext and runner.stateful == stateful
    scenarios = make_scenarios(tiny.config.vocab_size, prompt_len=16, steps=8, batch=2, seed=0)
    result = validate(TorchRunner(tiny), [runner], scenarios)
    assert result.passed, result.localisation
    assert all(all(r.greedy) for r in result.runs)
    assert any(rec.kind == "hidden" for r in result.runs for rec in r.records)
    assert max(rec.metrics.rms_rel for r in result.runs for rec in r.records) < \
        Tolerances().for_kind("logits").rms_rel / 10


def test_a_long_prompt_takes_the_one_call_attention(lib, export_dir):
    """A 200-token prefill (MLA's query blocks in ONNX Runtime, its one-call branch here) as ONNX Runtime."""
    from k3export.runtime.openvino_runner import OpenVinoRunner
    from k3export.runtime.ort_runner import OrtRunner

    ids = np.random.default_rng(6).integers(3, 500, (1, 200))
    (gl, gs), = _steps(OpenVinoRunner(export_dir), ids, 200)
    (wl, ws), = _steps(OrtRunner(export_dir), ids, 200)
    assert np.isfinite(gl).all()
    np.testing.assert_allclose(gl, wl, rtol=0, atol=2e-4)
    for name in ws:
        np.testing.assert_allclose(gs[name], ws[name], rtol=0, atol=2e-4, err_msg=name)


@pytest.fixture(scope="module")
def mxfp4_export(released_random, tmp_path_factory):
    from k3export.converters.onnx import export_onnx

    return export_onnx(released_random, tmp_path_factory.mktemp("ovmx") / "export", experts="mxfp4",
                       dtype="fp32").out_dir


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "stateless"])
def test_mxfp4_export_as_pytorch(lib, mxfp4_export, released_random, stateful):
    """An fp32 ``--experts mxfp4`` export in the functions form: OpenVINO with the library (the experts on their
    4-bit bytes), both forms, gives PyTorch's logits and greedy tokens over prefill + 4 decode steps."""
    from k3export.runtime import TorchRunner
    from k3export.runtime.openvino_runner import OpenVinoRunner
    from k3export.runtime.loop import Decoding, next_tokens

    ids = np.random.default_rng(3).integers(3, 500, (2, 12))
    runner = OpenVinoRunner(mxfp4_export, stateful=stateful)
    assert runner.k3_ext and runner.stateful == stateful
    runs, tokens = {}, {}
    for name, r in (("openvino", runner), ("torch", TorchRunner.from_pretrained(released_random, "float32"))):
        d = Decoding(r)
        steps = [d.feed(ids[:, :8])] + [d.feed(ids[:, i:i + 1]) for i in range(8, 12)]
        runs[name] = [np.array(s.logits, np.float32)[:, -1] for s in steps]
        tokens[name] = [next_tokens(s).tolist() for s in steps]
    assert tokens["openvino"] == tokens["torch"]
    for a, b in zip(runs["openvino"], runs["torch"]):  # fp32 sums in other orders: ~0.7-1.1e-4 apart on this model
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)


def test_without_the_extension_the_functions_form_runs_its_bodies_inlined(tiny, export_dir, monkeypatch, caplog):
    """``K3EXPORT_OV_EXT=0``: the functions form read with its function bodies inlined into standard ops (no library
    operation compiled, no temporary file left), said in one logged line; `validate`'s scenarios pass against the
    PyTorch model."""
    from k3export.runtime import TorchRunner
    from k3export.runtime.openvino_runner import OpenVinoRunner
    from k3export.validate import make_scenarios, validate

    monkeypatch.setenv(ov_ext.ENV_SWITCH, "0")
    before = sorted(p.name for p in export_dir.iterdir())
    runner = OpenVinoRunner(export_dir)
    assert not runner.k3_ext and runner.inlined and "function bodies inlined" in runner.describe()
    assert sorted(p.name for p in export_dir.iterdir()) == before
    layers = [op.get_rt_info()["layerType"].astype(str) for op in runner.ov.compiled.get_runtime_model().get_ops()]
    assert "Reference" not in layers and "If" not in layers
    lines = [r.getMessage() for r in caplog.records if "k3 extension is not used" in r.getMessage()]
    assert len(lines) == 1 and "K3EXPORT_OV_EXT=0" in lines[0] and "inlined" in lines[0]
    scenarios = make_scenarios(tiny.config.vocab_size, prompt_len=16, steps=4, batch=2, seed=0)
    result = validate(TorchRunner(tiny), [runner], scenarios)
    assert result.passed, result.localisation


def test_without_the_extension_more_experts_than_a_block_need_the_inlined_form(tmp_path):
    """OpenVINO's CPU plugin corrupts its heap running the functions form's experts loop (a tensor sequence carried
    over more than one block of experts: seen as SIGSEGV / "corrupted double-linked list" on 64 experts), so without
    the extension such a model is refused in one line naming the form that reads; that form, the same weights,
    routes a prompt over more experts than a block and matches PyTorch."""
    import torch

    from k3export.artifacts.graph_forms import expert_block
    from k3export.converters.onnx import export_onnx
    from k3export.errors import K3ExportError
    from k3export.modeling import K3Config, K3ForCausalLM
    from k3export.runtime import TorchRunner
    from k3export.runtime.openvino_runner import OpenVinoRunner
    from k3export.validate import make_scenarios, validate

    torch.manual_seed(0)
    config = K3Config.tiny(num_experts=16, num_experts_per_token=4)
    assert config.num_experts > expert_block(config.moe_intermediate_size, config.expert_input_size)
    model = K3ForCausalLM(config).eval()
    export_onnx(model, tmp_path / "functions", dtype="fp32")
    export_onnx(model, tmp_path / "inlined", dtype="fp32", form="inlined")
    with pytest.raises(K3ExportError, match=r"functions form of a model with 16 routed experts.*--form inlined"):
        OpenVinoRunner(tmp_path / "functions", kernels=False)
    assert OpenVinoRunner(tmp_path / "functions", kernels=True).k3_ext  # the extension runs it
    scenarios = make_scenarios(config.vocab_size, prompt_len=16, steps=3, batch=1, seed=0)
    result = validate(TorchRunner(model), [OpenVinoRunner(tmp_path / "inlined", kernels=False)], scenarios)
    assert result.passed, result.localisation


def test_kernels_option_overrides_the_environment(export_dir, monkeypatch):
    """``OpenVinoRunner(kernels=...)`` decides whatever ``K3EXPORT_OV_EXT`` says; off explicitly, the bodies run inlined
    without the warning a switched-off default logs."""
    from k3export.runtime.openvino_runner import OpenVinoRunner

    monkeypatch.setenv(ov_ext.ENV_SWITCH, "0")
    assert OpenVinoRunner(export_dir, kernels=True).k3_ext
    monkeypatch.setenv(ov_ext.ENV_SWITCH, "1")
    runner = OpenVinoRunner(export_dir, kernels=False)
    assert not runner.k3_ext and runner.inlined and "function bodies inlined" in runner.describe()


def test_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv(ov_ext.ENV_SWITCH, raising=False)
    assert ov_ext.enabled()
    monkeypatch.setenv(ov_ext.ENV_SWITCH, "0")
    assert not ov_ext.enabled()


def test_takes_only_its_nodes():
    node = helper.make_node("mla", ["x"], ["y"], domain="k3")
    graph = helper.make_graph([node], "g", [], [])
    assert not ov_ext.takes(helper.make_model(graph))
    node = helper.make_node("kda", [f"x{i}" for i in range(6)], ["o", "s"], domain="k3")
    assert ov_ext.takes(helper.make_model(helper.make_graph([node], "g", [], [])))


def test_no_compiler_falls_back_in_one_line(monkeypatch, tmp_path, caplog, export_dir):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(ov_ext.BuildError, match="no C.. compiler"):
        ov_ext.build(tmp_path)
    monkeypatch.setattr(ov_ext, "cache_root", lambda folder: tmp_path)
    monkeypatch.delenv(ov_ext.ENV_SWITCH, raising=False)
    ov_ext._built.cache_clear()
    try:
        assert ov_ext.library() is None and "no C++ compiler" in ov_ext.unavailable()
        from k3export.runtime.openvino_runner import OpenVinoRunner

        runner = OpenVinoRunner(export_dir)  # the bodies inlined, as without the switch
        assert runner.inlined and not runner.k3_ext
        lines = [r.getMessage() for r in caplog.records if "k3 extension is not used" in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0] and "cannot be built here: no C++ compiler" in lines[0]
    finally:
        ov_ext._built.cache_clear()
