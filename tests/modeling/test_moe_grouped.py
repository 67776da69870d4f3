"""`moe_experts` (grouped by expert) against a float64 per-slot reference, and the modeling MoE against it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3export.modeling import modeling_k3 as mk
from moe_ref import per_slot_reference


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("grouped", [True, False])
def test_moe_experts_matches_per_slot_float64(act, tokens, grouped, monkeypatch):
    if not grouped:  # the loop fallback of torch builds without grouped_mm
        monkeypatch.delattr(F, "grouped_mm", raising=False)
    gen = torch.Generator().manual_seed(tokens)
    E, D, I, k = 6, 12, 8, 3  # 16-byte aligned rows (grouped_mm)
    z = torch.randn(tokens, D, generator=gen)
    w1, w3 = torch.randn(E, I, D, generator=gen) / 3, torch.randn(E, I, D, generator=gen) / 3
    w2 = torch.randn(E, D, I, generator=gen) / 3
    indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    got = mk.moe_experts(z, weights, indices, w1, w3, w2, act, 4.0, 25.0)
    ref = per_slot_reference(z, weights, indices, w1, w3, w2, act, 4.0, 25.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5)


def test_stacked_experts_follow_weight_updates():
    model = mk.K3ForCausalLM(mk.K3Config.tiny()).eval()
    moe = model.model.layers[1].block_sparse_moe
    first = moe.stacked_experts()[0].clone()
    with torch.no_grad():
        moe.experts[3].w1.weight.add_(1.0)  # in place: the cached stack must notice
    assert torch.equal(moe.stacked_experts()[0][3], first[3] + 1.0)


def test_a_cached_sequence_checks_the_expert_stack_when_it_starts():
    model = mk.K3ForCausalLM(mk.K3Config.tiny()).eval()
    moe = model.model.layers[1].block_sparse_moe
    ids = torch.tensor([[3, 1, 4, 1]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        started_with = moe.stacked_experts(checked=True)
        moe.experts[0].w1.weight.add_(1.0)
        model(input_ids=ids[:, :1], cache=out.cache, use_cache=True)  # a later step of the same sequence
        assert moe.stacked_experts(checked=True) is started_with
        model(input_ids=ids, use_cache=True)  # a new sequence checks the weights again
        rebuilt = moe.stacked_experts(checked=True)
    assert rebuilt is not started_with
    assert torch.equal(rebuilt[0][0], moe.experts[0].w1.weight)


def _expert_params(moe):
    return [w for e in moe.experts for w in (e.w1.weight, e.w3.weight, e.w2.weight)]


@pytest.mark.parametrize("layout", ["cpu", "accelerator"])
def test_stacks_hold_the_expert_weights_once(layout, monkeypatch, tmp_path):
    """The experts' parameters become views of the stacks, in CPU's [E, in, out] layout and in an accelerator's
    [E, out, in] (run here on CPU by taking that branch): one copy of the weights, the logits of a float64 model
    made before any stacking, edits in place seen, saved and loaded whole, and the parameters stay ordinary
    tensors after a forward under inference_mode."""
    model = mk.K3ForCausalLM(mk.K3Config.tiny()).eval()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    reference = mk.K3ForCausalLM(mk.K3Config.tiny()).eval()
    reference.load_state_dict(before)
    reference.double()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    if layout == "accelerator":
        monkeypatch.setattr(mk, "_slot_stacks", lambda device: False)
    with torch.inference_mode():
        got = model(input_ids=ids).logits
        torch.testing.assert_close(got.double(), reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    moe = model.model.layers[1].block_sparse_moe
    stacks = moe.stacked_experts()
    assert mk._slot_layout(*stacks) is (layout == "cpu")
    storages = {w.untyped_storage().data_ptr() for w in _expert_params(moe)}
    assert storages == {s.untyped_storage().data_ptr() for s in stacks}  # no second copy
    assert not any(w.is_inference() for w in _expert_params(moe))
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    with torch.no_grad():  # an edit in place reaches the stack, outside inference_mode too
        for m in (model, reference):
            m.model.layers[1].block_sparse_moe.experts[2].w3.weight.mul_(-1.0)
        torch.testing.assert_close(model(input_ids=ids).logits.double(), reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    model.save_pretrained(tmp_path)
    loaded = mk.K3ForCausalLM.from_pretrained(tmp_path)
    want = reference.float().state_dict()
    assert all(torch.equal(t, want[name]) for name, t in loaded.state_dict().items())
