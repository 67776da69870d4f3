"""The batch-1 decode paths of the modeling file (per-slot experts, one-row linears, the one-token short conv)
against float64 references and against the paths that prefill takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3export.modeling import modeling_k3 as mk
from k3export.modeling import tiny_model
from moe_ref import per_slot_reference, random_moe


def _slot_stored(w: torch.Tensor) -> torch.Tensor:
    """w [E, out, in] as `stacked_experts` keeps it on CPU: stored [E, in, out], viewed [E, out, in]."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_per_slot_experts_match_float64(act, tokens):
    E, D = 8, 12
    z, weights, indices, w1, w3, w2 = random_moe(10 + tokens, tokens, E, D, 20, 3)
    ws = [_slot_stored(w) for w in (w1, w3, w2)]
    assert mk._slot_layout(*ws) and indices.numel() <= E  # the per-slot path runs
    got = mk.moe_experts(z, weights, indices, *ws, act, 4.0, 25.0)
    ref = per_slot_reference(z, weights, indices, w1, w3, w2, act, 4.0, 25.0)
    assert got.dtype == torch.float32 and got.shape == (tokens, D)
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5)
    grouped = mk.moe_experts(z, weights, indices, w1, w3, w2, act, 4.0, 25.0)  # contiguous: the grouped path
    torch.testing.assert_close(got, grouped, rtol=1e-5, atol=1e-5)


def test_cpu_stack_is_stored_for_the_per_slot_path_without_more_copies():
    model = tiny_model()
    moe = model.model.layers[1].block_sparse_moe
    with torch.no_grad():
        w1, w3, w2 = moe.stacked_experts()
        assert w1.shape == (moe.config.num_experts, moe.config.moe_intermediate_size, moe.config.expert_input_size)
        assert mk._slot_layout(w1, w3, w2)
        assert torch.equal(w1[2], moe.experts[2].w1.weight) and torch.equal(w2[5], moe.experts[5].w2.weight)
        assert moe.stacked_experts()[0] is w1  # cached, not rebuilt
        moe.experts[2].w1.weight = torch.nn.Parameter(torch.zeros_like(moe.experts[2].w1.weight))  # replaced
        assert torch.count_nonzero(moe.stacked_experts()[0][2]) == 0


def _one_row_linear(in_f: int, out_f: int, seed: int):
    """A `K3Linear` with random weights, one input row, and its float64 product."""
    gen = torch.Generator().manual_seed(seed)
    lin = mk.K3Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5)
    x = torch.randn(1, 1, in_f, generator=gen)
    return lin, x, x.double() @ lin.weight.double().T


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_linear_matches_float64(threads):
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
    with torch.no_grad():
        many = lin(torch.cat([x, x], dim=1))  # two rows: F.linear over the transposed storage
    torch.testing.assert_close(one, many[:, :1], rtol=1e-5, atol=1e-5)
    lin(x).sum().backward()  # grad mode, a weight that wants one: F.linear
    torch.testing.assert_close(lin.weight.grad, x.reshape(1, -1).expand(384, -1), rtol=0, atol=0)


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


def test_one_row_linear_makes_no_weight_sized_temporary():
    """The bags are read in place: no operator makes a tensor near the weight's size (vecdot, which this replaced,
    made one as large as the weight: ~1 GB for each of K3's dense MLP weights)."""
    lin, x, ref = _one_row_linear(1024, 768, seed=1)
    with torch.no_grad():
        lin(x)  # moves the weight into its [in, out] storage: one copy, once
        y, largest = _largest_tensor_made(lambda: lin(x))
    assert 0 < largest <= 2 * 1024
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_decoded_model_saves_and_loads_its_weights_unchanged(tmp_path, monkeypatch):
    """After decode steps have moved the one-row weights into [in, out] storages, save_pretrained writes the
    checkpoint's layout and values, and the reloaded model decodes the same logits."""
    monkeypatch.setattr(mk, "_ROW_MIN_NUMEL", 0)  # the tiny model's weights are below it
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


def test_projections_sharing_an_input_are_read_as_one(monkeypatch):
    """KDA's q, k, v, f_a, b, g (and MLA's, the MLP's) become column blocks of one [in, sum(out)] storage on the
    first decode step; the steps equal the float64 model's, a member called alone still computes its own product,
    and a replaced weight is seen at the next step (the storage is rebuilt around it)."""
    monkeypatch.setattr(mk, "_ROW_MIN_NUMEL", 0)  # the tiny model's weights are below it
    model = tiny_model(seed=5)
    reference = tiny_model(seed=5).double()
    ids = torch.tensor([[7, 2, 11, 4]])

    with torch.no_grad():
        out, ref = model(input_ids=ids[:, :2], use_cache=True), reference(input_ids=ids[:, :2], use_cache=True)
        for t in range(2, 4):
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, cache=out.cache)
            ref = reference(input_ids=ids[:, t:t + 1], use_cache=True, cache=ref.cache)
            torch.testing.assert_close(out.logits.double(), ref.logits, rtol=1e-4, atol=1e-4)
    kda = model.model.layers[1].self_attn
    fused = kda._side_by_side
    members = [kda.get_submodule(n).weight for n in kda.x_projections]
    assert mk._blocks_of(fused, members) and fused.shape == (kda.q_proj.in_features, sum(w.shape[0] for w in members))
    groups = [m for m in model.modules() if hasattr(m, "x_projections") or isinstance(m, mk.K3MLP)]
    assert {type(m).__name__ for m in groups} == {"K3KimiDeltaAttention", "K3MLAttention", "K3MLP"}
    assert all("_side_by_side" in m.__dict__ for m in groups)
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
    assert kda._side_by_side is not fused and torch.equal(kda.v_proj.weight, new)


