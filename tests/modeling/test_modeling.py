"""The PyTorch model against independent references: transformers' KimiLinearForCausalLM, a float64
token-by-token recurrence, one-shot forwards, and invariants from the maths."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from k3export.modeling import K3Cache, K3Config, K3ForCausalLM, randomize_weights, save_pretrained, tiny_model
from k3export.modeling.configuration_k3 import K3ConfigError
from k3export.modeling.modeling_k3 import (
    K3CheckpointError,
    kda_chunked,
    kda_recurrent,
    l2norm,
    moe_route,
    situ_glu,
)


def _kda_inputs(B, T, H, K, V, seed=0, bound=-5.0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=gen))
    k = l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    g = bound * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    s0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, s0


# ----------------------------------------------------------------------------- peer parity


def test_kimi_linear_mode_matches_transformers(tmp_path):
    from transformers import KimiLinearForCausalLM

    model = K3ForCausalLM(K3Config.tiny_kimi_linear()).eval()
    randomize_weights(model, seed=3)
    model.save_pretrained(tmp_path)
    # Same files, read by transformers as an original Kimi-Linear checkpoint (its own conversion mapping).
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"])
    cfg.pop("auto_map", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    peer = KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    ids = torch.randint(0, 512, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, use_cache=False).logits
        theirs = peer(ids, use_cache=False).logits
    assert ours.std() > 0.1  # a meaningful comparison, not two near-zero tensors
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    greedy_ours = model.generate(ids[:, :7], max_new_tokens=8, do_sample=False)
    greedy_theirs = peer.generate(ids[:, :7], max_new_tokens=8, do_sample=False)
    assert torch.equal(greedy_ours, greedy_theirs)


# ----------------------------------------------------------------------------- KDA forms


@pytest.mark.parametrize("T", [1, 5, 16, 37, 67])
@pytest.mark.parametrize("chunk", [16, 64])
def test_kda_chunked_equals_recurrence(T, chunk):
    q, k, v, g, beta, s0 = _kda_inputs(2, T, 3, 16, 8, seed=T)
    ref_o, ref_s = kda_recurrent(*(t.double() for t in (q, k, v, g, beta, s0)), 16 ** -0.5)
    o, s = kda_chunked(q, k, v, g, beta, s0, 16 ** -0.5, chunk_size=chunk)
    torch.testing.assert_close(o.double(), ref_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(s.double(), ref_s, atol=1e-5, rtol=0)


def test_kda_recurrence_matches_naive_outer_products():
    """kda_recurrent against a literal per-head loop of the K3.md recurrence, in float64."""
    q, k, v, g, beta, s0 = (t.double() for t in _kda_inputs(1, 6, 2, 4, 3, seed=1))
    S = s0.clone()
    outs = []
    for t in range(6):
        o_t = torch.zeros(2, 3, dtype=torch.float64)
        for h in range(2):
            Sh = torch.exp(g[0, t, h])[:, None] * S[0, h]
            Sh = Sh + beta[0, t, h] * torch.outer(k[0, t, h], v[0, t, h] - k[0, t, h] @ Sh)
            S[0, h] = Sh
            o_t[h] = (q[0, t, h] * 0.5) @ Sh
        outs.append(o_t)
    o, s = kda_recurrent(q, k, v, g, beta, s0, 0.5)
    torch.testing.assert_close(o[0], torch.stack(outs), atol=1e-12, rtol=0)
    torch.testing.assert_close(s, S, atol=1e-12, rtol=0)


def test_kda_chunked_survives_strong_decay():
    """Cumulative decay far below exp(-88) inside a chunk must not overflow (split exponentials)."""
    q, k, v, g, beta, s0 = _kda_inputs(1, 64, 1, 16, 16, seed=2, bound=-20.0)
    o, s = kda_chunked(q, k, v, g, beta, s0, 0.25, chunk_size=64)
    ref_o, ref_s = kda_recurrent(*(t.double() for t in (q, k, v, g, beta, s0)), 0.25)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o.double(), ref_o, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- cache consistency


@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_then_decode_equals_one_forward(tiny_k3, batch):
    P, D = 11, 6
    ids = torch.randint(0, 512, (batch, P + D), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        full = tiny_k3(ids, use_cache=False).logits
        cache = K3Cache(tiny_k3.config)
        steps = [tiny_k3(ids[:, :P], cache=cache).logits]
        for t in range(P, P + D):
            steps.append(tiny_k3(ids[:, t:t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)
    assert cache.get_seq_length() == P + D
    assert set(cache.recurrent_states) == {i for i, t in enumerate(tiny_k3.config.attn_types) if t == "kda"}
    assert all(lat.shape == (batch, P + D, tiny_k3.config.mla_latent_dim) for lat in cache.latents.values())


def test_chunked_prefill_equals_one_shot(tiny_k3):
    ids = torch.randint(0, 512, (2, 29), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        one = K3Cache(tiny_k3.config)
        ref = tiny_k3(ids, cache=one).logits
        split = K3Cache(tiny_k3.config)
        parts = [tiny_k3(ids[:, a:b], cache=split).logits for a, b in ((0, 3), (3, 20), (20, 21), (21, 29))]
    torch.testing.assert_close(torch.cat(parts, 1), ref, atol=1e-4, rtol=0)
    # fp32 rounding differs with the split: the grouped expert GEMMs see other row counts per call
    for i in one.recurrent_states:
        torch.testing.assert_close(split.recurrent_states[i], one.recurrent_states[i], atol=3e-5, rtol=0)
        torch.testing.assert_close(split.conv_states[i], one.conv_states[i], atol=3e-5, rtol=0)
    for i in one.latents:
        torch.testing.assert_close(split.latents[i], one.latents[i], atol=3e-5, rtol=0)


def test_generate_greedy_matches_manual_loop_and_sampling_runs(tiny_k3):
    ids = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(1))
    out = tiny_k3.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = tiny_k3(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)
    torch.manual_seed(0)
    sampled = tiny_k3.generate(ids, max_new_tokens=4, do_sample=True, top_k=20, eos_token_id=None, pad_token_id=0)
    assert sampled.shape == (2, 9) and torch.equal(sampled[:, :5], ids)


# ----------------------------------------------------------------------------- invariants


def test_zero_pseudo_queries_reduce_to_plain_prenorm_residual():
    # eps -> 0 so that RMSNorm is exactly scale-invariant; the invariant is about the maths, not the eps.
    res = K3ForCausalLM(K3Config.tiny(rms_norm_eps=1e-12)).eval()
    randomize_weights(res, seed=5)
    with_queries = copy.deepcopy(res)
    with torch.no_grad():
        for name, p in res.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.zero_()
    plain = K3ForCausalLM(K3Config.tiny(rms_norm_eps=1e-12, attn_res_block_size=0)).eval()
    missing, unexpected = plain.load_state_dict(res.state_dict(), strict=False)
    assert missing == [] and unexpected and all("_res_" in k for k in unexpected)

    def normed_inputs(model):
        seen = []
        hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(out))
                 for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
        for h in hooks:
            h.remove()
        return seen, logits

    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    # With w = 0 every aggregate is the mean of its sources, i.e. the plain residual sum divided by the
    # number of sources; RMSNorm removes the scale, so each sublayer sees the plain pre-norm input.
    (ours, a), (theirs, b) = normed_inputs(res), normed_inputs(plain)
    assert len(ours) == len(theirs) == 2 * res.config.num_hidden_layers
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    with torch.no_grad():
        full = with_queries(ids, use_cache=False).logits
    assert (full - b).abs().max() > 1e-2  # with the real pseudo-queries AttnRes does change the result


def test_correction_bias_changes_choice_not_weights():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 16, generator=gen)
    bias = torch.zeros(16)
    bias[5] = 10.0  # force expert 5 into every selection
    w0, i0 = moe_route(logits, torch.zeros(16), 4, True, 2.5)
    w1, i1 = moe_route(logits, bias, 4, True, 2.5)
    assert (i1 == 5).any(-1).all() and not (i0 == 5).any(-1).all()
    scores = torch.sigmoid(logits.double())
    for w, i in ((w0, i0), (w1, i1)):
        picked = scores.gather(-1, i)
        torch.testing.assert_close(w.double(), 2.5 * picked / picked.sum(-1, keepdim=True), atol=1e-6, rtol=0)


def test_router_ties_prefer_lower_index():
    logits = torch.zeros(1, 8)
    w, i = moe_route(logits, torch.zeros(8), 3, False, 1.0)
    assert i.tolist() == [[0, 1, 2]] and torch.allclose(w, torch.full((1, 3), 0.5))


def test_situ_glu_bounded_and_exact():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(4096, generator=gen) * 300
    u = torch.randn(4096, generator=gen) * 300
    out = situ_glu(g, u, 4.0, 25.0)
    assert out.abs().max() <= 100.0
    ref = 4 * torch.tanh(g.double() / 4) * torch.sigmoid(g.double()) * 25 * torch.tanh(u.double() / 25)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)
    assert out.abs().max() > 99.0  # the bound is reached, so the test can tell a wrong cap


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip_is_bit_exact(tiny_k3, tmp_path):
    save_pretrained(tiny_k3, tmp_path, max_shard_size="300KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    a, b = tiny_k3.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_trust_remote_code_load_without_k3export(tiny_k3, tmp_path):
    save_pretrained(tiny_k3, tmp_path)
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(4))
    from k3export.ops import use_backend

    # a fresh load, as the subprocess makes: the session's tiny_k3 may hold its experts restacked by an earlier
    # kernel test, and that layout sums in another fp32 order (a few 1e-6 apart)
    with torch.no_grad(), use_backend("torch"):  # the PyTorch functions, as the saved file runs them (no kernels)
        expected = K3ForCausalLM.from_pretrained(tmp_path)(ids, use_cache=False).logits
    torch.save({"ids": ids, "logits": expected}, tmp_path.parent / "expected.pt")
    script = f"""
