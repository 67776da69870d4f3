"""The batch-1 decode paths of the modeling file (the one-token short conv, MLA's absorbed decode and its query
blocks, decode steps with and without kernels) against float64 references and the paths that prefill takes.
The kernels' own decode reads are tested in tests/ops (test_cpu.py, test_cpu_bags.py, test_expert_stacks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3export.modeling import modeling_k3 as mk
from k3export.modeling import tiny_model


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


@pytest.mark.parametrize("kernels", ["none", "plugged", "plugged, every linear"])
def test_decode_steps_match_one_forward_at_batch_1(kernels, monkeypatch):
    """Prefill then one-token steps give the logits of one forward over the whole sequence: in plain PyTorch, and
    with k3export's kernels plugged in (on CPU: the C++ kernels, the bags of `cpu_bags`, the expert stacks)."""
    monkeypatch.setattr(mk, "_KERNELS", {})  # whatever an earlier test plugged in
    if kernels != "none":
        from k3export.ops import KERNELS, cpu_bags

        for name, kernel in KERNELS.items():
            monkeypatch.setitem(mk._KERNELS, name, kernel)
        if kernels.endswith("every linear"):
            monkeypatch.setattr(cpu_bags, "ROW_MIN_NUMEL", 0)  # the tiny model's weights are below it
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
    y, new_state = mk.short_conv(weight, x, state)
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
