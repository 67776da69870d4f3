"""k3export.ops.expert_stacks: a layer's expert weights kept stacked in place (the `expert_weights` hook) against
the experts' own parameters and a float64 model made before any stacking; when the stacks follow a change; the
memory a stacking takes; and where the kernel declines."""

from __future__ import annotations

import copy

import pytest
import torch

import k3export.modeling.modeling_k3 as mk
from k3export.modeling import K3Config
from k3export.ops import KERNELS, backend, expert_stacks


@pytest.fixture
def plugged(monkeypatch):
    """k3export's kernels in the modeling file's hooks for one test."""
    for name, kernel in KERNELS.items():
        monkeypatch.setitem(mk._KERNELS, name, kernel)


def _model():
    return mk.K3ForCausalLM(K3Config.tiny()).eval()


def _expert_params(moe):
    return [w for e in moe.experts for w in (e.w1.weight, e.w3.weight, e.w2.weight)]


def _slot_layout(w: torch.Tensor) -> bool:
    return w.stride() == (w.shape[1] * w.shape[2], 1, w.shape[1])


def test_cpu_stacks_are_the_parameters_stored_for_the_per_slot_path():
    moe = _model().model.layers[1].block_sparse_moe
    with torch.no_grad():
        w1, w3, w2 = expert_stacks.expert_weights(moe.experts)
        assert w1.shape == (moe.config.num_experts, moe.config.moe_intermediate_size, moe.config.expert_input_size)
        assert all(_slot_layout(w) for w in (w1, w3, w2))
        assert torch.equal(w1[2], moe.experts[2].w1.weight) and torch.equal(w2[5], moe.experts[5].w2.weight)
        assert expert_stacks.expert_weights(moe.experts)[0] is w1  # kept, not rebuilt
        moe.experts[3].w1.weight.add_(1.0)  # in place: an edit of the stack
        assert expert_stacks.expert_weights(moe.experts)[0] is w1 and torch.equal(w1[3], moe.experts[3].w1.weight)


def test_replacements_are_seen_at_the_next_call():
    """A parameter assigned, an expert replaced, load_state_dict(assign=True), an expert removed: each restacks."""
    model = _model()
    moe = model.model.layers[1].block_sparse_moe
    with torch.no_grad():
        first = expert_stacks.expert_weights(moe.experts)
        moe.experts[2].w1.weight = torch.nn.Parameter(torch.zeros_like(moe.experts[2].w1.weight))
        second = expert_stacks.expert_weights(moe.experts)
        assert second[0] is not first[0] and torch.count_nonzero(second[0][2]) == 0
        fresh = mk.K3Expert(moe.config)
        fresh.w2.weight.fill_(3.0)
        moe.experts[4] = fresh
        third = expert_stacks.expert_weights(moe.experts)
        assert torch.all(third[2][4] == 3.0) and torch.equal(third[0][4], fresh.w1.weight)
        state = {k: torch.full_like(v, 0.5) for k, v in moe.experts[1].state_dict().items()}
        moe.experts[1].load_state_dict(state, assign=True)
        assert torch.all(expert_stacks.expert_weights(moe.experts)[1][1] == 0.5)
        del moe.experts[7]
        assert expert_stacks.expert_weights(moe.experts)[0].shape[0] == moe.config.num_experts - 1


