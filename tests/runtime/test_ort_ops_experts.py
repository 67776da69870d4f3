"""The k3 custom-op library's experts kernels (`k3export.runtime.ort_ops`, ``ops/csrc/kernels/moe_experts*.h``): the dense
``moe_experts`` and ``moe_experts_mxfp4`` on the checkpoint's MXFP4 bytes, each against the naive reference of
``ops/naive.py`` and a float64 computation written here, at shapes that reach every tail of the tiled kernels (one
token, token counts not a multiple of the 4-slot tile, more slots than a tile, rows and features not multiples of
the tiles, experts no token chose), built for each target of `KERNEL_TARGETS` (`kernels`: AVX-512, AVX2 and the
one-value-at-a-time MXFP4 decode); an MXFP4 export run by ORT with the library equals the same export without it
and the PyTorch model; a kernel with its nibbles swapped fails the comparison in each."""

import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from k3export.converters.onnx import bodies
from k3export.ops import naive
from k3export.ops.sources import CSRC, binding_sources
from k3export.runtime import native, ort_ops
from moe_ref import dense_case, experts_f64, mxfp4_case, mxfp4_f64, q8_experts_f64  # tests/ is on sys.path

ort = pytest.importorskip("onnxruntime")
OPSET = 21
# (N tokens, top_k, E experts, D, I): one token; odd counts; a token count past the 4-slot tile; top_k 1 and > 1;
# D and I off the 32-feature chunk and the row tiles (dense only: MXFP4 needs multiples of 32); rows past one
# 128-row work item, ending inside the next (the last case of each)
DENSE = [(1, 2, 6, 16, 8), (5, 2, 6, 48, 40), (37, 3, 9, 40, 20), (9, 1, 4, 33, 7), (6, 2, 5, 200, 136)]
MXFP4 = [(1, 2, 6, 32, 32), (5, 2, 6, 64, 32), (37, 3, 9, 32, 96), (9, 1, 4, 96, 64), (6, 2, 5, 160, 288)]