import sys
sys.modules["k3export"] = None  # make `import k3export` fail: the saved folder must be self-sufficient
import torch
from transformers import AutoModelForCausalLM
torch.set_num_threads({torch.get_num_threads()})  # the same GEMM blocking as the reference run
m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()
assert type(m).__module__.startswith("transformers_modules"), type(m).__module__
e = torch.load({str(tmp_path.parent / 'expected.pt')!r})
with torch.no_grad():
    got = m(e["ids"], use_cache=False).logits
print(float((got - e["logits"]).abs().max()))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "HF_MODULES_CACHE": str(tmp_path.parent / "modules")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) == 0.0


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(linear_attn_config=dict(full_attn_layers=[3], kda_layers=[1, 2, 4, 5])), "neither"),
        (dict(linear_attn_config=dict(full_attn_layers=[0, 3], kda_layers=[1, 2, 4, 5, 6])), "1-based"),
        (dict(linear_attn_config=dict(full_attn_layers=[3, 6], kda_layers=[1, 2, 3, 4, 5])), "both"),
        (dict(num_experts_per_token=9), "num_experts_per_token"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(latent_moe_use_norm=True, routed_expert_hidden_size=None), "latent_moe_use_norm"),
        (dict(linear_attn_config=dict(gate_lower_bound=2.0)), "gate_lower_bound"),
        (dict(first_k_dense_replace=9), "first_k_dense_replace"),
        (dict(num_expert_group=4), "grouped routing"),
        (dict(hidden_size=0), "hidden_size"),
    ],
)
def test_inconsistent_configs_name_the_field(overrides, field):
    if "linear_attn_config" in overrides:
        base = K3Config.tiny().linear_attn_config
        overrides = dict(linear_attn_config={**base, **overrides["linear_attn_config"]})
    with pytest.raises(K3ConfigError, match=field):
        K3Config.tiny(**overrides)