def test_a_moved_model_is_stacked_again(plugged):
    model = _model()
    ids = torch.tensor([[3, 1, 4]])
    with torch.inference_mode():
        model(input_ids=ids)
    reference = copy.deepcopy(model).double()  # moves every parameter: the kernels decline, float64 runs
    with torch.inference_mode():
        reference(input_ids=ids)
        assert expert_stacks.expert_weights(reference.model.layers[1].block_sparse_moe.experts) is NotImplemented
    back = reference.float()
    moe = back.model.layers[1].block_sparse_moe
    with torch.inference_mode():
        stacks = expert_stacks.expert_weights(moe.experts)
        torch.testing.assert_close(back(input_ids=ids).logits.double(), reference.double()(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    assert torch.equal(stacks[0][1], moe.experts[1].w1.weight)


@pytest.mark.parametrize("layout", ["cpu", "accelerator"])
def test_stacks_hold_the_expert_weights_once(layout, plugged, monkeypatch, tmp_path):
    """The experts' parameters become views of the stacks, in CPU's [E, in, out] layout and in an accelerator's
    [E, out, in] (run here on CPU by taking that branch): one copy of the weights, the logits of a float64 model
    made before any stacking, edits in place seen, saved and loaded whole, and the parameters stay ordinary
    tensors after a forward under inference_mode. Stacks still in place are found, not copied again."""
    model = _model()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    reference = _model()
    reference.load_state_dict(before)
    reference.double()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    if layout == "accelerator":
        monkeypatch.setattr(expert_stacks, "cpu_layout", lambda device: False)
    with torch.inference_mode():
        got = model(input_ids=ids).logits
        torch.testing.assert_close(got.double(), reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    moe = model.model.layers[1].block_sparse_moe
    with torch.no_grad():
        stacks = expert_stacks.expert_weights(moe.experts)
    assert all(_slot_layout(s) is (layout == "cpu") for s in stacks)
    storages = {w.untyped_storage().data_ptr() for w in _expert_params(moe)}
    assert storages == {s.untyped_storage().data_ptr() for s in stacks}  # no second copy
    assert not any(w.is_inference() for w in _expert_params(moe))
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    with torch.no_grad():  # the same parameter assigned again: the stacks are found as they lie, not copied
        moe.experts[2].w1.weight = moe.experts[2].w1.weight
        assert [t.data_ptr() for t in expert_stacks.expert_weights(moe.experts)] == [t.data_ptr() for t in stacks]
    copied = copy.deepcopy(model).model.layers[1].block_sparse_moe  # a deep copy clones each parameter
    with torch.no_grad():
        again = expert_stacks.expert_weights(copied.experts)
    assert all(torch.equal(a, b) for a, b in zip(again, stacks))
    assert {w.untyped_storage().data_ptr() for w in _expert_params(copied)} == \
        {s.untyped_storage().data_ptr() for s in again}
    with torch.no_grad():  # an edit in place reaches the stack, outside inference_mode too
        for m in (model, reference):
            m.model.layers[1].block_sparse_moe.experts[2].w3.weight.mul_(-1.0)
        torch.testing.assert_close(model(input_ids=ids).logits.double(), reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    model.save_pretrained(tmp_path)
    loaded = mk.K3ForCausalLM.from_pretrained(tmp_path)
    want = reference.float().state_dict()
    assert all(torch.equal(t, want[name]) for name, t in loaded.state_dict().items())


def test_the_kernel_declines_and_moves_nothing():
    moe = _model().model.layers[1].block_sparse_moe
    assert expert_stacks.expert_weights(moe.experts) is NotImplemented  # grad enabled, parameters that want it
    with torch.no_grad():
        with backend.use_backend("torch"):
            assert expert_stacks.expert_weights(moe.experts) is NotImplemented
        assert expert_stacks.expert_weights(torch.nn.ModuleList([torch.nn.Linear(2, 2)])) is NotImplemented
        moe.double()
        assert expert_stacks.expert_weights(moe.experts) is NotImplemented
    assert all(w.is_contiguous() and w.untyped_storage().nbytes() == w.numel() * w.element_size()
               for w in _expert_params(moe))


_STACK_PEAK = """
import torch
from k3export.modeling import K3Config, modeling_k3 as mk
from k3export.ops import expert_stacks

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
    expert_stacks.expert_weights(moe.experts)
print(layer, status("VmHWM") - before, status("VmRSS") - before)
"""


def test_stacking_a_layer_never_holds_its_experts_twice():
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
