"""The control-flow k3 bodies in ONNX Runtime against float64 references: chunked KDA vs the naive recurrence,
the selected-experts loop vs a per-slot computation."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from k3export.artifacts.graph_forms import EXPERT_BLOCK, EXPERT_BLOCK_BYTES, expert_block
from k3export.converters.onnx.bodies import KDA_CHUNK, KDA_FACTOR_EXP, Body, kda_chunked_nodes, moe_experts_nodes
from k3export.modeling import modeling_k3 as mk

from moe_ref import per_slot_reference, random_moe


def _session(body: Body, inputs: dict[str, int], outputs: list[str]) -> ort.InferenceSession:
    graph = helper.make_graph(body.nodes, "t", [helper.make_tensor_value_info(n, t, None) for n, t in inputs.items()],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)], ir_version=11)
    return ort.InferenceSession(model.SerializeToString())


def _kda_session(gate_bound: float | None) -> ort.InferenceSession:
    b = Body("k_")
    o, s = kda_chunked_nodes(b, "q", "k", "v", "g", "beta", "s0", "scale", gate_bound)
    b.out(o, "o")
    b.out(s, "s")
    return _session(b, {n: TensorProto.FLOAT for n in ("q", "k", "v", "g", "beta", "s0", "scale")}, ["o", "s"])


@pytest.fixture(scope="module")
def kda_session():
    return _kda_session(None)


@pytest.fixture(scope="module")
def kda_factored_session():
    """K3's gate, g in [-5, 0]: the decays factored through mid-chunk (exponents within +-40, 75 masked)."""
    assert (KDA_CHUNK - 1) * 5.0 <= KDA_FACTOR_EXP
    return _kda_session(-5.0)


@pytest.mark.parametrize("tokens", [2, KDA_CHUNK, KDA_CHUNK + 1, 3 * KDA_CHUNK + 5])
@pytest.mark.parametrize("gate, form", [(-5.0, "pairwise"), (-20.0, "pairwise"),  # -20: exp(G) underflows
                                        (-5.0, "factored"), (-1e-3, "factored"),  # K3's bound, barely decaying
                                        ("at the bound", "factored")])  # g = -5 everywhere: the largest exponents
