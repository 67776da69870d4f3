"""k3::moe_route: Triton kernel (interpreter) and torch path vs an independent per-row reference."""

import pytest
import torch

from k3export.ops import OpInputError, moe_route, use_backend
from k3export.ops.moe_route import moe_route_triton
from k3export.ops.naive import moe_route_naive


def _independent(logits, bias, top_k, renormalize, scale):
    """Per row, pure Python on float64 copies of the fp32 scores: repeatedly take the max, lowest
    index among equals (ONNX TopK's tie rule)."""
    s32 = torch.sigmoid(logits.float())
    biased32 = s32 + bias.float()
    W, I = [], []
    for r in range(logits.shape[0]):
        vals = biased32[r].tolist()
        chosen = []
        for _ in range(top_k):
            best = max(v for j, v in enumerate(vals) if j not in chosen)
            chosen.append(min(j for j, v in enumerate(vals) if v == best and j not in chosen))
        w = [float(s32[r, j]) for j in chosen]
        if renormalize:
            tot = sum(w) + 1e-20
            w = [x / tot for x in w]
        W.append([x * scale for x in w])
        I.append(chosen)
    return torch.tensor(W, dtype=torch.float64), torch.tensor(I, dtype=torch.int64)


def _inputs(N, E, seed, ties=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=gen) * 2
    bias = torch.randn(E, generator=gen) * 0.1
    if ties:
        # identical biased scores across experts: equal logits and equal bias in groups
        logits = torch.randint(-2, 3, (N, E), generator=gen).float() * 0.5
        bias = torch.zeros(E)
        bias[::3] = 0.25
        logits[0] = 0.0  # a whole row of ties
    return logits, bias


CASES = [
    (5, 8, 2, True, 1.0, False),
    (7, 64, 6, True, 2.446, False),
    (3, 896, 16, True, 1.0, False),
    (4, 1024, 32, False, 1.5, False),
    (6, 20, 20, True, 1.0, False),  # top_k == E
    (9, 40, 8, True, 1.0, True),
    (9, 40, 8, False, 0.5, True),
    (2, 1, 1, False, 1.0, False),
]


@pytest.mark.parametrize("N,E,top_k,renorm,scale,ties", CASES)
def test_kernel_vs_reference(triton_interpreter, device, N, E, top_k, renorm, scale, ties):
    logits, bias = _inputs(N, E, seed=E + top_k, ties=ties)
    w, idx = moe_route_triton(logits.to(device), bias.to(device), top_k, renorm, scale)
    w_ref, i_ref = _independent(logits, bias, top_k, renorm, scale)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64 and w.shape == (N, top_k)
    assert torch.equal(idx.cpu(), i_ref)
    assert (w.cpu().double() - w_ref).abs().max() < 1e-6
    # the torch reference (stable sort) agrees too
    w_t, i_t = moe_route_naive(logits, bias, top_k, renorm, scale)
    assert torch.equal(i_t, i_ref) and (w_t.double() - w_ref).abs().max() < 1e-6


def test_ties_go_to_lower_index(triton_interpreter, device):
    logits = torch.zeros(1, 10)
    bias = torch.zeros(10)
    w, idx = moe_route_triton(logits.to(device), bias.to(device), 4, True, 1.0)
    assert idx.cpu().tolist() == [[0, 1, 2, 3]]
    assert torch.allclose(w.cpu(), torch.full((1, 4), 0.25))


def test_bias_selects_but_does_not_weight(triton_interpreter, device):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    w, idx = moe_route_triton(logits.to(device), bias.to(device), 2, False, 1.0)
    assert idx.cpu().tolist() == [[0, 3]]
    assert torch.allclose(w.cpu(), torch.sigmoid(torch.tensor([[0.0, 3.0]])), atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_registered_op(triton_interpreter, device, backend):
    logits, bias = _inputs(5, 48, seed=1)
    with use_backend(backend):
        w, idx = torch.ops.k3.moe_route(logits.to(device), bias.to(device), 6, True, 1.0)
        w2, idx2 = moe_route(logits.to(device), bias.to(device), 6)
    w_ref, i_ref = _independent(logits, bias, 6, True, 1.0)
    assert torch.equal(idx.cpu(), i_ref) and (w.cpu().double() - w_ref).abs().max() < 1e-6
    assert torch.equal(idx, idx2) and torch.equal(w, w2)


def test_export_traces_the_op():
    class M(torch.nn.Module):
        def forward(self, x, b):
            return torch.ops.k3.moe_route(x, b, 4, True, 1.0)

    logits, bias = _inputs(3, 16, seed=0)
    ep = torch.export.export(M(), (logits, bias))
    assert any("k3.moe_route" in str(n.target) for n in ep.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize(
    "args,name",
    [
        ((torch.zeros(4, 8), torch.zeros(8), 9, True, 1.0), "top_k"),
        ((torch.zeros(4, 8), torch.zeros(8), 0, True, 1.0), "top_k"),
        ((torch.zeros(4, 8), torch.zeros(7), 2, True, 1.0), "bias"),
        ((torch.zeros(4, 8, 1), torch.zeros(8), 2, True, 1.0), "logits"),
        ((torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8), 2, True, 1.0), "logits"),
        ((torch.zeros(4, 8), torch.zeros(8, dtype=torch.float64), 2, True, 1.0), "bias"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs(triton_interpreter, backend, args, name):
    with use_backend(backend):
        with pytest.raises(OpInputError, match=name):
            moe_route(*args)
        with pytest.raises(ValueError, match=name):
            torch.ops.k3.moe_route(*args)
