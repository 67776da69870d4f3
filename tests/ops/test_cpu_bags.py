"""k3export.ops.cpu_bags: the ``embedding_bag`` reads of the `linears` and `moe_experts` hooks against float64
products and the modeling file's PyTorch functions, alone and inside a decoding model; and where they decline."""

from __future__ import annotations

import pytest
import torch

import k3export.modeling.modeling_k3 as mk
from k3export.modeling import tiny_model
from k3export.ops import KERNELS, backend, cpu_bags
from moe_ref import per_slot_reference, random_moe


@pytest.fixture
def plugged(monkeypatch):
    """k3export's kernels in the modeling file's hooks for one test."""
    for name, kernel in KERNELS.items():
        monkeypatch.setitem(mk._KERNELS, name, kernel)


def _one_row_linear(in_f: int, out_f: int, seed: int):
    """A `K3Linear` with random weights, one input row, and its float64 product."""
    gen = torch.Generator().manual_seed(seed)
    lin = mk.K3Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5)
    x = torch.randn(1, 1, in_f, generator=gen)
    return lin, x, x.double() @ lin.weight.double().T


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_linear_matches_float64(threads, plugged):
    """One row is read through bags of the weight stored [in, out] (as many bags as threads that divide `in`); the
    weight moves there on first use and goes into state dicts contiguous; more rows and autograd take F.linear."""
    lin, x, ref = _one_row_linear(512, 384, seed=0)
    original = lin.weight.detach().clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            one = lin(x)
    finally:
        torch.set_num_threads(before)
    assert one.shape == (1, 1, 384)
    torch.testing.assert_close(one.double(), ref, rtol=1e-5, atol=1e-5)
    assert lin.weight.stride() == (1, 384) and torch.equal(lin.weight, original)
    state = lin.state_dict()["weight"]
    assert state.is_contiguous() and torch.equal(state, original)
    two = torch.cat([x, x], dim=1)
    assert cpu_bags.linears(two, [lin]) is NotImplemented
    with torch.no_grad():
        many = lin(two)  # two rows: F.linear over the transposed storage
    torch.testing.assert_close(one, many[:, :1], rtol=1e-5, atol=1e-5)
    assert cpu_bags.linears(x, [lin]) is NotImplemented  # grad mode, a weight that wants one
    lin(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, x.reshape(1, -1).expand(384, -1), rtol=0, atol=0)


def test_linears_decline_outside_their_contract():
    lin, x, _ = _one_row_linear(512, 256, seed=2)
    small, _, _ = _one_row_linear(64, 32, seed=3)
    with torch.no_grad():
        assert cpu_bags.linears(x.double(), [lin]) is NotImplemented
        assert cpu_bags.linears(torch.randn(1, 64), [small]) is NotImplemented  # below ROW_MIN_NUMEL
        biased = torch.nn.Linear(512, 256)
        assert cpu_bags.linears(x, [biased]) is NotImplemented
        with backend.use_backend("torch"):
            assert cpu_bags.linears(x, [lin]) is NotImplemented
    assert lin.weight.is_contiguous()  # nothing moved for a declined call


def _largest_tensor_made(fn):
    """(fn(), the numel of the largest tensor any operator fn runs makes); views allocate nothing and are skipped."""
    from torch.utils._python_dispatch import TorchDispatchMode

    largest = [0]

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                largest[0] = max([largest[0], *(t.numel() for t in torch.utils._pytree.tree_leaves(out)
                                                if isinstance(t, torch.Tensor))])
            return out

    with Ops():
        out = fn()
    return out, largest[0]


