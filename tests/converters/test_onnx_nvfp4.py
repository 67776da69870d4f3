"""``k3::moe_experts`` on NVFP4 experts: the standard-op body (onnx.reference) and ONNX Runtime's 8-bit form, each
against the float64 naive reference (`moe_experts_nvfp4_naive`) on random NVFP4 bytes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

ort = pytest.importorskip("onnxruntime")

from k3export.converters.onnx.bodies import moe_experts_function  # noqa: E402
from k3export.artifacts.expert_views import e4m3_to_float, q8_from_packed  # noqa: E402
from k3export.converters.onnx.nvfp4 import ort_moe_function  # noqa: E402
from k3export.ops.naive import moe_experts_nvfp4_naive  # noqa: E402
from k3export.ops.spec import MOE_EXPERTS_NVFP4, OpInputError  # noqa: E402
from nvfp4_ref import e2m1, e4m3  # noqa: E402
from onnx_reference_ops import Pad  # noqa: E402

E, D, I, K, N = 5, 64, 32, 2, 4


def _experts(seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Random NVFP4 w1, w3, w2 (packed, E4M3 bytes, scale_2 [E]; w1 and w3 share scale_2)."""
    rng = np.random.default_rng(seed)
    shared = rng.uniform(0.5, 2.0, E).astype(np.float32) * np.float32(2.0 ** -4)
    out = {}
    for w, (o, i) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
        packed = rng.integers(0, 256, (E, o, i // 2), dtype=np.uint8)
        scale = rng.integers(0x18, 0x50, (E, o, i // 16), dtype=np.uint8)  # E4M3 2^-4 .. 2^2 (no NaN)
        scale_2 = shared if w != "w2" else rng.uniform(0.5, 2.0, E).astype(np.float32) * np.float32(2.0 ** -4)
        out[w] = (packed, scale, scale_2)
    return out


def _feeds(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"z": rng.standard_normal((N, D)).astype(np.float32), "weights": rng.random((N, K)).astype(np.float32),
            "indices": np.array([[0, 3], [3, 4], [1, 0], [4, 2]], np.int64)}


def _model(function: onnx.FunctionProto, inits: list[TensorProto]) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    node = helper.make_node("moe_experts", list(function.input), ["u"], domain="k3", act="situ", beta1=4.0, beta2=25.0)
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("z", f, [N, D]),
                                              helper.make_tensor_value_info("weights", f, [N, K]),
                                              helper.make_tensor_value_info("indices", TensorProto.INT64, [N, K])],
                              [helper.make_tensor_value_info("u", f, [N, D])], inits)
    opsets = [helper.make_opsetid("", 27), helper.make_opsetid("k3", 1), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=11, functions=[function])


def _raw(name: str, elem: int, dims: list[int], data: np.ndarray) -> TensorProto:
    t = TensorProto()
    t.name, t.data_type, t.raw_data = name, elem, np.ascontiguousarray(data).tobytes()
    t.dims.extend(dims)
    return t


def _reference(mats, feeds) -> np.ndarray:
    """float64: the naive op on torch tensors, checked once against a numpy dequantisation from the bit fields."""
    args = []
    for w in ("w1", "w3", "w2"):
        args.append(torch.from_numpy(mats[w][0]))
    args += [torch.from_numpy(mats[w][1]).view(torch.float8_e4m3fn) for w in ("w1", "w3", "w2")]
    args += [torch.from_numpy(mats[w][2]) for w in ("w1", "w3", "w2")]
    u = moe_experts_nvfp4_naive(torch.from_numpy(feeds["z"]).double(), torch.from_numpy(feeds["weights"]),
                                torch.from_numpy(feeds["indices"]), *args, "situ", 4.0, 25.0).numpy()
    # the naive dequantisation against the bit fields, for one expert
    p, s, s2 = mats["w2"]
    nib = np.stack([p[3] & 15, p[3] >> 4], -1).reshape(D, I)
    from k3export.ops.naive import nvfp4_dequant_naive

    want = e2m1(nib) * np.repeat(e4m3(s[3]), 16, 1) * float(s2[3])
    got = nvfp4_dequant_naive(torch.from_numpy(p), torch.from_numpy(s).view(torch.float8_e4m3fn),
                              torch.from_numpy(s2))[3].numpy()
    np.testing.assert_array_equal(got, want)
    return u


def test_standard_body_and_ort_form_equal_float64():
    mats, feeds = _experts(), _feeds()
    want = _reference(mats, feeds)
    assert np.abs(want).max() > 1
    standard, q8 = [], []
    for w, (p, s, s2) in mats.items():
        standard += [_raw(w, TensorProto.FLOAT4E2M1, [E, p.shape[1], 2 * p.shape[2]], p),
                     _raw(w + "_scale", TensorProto.FLOAT8E4M3FN, list(s.shape), s),
                     numpy_helper.from_array(s2, w + "_scale_2")]
        # the 8-bit form `expert_views.q8_view` reads: q = 2v + 128, e4m3 / 2, scale_2
        q8 += [numpy_helper.from_array(q8_from_packed(p), w),
               numpy_helper.from_array((e4m3_to_float(s) / 2).astype(np.float32), w + "_scale"),
               numpy_helper.from_array(s2, w + "_scale_2")]
    model = _model(moe_experts_function("k3", "situ", 4.0, 25.0, 27, nvfp4=True), standard)
    onnx.checker.check_model(model, full_check=True)
    (u_std,) = ReferenceEvaluator(onnx.inliner.inline_local_functions(model), new_ops=[Pad]).run(None, feeds)
    np.testing.assert_allclose(u_std, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 2, 3
    (u_ort,) = ort.InferenceSession(_model(ort_moe_function("situ", 4.0, 25.0, 27), q8).SerializeToString(),
                                    so, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(u_ort, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_spec_names_the_misfit_input():
    shapes = [(N, D), (N, K), (N, K), (E, I, D // 2), (E, I, D // 2), (E, D, I // 2), (E, I, D // 16),
              (E, I, D // 16), (E, D, I // 16), (E,), (E,), (E,)]
    dtypes = ["float32", "float32", "int64", "uint8", "uint8", "uint8", "float8e4m3fn", "float8e4m3fn",
              "float8e4m3fn", "float32", "float32", "float32"]
    MOE_EXPERTS_NVFP4.check(shapes, dtypes, {"act": "situ", "beta1": 4.0, "beta2": 25.0})
    bad = list(shapes)
    bad[6] = bad[7] = (E, I, D // 32)
    with pytest.raises(OpInputError, match="one E4M3 scale per 16"):
        MOE_EXPERTS_NVFP4.check(bad, dtypes, {})
    with pytest.raises(OpInputError, match="input 'w2_scale': dtype uint8"):
        MOE_EXPERTS_NVFP4.check(shapes, dtypes[:8] + ["uint8"] + dtypes[9:], {})


def test_tensorrt_builds_the_nvfp4_node_as_its_plugin():
    """TensorRT's form of the 12-input node: ``k3::moe_experts_nvfp4`` over the same bytes, the packed values and
    E4M3 scales re-declared int8 (values [E, out, in/2], scales as they are), the global scales fp32; the checks
    accept it."""
    from k3export.converters.tensorrt.checks import inspect_k3_nodes
    from k3export.converters.tensorrt.plugin_forms import plugin_model

    mats = _experts()
    inits = []
    for w, (p, s, s2) in mats.items():
        inits += [_raw(w, TensorProto.FLOAT4E2M1, [E, p.shape[1], 2 * p.shape[2]], p),
                  _raw(w + "_scale", TensorProto.FLOAT8E4M3FN, list(s.shape), s),
                  numpy_helper.from_array(s2, w + "_scale_2")]
    for t in inits:  # graph names apart from the function's own input names (which its body reads)
        t.name = "layer." + t.name
    model = _model(moe_experts_function("k3", "situ", 4.0, 25.0, 27, nvfp4=True), inits)
    node = model.graph.node[0]
    node.input[3:] = ["layer." + n for n in node.input[3:]]
    node.attribute.append(helper.make_attribute("plugin_namespace", "k3"))
    built = plugin_model(model)
    (node,) = inspect_k3_nodes(built)
    assert node.op == "moe_experts_nvfp4"
    got = {t.name.removeprefix("layer."): (t.data_type, list(t.dims), t.raw_data) for t in built.graph.initializer}
    for w, (p, s, s2) in mats.items():
        assert got[w] == (TensorProto.INT8, list(p.shape), p.tobytes())
        assert got[w + "_scale"] == (TensorProto.INT8, list(s.shape), s.tobytes())
        assert got[w + "_scale_2"][:2] == (TensorProto.FLOAT, [E])


@pytest.mark.parametrize("arch", ["native", "x86-64"])
def test_library_kernel_reads_the_nvfp4_bytes(arch):
    """The k3 ORT library's ``moe_experts_nvfp4`` on the bytes as stored (retyped uint8: 4.5 bits a weight) equals
    the float64 reference: built for this CPU (AVX2's decode where it has it) and for plain x86-64 (one value at a
    time)."""
    import platform

    from k3export.runtime import ort_ops

    if arch != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={arch} is an x86-64 target")
    try:
        lib = ort_ops.build(arch=ort_ops.ARCH if arch == "native" else arch)
    except ort_ops.BuildError as exc:
        pytest.skip(f"k3 ORT ops not buildable here: {exc}")
    mats, feeds = _experts(seed=3), _feeds()
    want = _reference(mats, feeds)
    inits = []
    for w, (p, s, s2) in mats.items():
        inits += [numpy_helper.from_array(p, w), numpy_helper.from_array(s, w + "_scale"),
                  numpy_helper.from_array(s2, w + "_scale_2")]
    function = moe_experts_function("k3", "situ", 4.0, 25.0, 27, nvfp4=True)
    model = _model(function, inits)
    model.graph.node[0].op_type = "moe_experts_nvfp4"
    del model.functions[:]
    assert sum(t.raw_data.__len__() for t in model.graph.initializer if t.data_type == TensorProto.UINT8) * 8 == \
        pytest.approx(4.5 * 3 * E * I * D)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = 2, 3
    so.register_custom_ops_library(str(lib))
    (u,) = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