def test_chunked_kda_matches_float64_recurrence(request, tokens, gate, form):
    kda_session = request.getfixturevalue("kda_session" if form == "pairwise" else "kda_factored_session")
    gen = torch.Generator().manual_seed(tokens)
    B, H, K, V = 2, 3, 8, 6
    q, k = (mk.l2norm(torch.randn(B, tokens, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(B, tokens, H, V, generator=gen)
    g = torch.full((B, tokens, H, K), -5.0) if gate == "at the bound" else \
        gate * torch.sigmoid(3 * torch.randn(B, tokens, H, K, generator=gen))
    beta = torch.rand(B, tokens, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen)
    ref_o, ref_s = mk.kda_recurrent(*(t.double() for t in (q, k, v, g, beta, s0)), K ** -0.5)
    o, s = kda_session.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "g": g.numpy(),
                                  "beta": beta.numpy(), "s0": s0.numpy(), "scale": np.array(K ** -0.5, np.float32)})
    assert np.isfinite(o).all() and np.isfinite(s).all()
    np.testing.assert_allclose(o, ref_o.numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s, ref_s.numpy(), atol=2e-5, rtol=1e-4)


def test_chunked_kda_factors_only_within_fp32_range():
    """A bound whose masked products would overflow fp32 (15 x 7 > KDA_FACTOR_EXP; factored, g = -7 everywhere
    gives NaN) keeps the pairwise form: finite, and equal to the float64 recurrence."""
    assert (KDA_CHUNK - 1) * 7.0 > KDA_FACTOR_EXP
    sess = _kda_session(-7.0)
    gen = torch.Generator().manual_seed(1)
    T, H, K = 2 * KDA_CHUNK + 3, 2, 8
    q, k = (mk.l2norm(torch.randn(1, T, H, K, generator=gen)) for _ in range(2))
    v, beta, s0 = torch.randn(1, T, H, K, generator=gen), torch.rand(1, T, H, generator=gen), torch.randn(1, H, K, K)
    g = torch.full((1, T, H, K), -7.0)
    ref_o, ref_s = mk.kda_recurrent(*(t.double() for t in (q, k, v, g, beta, s0)), K ** -0.5)
    o, s = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "g": g.numpy(), "beta": beta.numpy(),
                           "s0": s0.numpy(), "scale": np.array(K ** -0.5, np.float32)})
    np.testing.assert_allclose(o, ref_o.numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s, ref_s.numpy(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("tokens,experts,k,block", [
    (1, 7, 3, EXPERT_BLOCK), (4, 7, 3, EXPERT_BLOCK), (33, 7, 3, EXPERT_BLOCK),
    (50, 3 * EXPERT_BLOCK + 3, 5, EXPERT_BLOCK), (1, 7, 3, 2), (2, 7, 3, 1)])
def test_moe_experts_loop_matches_per_slot_float64(act, tokens, experts, k, block):
    """Decode (per slot), one block of experts, and several blocks with a partial last one (2 threads, D = 96:
    ONNX Runtime parallelises the scatters, so a token's slots must never scatter-add into one row); and decode
    through the loop, as experts too large for a whole block take it."""
    b = Body("m_")
    b.out(moe_experts_nodes(b, "z", "w", "idx", "w1", "w3", "w2", act, 4.0, 25.0, block=block), "u")
    assert any(n.op_type == "If" for n in b.nodes) is (block == EXPERT_BLOCK)  # the per-slot decode branch
    f = TensorProto.FLOAT
    sess = _session(b, {"z": f, "w": f, "idx": TensorProto.INT64, "w1": f, "w3": f, "w2": f}, ["u"])
    z, w, idx, w1, w3, w2 = random_moe(tokens, tokens, experts, 96 if tokens == 50 else 12, 10, k)
    (u,) = sess.run(None, {"z": z.numpy(), "w": w.numpy(), "idx": idx.numpy(), "w1": w1.numpy(), "w3": w3.numpy(),
                           "w2": w2.numpy()})
    ref = per_slot_reference(z, w, idx, w1, w3, w2, act, 4.0, 25.0)
    np.testing.assert_allclose(u, ref.numpy(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("inter,dim,want", [
    (3072, 3584, 1),    # K3: 132 MB of fp32 per expert, more than the whole budget: one per iteration
    (256, 256, 8),      # big_cfg: 768 KiB per expert, 85 would fit: capped at EXPERT_BLOCK
    (1024, 1024, 5),    # 12 MiB per expert: 5 fit in 64 MiB, 6 do not
])
def test_expert_block_bounds_the_weights_gathered_per_iteration(inter, dim, want):
    assert (EXPERT_BLOCK, EXPERT_BLOCK_BYTES) == (8, 64 << 20)  # the budget the expected values are worked from
    assert expert_block(inter, dim) == want


def test_k3_preset_expert_size_is_the_one_priced():
    k3 = mk.K3Config.k3()
    assert (k3.moe_intermediate_size, k3.expert_input_size) == (3072, 3584)


def test_body_outputs_are_named_where_they_are_made():
    """`Body.out` renames a value made in the body (no ``Identity``, which ONNX Runtime copies when it names a
    subgraph output), also inside a nested ``If`` that reads it and for ops added later; an input, or a value
    named twice, goes through an ``Identity``."""
    b = Body("t_")
    s = b.op("Add", ["x", "y"])
    branch = helper.make_graph([helper.make_node("Neg", [s], ["neg"])], "br", [],
                               [helper.make_tensor_value_info("neg", TensorProto.FLOAT, None)])
    b.nodes.append(helper.make_node("If", [b.op("Constant", [], value=helper.make_tensor("c", TensorProto.BOOL, [],
                                                                                        [True]))],
                                    ["negated"], then_branch=branch, else_branch=branch))
    b.out(s, "sum")
    twice = b.op("Mul", [s, "y"])  # added after `out`: reads the renamed value
    b.out(twice, "prod")
    b.out(s, "sum_again")
    b.out("x", "x_again")
    assert [n.op_type for n in b.nodes].count("Identity") == 2
    x, y = np.array([1.0, 2.0], np.float32), np.array([3.0, -1.0], np.float32)
    got = _session(b, {"x": TensorProto.FLOAT, "y": TensorProto.FLOAT},
                   ["sum", "prod", "sum_again", "x_again", "negated"]).run(None, {"x": x, "y": y})
    for value, want in zip(got, [x + y, (x + y) * y, x + y, x, -(x + y)]):
        np.testing.assert_array_equal(value, want)