def test_one_row_linear_makes_no_weight_sized_temporary(plugged):
    """The bags are read in place: no operator makes a tensor near the weight's size (vecdot made one as large as
    the weight: ~1 GB for each of K3's dense MLP weights)."""
    lin, x, ref = _one_row_linear(1024, 768, seed=1)
    with torch.no_grad():
        lin(x)  # moves the weight into its [in, out] storage: one copy, once
        y, largest = _largest_tensor_made(lambda: lin(x))
    assert 0 < largest <= 2 * 1024
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_decoded_model_saves_and_loads_its_weights_unchanged(tmp_path, plugged, monkeypatch):
    """After decode steps have moved the one-row weights into [in, out] storages, save_pretrained writes the
    checkpoint's layout and values, and the reloaded model decodes the same logits."""
    monkeypatch.setattr(cpu_bags, "ROW_MIN_NUMEL", 0)  # the tiny model's weights are below it
    model = tiny_model(seed=4)
    original = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.tensor([[5, 3, 9]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        step = model(input_ids=ids[:, -1:], use_cache=True, cache=out.cache).logits
    moved = [n for n, p in model.named_parameters() if p.dim() == 2 and not p.is_contiguous() and "experts." not in n]
    assert moved  # the path under test ran
    model.save_pretrained(tmp_path)
    loaded = mk.K3ForCausalLM.from_pretrained(tmp_path).eval()
    assert all(torch.equal(t, original[name]) for name, t in loaded.state_dict().items())
    with torch.no_grad():
        out = loaded(input_ids=ids, use_cache=True)
        again = loaded(input_ids=ids[:, -1:], use_cache=True, cache=out.cache).logits
    torch.testing.assert_close(again, step, rtol=1e-5, atol=1e-5)


def test_projections_sharing_an_input_are_read_as_one(plugged, monkeypatch):
    """KDA's q, k, v, f_a, b, g (and MLA's, the MLP's) become column blocks of one [in, sum(out)] storage on the
    first decode step; the steps equal the float64 model's, a member called alone still computes its own product,
    and a replaced weight is seen at the next step (the storage is placed again around it)."""
    monkeypatch.setattr(cpu_bags, "ROW_MIN_NUMEL", 0)  # the tiny model's weights are below it
    model = tiny_model(seed=5)
    reference = tiny_model(seed=5).double()  # float64: the kernels decline, the PyTorch functions run
    ids = torch.tensor([[7, 2, 11, 4]])

    with torch.no_grad():
        out, ref = model(input_ids=ids[:, :2], use_cache=True), reference(input_ids=ids[:, :2], use_cache=True)
        for t in range(2, 4):
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, cache=out.cache)
            ref = reference(input_ids=ids[:, t:t + 1], use_cache=True, cache=ref.cache)
            torch.testing.assert_close(out.logits.double(), ref.logits, rtol=1e-4, atol=1e-4)
    kda = model.model.layers[1].self_attn
    members = [kda.get_submodule(n).weight for n in kda.x_projections]
    fused = cpu_bags._side_by_side(members)
    assert fused is not None and fused.shape == (kda.q_proj.in_features, sum(w.shape[0] for w in members))
    groups = [m for m in model.modules() if hasattr(m, "x_projections") or isinstance(m, mk.K3MLP)]
    assert {type(m).__name__ for m in groups} == {"K3KimiDeltaAttention", "K3MLAttention", "K3MLP"}
    for m in groups:
        names = m.x_projections if hasattr(m, "x_projections") else ("gate_proj", "up_proj")
        assert cpu_bags._side_by_side([m.get_submodule(n).weight for n in names]) is not None, type(m).__name__
    x = torch.randn(1, 1, kda.q_proj.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(kda.k_proj(x).double(), x.double() @ kda.k_proj.weight.double().T,
                                   rtol=1e-5, atol=1e-5)  # alone: its block, not the whole storage
        new = torch.randn_like(kda.v_proj.weight)
        kda.v_proj.weight = torch.nn.Parameter(new)
        reference.model.layers[1].self_attn.v_proj.weight.copy_(new.double())
        out = model(input_ids=ids[:, 3:4], use_cache=True, cache=out.cache)
        ref = reference(input_ids=ids[:, 3:4], use_cache=True, cache=ref.cache)
    torch.testing.assert_close(out.logits.double(), ref.logits, rtol=1e-4, atol=1e-4)
    again = cpu_bags._side_by_side([kda.get_submodule(n).weight for n in kda.x_projections])
    assert again is not None and again.data_ptr() != fused.data_ptr() and torch.equal(kda.v_proj.weight, new)


def test_grouped_projections_keep_the_gradient_of_any_member(plugged, monkeypatch):
    """With grad enabled, a group whose later member wants a gradient is not read through the bags (which record
    none): that member gets the gradient F.linear gives, and nothing moves."""
    monkeypatch.setattr(cpu_bags, "ROW_MIN_NUMEL", 0)
    model = tiny_model(seed=6)
    for p in model.parameters():
        p.requires_grad_(False)
    kda = model.model.layers[1].self_attn
    kda.v_proj.weight.requires_grad_(True)  # not the group's first member
    model(input_ids=torch.tensor([[9]])).logits.sum().backward()
    assert kda.v_proj.weight.grad is not None and kda.v_proj.weight.grad.abs().sum() > 0
    assert all(kda.get_submodule(n).weight.is_contiguous() for n in kda.x_projections)


def _slot_stored(w: torch.Tensor) -> torch.Tensor:
    """w [E, out, in] as `expert_stacks` keeps it on CPU: stored [E, in, out], viewed [E, out, in]."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_per_slot_experts_match_float64(act, tokens):
    E, D = 8, 12
    z, weights, indices, w1, w3, w2 = random_moe(10 + tokens, tokens, E, D, 20, 3)
    ws = [_slot_stored(w) for w in (w1, w3, w2)]
    got = cpu_bags.moe_experts(z, weights, indices, *ws, act, 4.0, 25.0)
    assert got is not NotImplemented and indices.numel() <= E  # the per-slot path ran
    ref = per_slot_reference(z, weights, indices, w1, w3, w2, act, 4.0, 25.0)
    assert got.dtype == torch.float32 and got.shape == (tokens, D)
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5)
    grouped = mk.moe_experts.fallback(z, weights, indices, w1, w3, w2, act, 4.0, 25.0)  # the modeling file's
    torch.testing.assert_close(got, grouped, rtol=1e-5, atol=1e-5)


def test_per_slot_experts_decline_outside_their_contract():
    z, weights, indices, w1, w3, w2 = random_moe(1, 3, 8, 12, 20, 3)
    ws = [_slot_stored(w) for w in (w1, w3, w2)]
    assert cpu_bags.moe_experts(z, weights, indices, *ws, "situ", 4.0, 25.0) is NotImplemented  # 9 slots > 8 experts
    z, weights, indices = z[:1], weights[:1], indices[:1]
    assert cpu_bags.moe_experts(z, weights, indices, w1, w3, w2, "situ", 4.0, 25.0) is NotImplemented  # [E, out, in]
    assert cpu_bags.moe_experts(z, weights, indices, [*ws[0]], *ws[1:], "situ", 4.0, 25.0) is NotImplemented
    assert cpu_bags.moe_experts(z.double(), weights, indices, *ws, "situ", 4.0, 25.0) is NotImplemented
    with backend.use_backend("torch"):
        assert cpu_bags.moe_experts(z, weights, indices, *ws, "situ", 4.0, 25.0) is NotImplemented