def test_released_text_config_loads_as_is():
    full = K3Config.k3()
    released = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                "text_config": {**full.to_dict(), "model_type": "kimi_linear"}, "vision_config": {"hidden_size": 1}}
    cfg = K3Config.from_released_dict(json.loads(json.dumps(released)))
    assert cfg.attn_types == full.attn_types and cfg.num_experts == 896 and cfg.hidden_act == "situ"
    with pytest.raises(K3ConfigError, match="model_type 'llama'"):
        K3Config.from_released_dict({"model_type": "llama"})


@pytest.mark.parametrize("damage", ["missing", "shape"])
def test_checkpoint_tensor_errors_name_the_tensor(tiny_k3, tmp_path, damage):
    from safetensors.torch import load_file, save_file

    save_pretrained(tiny_k3, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    if damage == "missing":
        tensors.pop(name)
        expected = f"missing tensor '{name}'"
    else:
        tensors[name] = tensors[name][:, :-1].contiguous()
        expected = f"tensor '{name}' has shape"
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(K3CheckpointError, match=expected):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_pickle_weights_are_never_loaded(tiny_k3, tmp_path):
    save_pretrained(tiny_k3, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(tiny_k3.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(K3CheckpointError, match="safetensors only"):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_left_padded_batch_generates_like_single_prompts(tiny_k3):
    a = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    b = torch.randint(3, 512, (1, 5), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    batched = tiny_k3.generate(ids, attention_mask=mask, **kw)[:, -5:]
    single = torch.cat([tiny_k3.generate(p, **kw)[:, -5:] for p in (a, b)], 0)
    assert torch.equal(batched, single)


@pytest.mark.parametrize("field, value", [("num_experts", 10**6), ("hidden_size", 10**5), ("num_hidden_layers", 4000)])
def test_config_bomb_in_our_layout_is_refused_before_allocation(tiny_k3, tmp_path, field, value):
    import time

    save_pretrained(tiny_k3, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    if field == "num_hidden_layers":
        cfg["linear_attn_config"]["kda_layers"] = [i for i in range(1, value + 1) if i % 4]
        cfg["linear_attn_config"]["full_attn_layers"] = [i for i in range(1, value + 1) if i % 4 == 0]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    with pytest.raises(K3CheckpointError, match=f"config.json: the config needs at least .*{field}={value}"):
        K3ForCausalLM.from_pretrained(tmp_path)
    assert time.perf_counter() - t0 < 5.0


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(K3CheckpointError, match="no readable config.json"):
        K3ForCausalLM.from_pretrained(tmp_path)


class _NarrowFloats(torch.overrides.TorchFunctionMode):
    """Records every op that returns a floating tensor narrower than float64."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.narrow.append(f"{getattr(func, '__name__', func)} -> {t.dtype}")
        return out


def test_a_float64_model_computes_prefill_and_decode_in_float64():
    """`model.double()` is a float64 reference (bench/peers.py breaks near-tie greedy choices with it): no op
    rounds to fp32 on the way, and its logits are the fp32 model's up to fp32 rounding."""
    model = tiny_model(seed=3)
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=True)
        ref_step = model(input_ids=ids[:, :1], cache=ref.cache, use_cache=True)
        model.double()
        with _NarrowFloats() as mode:
            out = model(input_ids=ids, use_cache=True)
            step = model(input_ids=ids[:, :1], cache=out.cache, use_cache=True)
    assert mode.narrow == []
    assert step.logits.dtype == torch.float64
    torch.testing.assert_close(out.logits, ref.logits.double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step.logits, ref_step.logits.double(), rtol=1e-4, atol=1e-4)