def _session(op, feeds, lib, fn=None, act="situ", **attrs):
    def info(name, arr):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), None)
    node = helper.make_node(op, list(feeds), ["u"], domain="k3", act=act, beta1=4.0, beta2=25.0, **attrs)
    graph = helper.make_graph([node], op, [info(n, a) for n, a in feeds.items()], [info("u", feeds["z"])])
    model = helper.make_model(graph, functions=[fn] if fn else [],
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("k3", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if lib:
        so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("N,top_k,E,D,I", DENSE)
def test_dense_experts(kernels, N, top_k, E, D, I, act):
    feeds = dense_case(N, top_k, E, D, I, N * 100 + D)
    fn = bodies.moe_experts_function("k3", act, 4.0, 25.0, OPSET)
    (u,) = _session("moe_experts", feeds, kernels, fn, act).run(None, feeds)
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    ref32 = naive.moe_experts_naive(*t.values(), act, 4.0, 25.0, dtype=torch.float32).numpy()
    ref64 = experts_f64(*feeds.values(), act)
    scale = np.abs(ref64).max()
    np.testing.assert_allclose(u, ref64, rtol=1e-5, atol=2e-6 * scale)
    np.testing.assert_allclose(u, ref32, rtol=1e-5, atol=2e-6 * scale)


def _check_mxfp4(lib, feeds, act):
    (u,) = _session("moe_experts_mxfp4", feeds, lib, act=act).run(None, feeds)
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    ref32 = naive.moe_experts_mxfp4_naive(*t.values(), act, 4.0, 25.0, dtype=torch.float32).numpy()
    w = [mxfp4_f64(feeds[m], feeds[m + "_scale"]) for m in ("w1", "w3", "w2")]
    ref64 = experts_f64(feeds["z"], feeds["weights"], feeds["indices"], *w, act)
    scale = np.abs(ref64).max()
    np.testing.assert_allclose(u, ref64, rtol=1e-5, atol=2e-6 * scale)
    np.testing.assert_allclose(u, ref32, rtol=1e-5, atol=2e-6 * scale)
    return u


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("N,top_k,E,D,I", MXFP4)
def test_mxfp4_experts(kernels, N, top_k, E, D, I, act):
    feeds = mxfp4_case(N, top_k, E, D, I, N * 100 + D)
    u = _check_mxfp4(kernels, feeds, act)
    # and the dense kernel on the decoded weights (exact in fp32) agrees to fp32 rounding: the MXFP4 kernel sums each
    # 32-feature chunk's even features before its odd ones, so the order of the sums differs
    dense = {k: feeds[k] for k in ("z", "weights", "indices")} | {
        m: mxfp4_f64(feeds[m], feeds[m + "_scale"]).astype(np.float32) for m in ("w1", "w3", "w2")}
    fn = bodies.moe_experts_function("k3", act, 4.0, 25.0, OPSET)
    (ud,) = _session("moe_experts", dense, kernels, fn, act).run(None, dense)
    np.testing.assert_allclose(u, ud, rtol=1e-5, atol=2e-6 * np.abs(ud).max())


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("N,top_k,E,D,I", MXFP4)
def test_mxfp4_experts_on_int8_activations(kernels, N, top_k, E, D, I, act):
    """``quantize_activations=1``: the kernel's integer products equal a float64 computation on the activations
    rounded per 32 features (written here, and `naive`'s) to fp32 rounding of the sums; and they differ from the
    fp32-activation kernel by the rounding, so the attribute is read."""
    feeds = mxfp4_case(N, top_k, E, D, I, N * 100 + D + 7)
    if D > 32:
        feeds["z"][0, 32:64] = 0  # an all-zero block (d = 0)
    (u,) = _session("moe_experts_mxfp4", feeds, kernels, act=act, quantize_activations=1).run(None, feeds)
    w = [mxfp4_f64(feeds[m], feeds[m + "_scale"]) for m in ("w1", "w3", "w2")]
    ref64 = q8_experts_f64(feeds["z"], feeds["weights"], feeds["indices"], *w, act)
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    naive32 = naive.moe_experts_mxfp4_naive(*t.values(), act, 4.0, 25.0, quantize_activations=True).numpy()
    scale = np.abs(ref64).max()
    np.testing.assert_allclose(u, ref64, rtol=1e-5, atol=2e-6 * scale)
    np.testing.assert_allclose(naive32, ref64, rtol=1e-6, atol=1e-7 * scale)  # naive returns fp32 for fp32 z
    (exact,) = _session("moe_experts_mxfp4", feeds, kernels, act=act).run(None, feeds)
    assert np.abs(u - exact).max() > 1e-4 * scale


def test_mxfp4_experts_reject_bad_shapes(kernels):
    feeds = mxfp4_case(3, 2, 4, 32, 32, 0)
    bad = dict(feeds, w2_scale=feeds["w2_scale"][:, :, :0])
    with pytest.raises(Exception, match="moe_experts_mxfp4: w1 / w3"):
        _session("moe_experts_mxfp4", bad, kernels).run(None, bad)
    bad = dict(feeds, indices=np.full_like(feeds["indices"], 4))
    with pytest.raises(Exception, match="indices"):
        _session("moe_experts_mxfp4", bad, kernels).run(None, bad)


def test_a_swapped_nibble_order_fails(kernels, kernel_target, tmp_path):
    """The comparison above catches a kernel that reads element 2j from the high nibble, in the decode each target
    compiles (AVX-512's, AVX2's or the one-value-at-a-time one)."""
    src = tmp_path / "csrc"
    shutil.copytree(CSRC, src)
    planted = (src / "kernels" / "moe_experts_mxfp4.h").read_text()
    for right, wrong in (  # the AVX-512, AVX2 and one-value-at-a-time decodes each take the other nibble of a byte
            ("(bytes, table);                        // low", "(_mm512_srli_epi32(bytes, 4), table);  // low"),
            ("(_mm512_srli_epi32(bytes, 4), table);  // high", "(bytes, table);  // high"),
            ("_mm256_permutevar8x32_ps(table, b)", "_mm256_permutevar8x32_ps(table, hi)"),
            ("w[j] = kE2M1[q[j] & 15]", "w[j] = kE2M1[q[j] >> 4]"),
            ("w[kChunk / 2 + j] = kE2M1[q[j] >> 4]", "w[kChunk / 2 + j] = kE2M1[q[j] & 15]")):
        assert planted.count(right) == 1, right  # a rewritten kernel without it would leave nothing planted
        planted = planted.replace(right, wrong)
    (src / "kernels" / "moe_experts_mxfp4.h").write_text(planted)
    root = tmp_path / "root"
    root.mkdir()
    (root / "headers").symlink_to(native.ort_headers(native.cache_root("ort-ops")).parents[2])
    bad = ort_ops.build(root, binding_sources(src / "ort_k3.cpp"), kernel_target)
    with pytest.raises(AssertionError):
        _check_mxfp4(bad, mxfp4_case(5, 2, 6, 64, 32, 1), "situ")


@pytest.fixture(scope="module")
def mxfp4_export(released_random, tmp_path_factory):
    from k3export.converters.onnx import export_onnx

    return export_onnx(released_random, tmp_path_factory.mktemp("mx") / "export", experts="mxfp4",
                       dtype="fp32").out_dir


def test_mxfp4_export_with_the_library(ort_lib, mxfp4_export, released_random, monkeypatch):
    """Prefill + decode of an fp32 ``--experts mxfp4`` export: ORT with the library (the experts read from their
    4-bit bytes, no 8-bit form written) equals ORT without it (the function bodies on the 8-bit form) and the
    PyTorch model, logits and states within fp32 tolerance, the same greedy tokens."""
    from k3export.runtime.loop import Decoding, next_tokens
    from k3export.runtime.torch_runner import TorchRunner

    ids = np.random.default_rng(3).integers(3, 500, (2, 12))
    runs, tokens = {}, {}
    for name in ("library", "bodies", "torch"):
        monkeypatch.setenv(ort_ops.ENV_SWITCH, "1" if name == "library" else "0")
        if name == "torch":
            runner = TorchRunner.from_pretrained(released_random, "float32")
        else:
            from k3export.runtime.ort_runner import OrtRunner

            runner = OrtRunner(mxfp4_export)
            assert runner.ort.k3_ops is (name == "library")
        d = Decoding(runner)
        steps = [d.feed(ids[:, :8])] + [d.feed(ids[:, i:i + 1]) for i in range(8, 12)]
        runs[name] = [(np.array(s.logits, np.float32), {k: np.array(v, np.float32) for k, v in s.state.items()})
                      for s in steps]
        tokens[name] = [next_tokens(s).tolist() for s in steps]
    for other in ("bodies", "torch"):
        assert tokens["library"] == tokens[other]
        for (lw, sw), (lo, so) in zip(runs["library"], runs[other]):
            np.testing.assert_allclose(lw[:, -1], lo[:, -1], rtol=0, atol=1e-4, err_msg=other)
            if other == "bodies":
                for name in sw:
                    np.testing.assert_allclose(sw[name], so[name], rtol=0, atol=1e-4, err_msg=name)


def test_mxfp4_experts_stay_at_4_25_bits(mxfp4_export):
    """The library's session reads the export's own bytes: the experts' inputs are uint8 [E, out, in/2] and
    [E, out, in/32] at their files' offsets, 4.25 bits per weight, and nothing else is retyped; each joins its
    router in one ``moe_route_experts_mxfp4`` (their inputs from the fourth on are the experts' too)."""
    from k3export.artifacts.expert_views import MXFP4_OP, ROUTE_MXFP4_OP, packed_view

    model = onnx.load(str(mxfp4_export / "model.onnx"), load_external_data=False)
    assert ort_ops.takes(model)
    packed = packed_view(model)
    before = {t.name: t for t in model.graph.initializer}
    nodes = [n for n in packed.graph.node if n.op_type in (MXFP4_OP, ROUTE_MXFP4_OP)]
    assert nodes and not any(n.op_type in ("moe_experts", "moe_route") for n in packed.graph.node)
    bits = weights = 0
    for node in nodes:
        for name in node.input[3:]:
            t = next(x for x in packed.graph.initializer if x.name == name)
            assert t.data_type == onnx.TensorProto.UINT8 and t.external_data == before[name].external_data
            length = int(next(e.value for e in t.external_data if e.key == "length"))
            assert length == int(np.prod(t.dims))
            bits += 8 * length
            if before[name].data_type == onnx.TensorProto.FLOAT4E2M1:
                weights += int(np.prod(before[name].dims))
    assert bits / weights == 4.25
    assert {t.name: t for t in packed.graph.initializer if t.name not in before or t != before[t.name]}.keys() <= {
        n for node in nodes for n in node.input[3:]}


def test_runner_prefers_the_4bit_experts_to_the_genai_form(ort_lib, released_random, tmp_path, monkeypatch):
    """An export holding ORT's 8-bit form (``--genai``) is opened from model.onnx when the library runs its MXFP4
    experts from the 4-bit bytes, and from model.genai.onnx without the library."""
    from k3export.converters.onnx import export_onnx
    from k3export.runtime.ort_runner import OrtRunner

    folder = export_onnx(released_random, tmp_path / "export", genai=True).out_dir
    for use, graph in (("1", "model.onnx"), ("0", "model.genai.onnx")):
        monkeypatch.setenv(ort_ops.ENV_SWITCH, use)
        runner = OrtRunner(folder)
        assert runner.graph_path.name == graph and runner.ort.k3_ops is (use == "1")