def test_grouped_projections_keep_the_gradient_of_any_member(monkeypatch):
    """With grad enabled, a group whose later member wants a gradient is not read through the bags (which record
    none): that member gets the gradient F.linear gives."""
    monkeypatch.setattr(mk, "_ROW_MIN_NUMEL", 0)
    model = tiny_model(seed=6)
    for p in model.parameters():
        p.requires_grad_(False)
    kda = model.model.layers[1].self_attn
    kda.v_proj.weight.requires_grad_(True)  # not the group's first member
    model(input_ids=torch.tensor([[9]])).logits.sum().backward()
    assert kda.v_proj.weight.grad is not None and kda.v_proj.weight.grad.abs().sum() > 0
    assert "_side_by_side" not in kda.__dict__


@pytest.mark.parametrize("row_min", [0, mk._ROW_MIN_NUMEL])
def test_decode_steps_match_one_forward_at_batch_1(row_min, monkeypatch):
    monkeypatch.setattr(mk, "_ROW_MIN_NUMEL", row_min)  # 0: every one-row linear of the tiny model through bags
    model = tiny_model(seed=3)
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :8], use_cache=True)
        steps = [out.logits]
        for t in range(8, 12):
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, cache=out.cache)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_one_token_short_conv_matches_conv1d():
    model = tiny_model()
    kda = model.model.layers[1].self_attn
    gen = torch.Generator().manual_seed(1)
    C = 3 * kda.num_heads * kda.head_dim
    weight = torch.randn(C, 1, kda.kernel_size, generator=gen)
    x, state = torch.randn(2, 1, C, generator=gen), torch.randn(2, C, kda.kernel_size - 1, generator=gen)
    y, new_state = kda.short_conv(weight, x, state)
    full = torch.cat([state, x.transpose(1, 2)], dim=-1)
    ref = F.silu(F.conv1d(full.double(), weight.double(), groups=C)).transpose(1, 2)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_state, full[..., 1:]) and new_state.is_contiguous()


def test_absorbed_mla_decode_matches_expanded_float64():
    model = tiny_model(seed=1)
    mla = next(layer.self_attn for layer in model.model.layers if layer.attn_type == "mla")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, mla.num_heads, 1, mla.nope_dim + mla.rope_dim, generator=gen)
    latent = torch.randn(2, 96, mla.kv_lora_rank + mla.rope_dim, generator=gen)
    with torch.no_grad():
        got, largest = _largest_tensor_made(lambda: mla.decode_absorbed(q, latent))
        ref = mla.double().attend(q.double(), latent.double(), torch.float64, None)
    assert got.dtype == torch.float32 and got.shape == (2, mla.num_heads, 1, mla.v_dim)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # the latent is read in place by every head, not copied per head (K3, 32k positions: 4.8 GB a layer a step)
    assert largest < mla.num_heads * latent.numel() // 2


def _naive_mla_float64(mla, q, latent, mask):
    """MLA written out in float64: keys and values expanded from the latent, causal + padding mask, rows that
    see no key give 0."""
    B, H, T, _ = q.shape
    S, r = latent.shape[1], mla.kv_lora_rank
    w = mla.kv_b_proj.weight.double().view(H, mla.nope_dim + mla.v_dim, r)
    c_kv, k_pe = latent.double()[..., :r], latent.double()[..., r:]
    out = torch.zeros(B, H, T, mla.v_dim, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            keys = torch.cat([c_kv[b] @ w[h, :mla.nope_dim].T, k_pe[b]], dim=-1)  # [S, qk]
            values = c_kv[b] @ w[h, mla.nope_dim:].T  # [S, v]
            for t in range(T):
                seen = [s for s in range(S) if s <= S - T + t and mask[b, s]]
                if seen:
                    logits = keys[seen] @ q[b, h, t].double() * mla.scaling
                    p = (logits - logits.max()).exp()
                    out[b, h, t] = (p / p.sum()) @ values[seen]
    return out


def test_mla_attends_a_long_prompt_in_query_blocks(monkeypatch):
    """Prefill attention over a cache in blocks of 3 queries (7 queries: 3 blocks, the last short), with a left
    padded row whose first queries see no key: equal to the float64 attention written out, and no score tensor
    has more than 3 query rows."""
    model = tiny_model(seed=2)
    mla = next(layer.self_attn for layer in model.model.layers if layer.attn_type == "mla")
    gen = torch.Generator().manual_seed(4)
    B, T, S = 2, 7, 10
    q = torch.randn(B, mla.num_heads, T, mla.nope_dim + mla.rope_dim, generator=gen)
    latent = torch.randn(B, S, mla.kv_lora_rank + mla.rope_dim, generator=gen)
    mask = torch.ones(B, S, dtype=torch.int64)
    mask[1, :5] = 0  # row 1: padding up to query 1, which sees no key
    ref = _naive_mla_float64(mla, q, latent, mask)
    with torch.no_grad():
        whole = mla.attend(q, latent, torch.float32, mask)
    monkeypatch.setattr(mk, "MLA_QUERY_BLOCK", 3)
    rows = []
    real_matmul = torch.matmul

    def matmul(a, b):
        out = real_matmul(a, b)
        if out.dim() == 4 and out.shape[-1] == S:
            rows.append(out.shape[2])
        return out

    monkeypatch.setattr(torch, "matmul", matmul)
    with torch.no_grad():
        blocked = mla.attend(q, latent, torch.float32, mask)
    assert rows == [3, 3, 1]
    torch.testing.assert_close(blocked.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole.double(), ref, rtol=1e-5, atol=1e-5)
