"""The ONNX functions of the fused k3 ops (`k3export.converters.onnx.fused_bodies`), run by plain ONNX Runtime (no k3
library) on float64 inputs, against each op's naive reference (`k3export.ops.naive`, through the cases of
tests/fused_ref.py). The library's kernels against the same references: tests/runtime/test_ort_ops.py and
tests/runtime/test_ov_ext.py."""

import numpy as np
import onnx
import pytest
from onnx import helper

from k3export.converters.onnx import bodies, fused_bodies, functions
from k3export.ops.spec import FUSED_SPECS
from fused_ref import (attn_res_aggregate_case, l2_norm_case, mla_attend_case,  # tests/ on sys.path
                       moe_route_experts_case, short_conv_case, kda_layer_case)

ort = pytest.importorskip("onnxruntime")
OPSET = 24  # RMSNormalization (the aggregate's body) is opset 23


def _run(op, fns, inputs, attrs, n_out, overload=""):
    """One ``k3::op`` node over `inputs` (float arrays as float64) with the model-local functions `fns`, run by a
    plain ORT session; its outputs."""
    feeds = {n: a.astype(np.float64) if a.dtype == np.float32 else a for n, a in inputs}
    outs = list(FUSED_SPECS[op].output_names[:n_out])
    node = helper.make_node(op, [n for n, _ in inputs], outs, domain="k3", **attrs)
    node.overload = overload
    # inputs of unknown shape, as an export's: ORT's shape inference of kda's chunked body fails on static ones
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info(
        n, helper.np_dtype_to_tensor_dtype(a.dtype), None) for n, a in feeds.items()],
        [onnx.ValueInfoProto(name=o) for o in outs])
    model = helper.make_model(graph, functions=fns, ir_version=11,
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("k3", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _close(got, want, tol=1e-12):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,n", [(3, 8), (5, 37)])
def test_l2_norm(rows, n):
    inputs, attrs, want = l2_norm_case(rows, n)
    _close(_run("l2_norm", [fused_bodies.l2_norm_function(OPSET)], inputs, attrs, 1), want)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kernel", [None, 4], ids=["taps-from-shape", "taps-given"])
def test_short_conv(T, masked, kernel):
    inputs, attrs, want = short_conv_case(T, masked)
    _close(_run("short_conv", [fused_bodies.short_conv_function(OPSET, masked, kernel)], inputs, attrs, 2), want)


@pytest.mark.parametrize("S", [1, 2, 5])
def test_attn_res_aggregate(S):
    inputs, attrs, want = attn_res_aggregate_case(S, rows=6)
    inputs = [("weight", inputs[0][1])] + [(f"sources_{i}", a) for i, (_, a) in enumerate(inputs[1:])]
    fns = [fused_bodies.attn_res_aggregate_function(OPSET, s) for s in (S, S + 1)]  # overloads: the node picks one
    _close(_run("attn_res_aggregate", fns, inputs, attrs, 1, overload=f"s{S}"), want)


@pytest.mark.parametrize("masked,halves,T", [(False, False, 4), (True, False, 4), (True, True, 6), (False, True, 1),
                                             (True, True, 9), (False, False, 7)])
def test_mla_attend(masked, halves, T):
    """Blocks of at most 4 queries: T = 6, 7 and 9 attend in 2, 2 and 3 blocks (padded rows), T <= 4 in one call."""
    inputs, attrs, want = mla_attend_case(masked, halves, T)
    inputs = [(FUSED_SPECS["mla_attend"].input_names[i], a) for i, (_, a) in enumerate(inputs)]
    fn = fused_bodies.mla_attend_function(OPSET, halves, masked, query_block=4)
    _close(_run("mla_attend", [fn], inputs, attrs, 1), want, tol=1e-6)  # scale and fill: fp32 attributes


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("given", [False, True], ids=["dims-from-shapes", "dims-given"])
def test_kda_layer(T, masked, given):
    """The body calls k3::short_conv, k3::l2_norm and k3::kda (its body reshapes by the head count: 2); kda's body
    computes in fp32, as the export's does, and takes V = K only, as K3 has."""
    inputs, attrs, want = kda_layer_case(T, masked, V=8)
    fns = [fused_bodies.kda_layer_function(OPSET, masked, (2, 8, 8) if given else None),
           fused_bodies.short_conv_function(OPSET, masked, 4 if given else None),
           fused_bodies.l2_norm_function(OPSET), functions._function("kda", bodies.kda_function("k3", 2, OPSET).node,
                                                                       OPSET)]
    _close(_run("kda_layer", fns, inputs, attrs, 3), want, tol=2e-5)


@pytest.mark.parametrize("N", [1, 5])
def test_moe_route_experts(N):
    """Dense experts: the body calls k3::moe_route and k3::moe_experts (fp32 bodies, as the export's)."""
    inputs, attrs, want = moe_route_experts_case(False, N)
    fns = [fused_bodies.moe_route_experts_function(OPSET, scales=False), functions.moe_route_function(OPSET),
           functions._function("moe_experts", bodies.moe_experts_function("k3", "situ", 4.0, 25.0, OPSET).node, OPSET)]
    inputs = [(n, a) for n, a in inputs]
    _close(_run("moe_route_experts", fns, inputs, attrs, 1), want, tol=1e-4)


def test_every_fused_op_has_a_naive_reference_and_a_body():
    from k3export.ops import naive

    assert set(naive.FUSED_NAIVE) == set(FUSED_SPECS)
    made = {f.name for f in (fused_bodies.l2_norm_function(OPSET), fused_bodies.short_conv_function(OPSET, True),
                             fused_bodies.attn_res_aggregate_function(OPSET, 2),
                             fused_bodies.mla_attend_function(OPSET, True, True, 128),
                             fused_bodies.kda_layer_function(OPSET, True),
                             fused_bodies.moe_route_experts_function(OPSET, True))}
    # moe_route_experts_mxfp4 is ONNX Runtime's name for moe_route_experts on the 4-bit bytes retyped
    assert made == set(FUSED_SPECS) - {"moe_route_experts_mxfp4"}
