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
    """A replaced expert weight is seen from the next sequence on (an edit in place is seen at once: the
    parameters are views of the stacks)."""
    model = mk.K3ForCausalLM(mk.K3Config.tiny()).eval()
    moe = model.model.layers[1].block_sparse_moe
    ids = torch.tensor([[3, 1, 4, 1]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        started_with = moe.stacked_experts(checked=True)
        replaced = moe.experts[0].w1.weight + 1.0
        moe.experts[0].w1.weight = torch.nn.Parameter(replaced.clone())
        model(input_ids=ids[:, :1], cache=out.cache, use_cache=True)  # a later step of the same sequence
        assert moe.stacked_experts(checked=True) is started_with
        model(input_ids=ids, use_cache=True)  # a new sequence checks the weights again
        rebuilt = moe.stacked_experts(checked=True)
    assert rebuilt is not started_with
    assert torch.equal(rebuilt[0][0], replaced)


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


_STACK_PEAK = """
import torch
from k3export.modeling import K3Config, modeling_k3 as mk

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

model = mk.K3ForCausalLM(K3Config.tiny(num_experts=64, moe_intermediate_size=1024)).eval()
moe = model.model.layers[1].block_sparse_moe
layer = sum(w.numel() * w.element_size() for e in moe.experts for w in (e.w1.weight, e.w3.weight, e.w2.weight))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = status("VmRSS")
with torch.inference_mode():
    moe.stacked_experts()
print(layer, status("VmHWM") - before, status("VmRSS") - before)
"""


def test_stacking_a_layer_never_holds_its_experts_twice(tmp_path):
    """Each expert's old storage goes as soon as it is copied into the stack (a K3 layer's experts are 59 GB of
    bf16): the process grows by a small part of the layer's expert bytes while stacking, not by all of them.
    glibc is told to map every block of 64 KiB or more, so that a freed expert goes back to the system at once
    (what it does by default for blocks as large as a big model's experts)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    run = subprocess.run([sys.executable, "-c", _STACK_PEAK], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    layer, peak, after = map(int, run.stdout.split())
    assert layer >= 36 << 20  # 64 experts x 3 x 1024 x 48 fp32
    assert peak < layer // 8, (layer, peak)
    assert abs(after) < layer // 8, (layer, after)

