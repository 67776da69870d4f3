"""The contract (k3export.modeling.contract) is the single source of state and parameter facts: the model's cache,
the exported graph, the manifest and `info` all agree with it, and a state added to it appears in all of them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from onnx import TensorProto

from k3export.converters.onnx.graph import K3GraphBuilder
from k3export.dtypes import dtype
from k3export.info import count_parameters, decode_state_bytes
from k3export.modeling import K3Cache, K3Config, K3ForCausalLM, contract, randomize_weights

CONFIGS = {
    "tiny": lambda: K3Config.tiny(),
    "kimi_linear": lambda: K3Config.tiny_kimi_linear(),
    "conv1": lambda: K3Config.tiny(linear_attn_config=dict(K3Config.tiny().linear_attn_config, short_conv_kernel_size=2)),
    "conv3_odd_latent": lambda: K3Config.tiny(kv_lora_rank=31),
}


def _graph_io(config: K3Config, act: str = "float32") -> tuple[dict, dict]:
    b = K3GraphBuilder(config, act)
    b.build()

    def dims(vi):
        return tuple(d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim)

    ins = {vi.name: (dims(vi), vi.type.tensor_type.elem_type) for vi in b.inputs}
    outs = {vi.name: (dims(vi), vi.type.tensor_type.elem_type) for vi in b.outputs}
    return ins, outs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cache_graph_and_info_follow_the_contract(name):
    config = CONFIGS[name]()
    specs = contract.state_specs(config)
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    randomize_weights(model, 0)
    assert {s.name: s.shape for s in contract.param_specs(config)} == \
        {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert count_parameters(config).total == sum(p.numel() for p in model.parameters())

    B, T = 2, 5
    with torch.no_grad():
        cache = model(torch.randint(0, config.vocab_size, (B, T)), use_cache=True).cache
    states = cache.to_states()
    assert list(states) == [s.name for s in specs]
    for s in specs:
        assert tuple(states[s.name].shape) == s.concrete_shape(B, T), s.name
        assert states[s.name].dtype == dtype(s.resolved_dtype("float32")).torch, s.name

    ins, outs = _graph_io(config)
    for s in specs:
        elem = dtype(s.resolved_dtype("float32")).onnx
        assert ins[s.name] == (s.shape, elem), s.name
        assert outs[s.present] == (s.present_shape, elem), s.present
    state_inputs = [n for n in ins if n.startswith("past_key_values.")]
    assert state_inputs == [s.name for s in specs]

    stored = sum(int(np.prod(s.concrete_shape(B, T))) * dtype(s.resolved_dtype("float32")).itemsize for s in specs)
    assert decode_state_bytes(config, context=T, batch=B, dtype="fp32").per_sequence == stored


def test_k3_preset_graph_follows_the_contract():
    config = K3Config.k3()
    ins, outs = _graph_io(config, "bfloat16")
    specs = contract.state_specs(config)
    assert [n for n in ins if n.startswith("past_key_values.")] == [s.name for s in specs]
    assert all(ins[s.name][0] == s.shape and outs[s.present][0] == s.present_shape for s in specs)
    assert ins[specs[1].name][1] == TensorProto.FLOAT  # the KDA recurrent state stays fp32 in a bf16 export
    state = decode_state_bytes(config, context=131072)
    assert state.per_token == 24 * 576 * 2  # the MLA latent, bf16: the point of MLA


def test_a_state_added_to_the_contract_appears_everywhere(monkeypatch):
    config = K3Config.tiny()
    base = contract.layer_state_specs
    extra_bytes = 7 * 4

    def with_extra(cfg, layer):
        return base(cfg, layer) + [contract.StateSpec(layer, "extra_state", "recurrent", (contract.BATCH, 7), "float32")]

    monkeypatch.setattr(contract, "layer_state_specs", with_extra)
    names = [f"past_key_values.{i}.extra_state" for i in range(config.num_hidden_layers)]
    ins, outs = _graph_io(config)
    assert all(n in ins and n.replace("past_key_values.", "present.") in outs for n in names)
    model = K3ForCausalLM(config).eval()
    with torch.no_grad():
        states = model(torch.zeros(1, 3, dtype=torch.long), use_cache=True).cache.to_states()
    assert all(tuple(states[n].shape) == (1, 7) for n in names)
    monkeypatch.setattr(contract, "layer_state_specs", base)
    before = decode_state_bytes(config, context=3).constant
    monkeypatch.setattr(contract, "layer_state_specs", with_extra)
    assert decode_state_bytes(config, context=3).constant == before + config.num_hidden_layers * extra_bytes


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_decode_resumed_from_the_named_states_matches_one_forward(name):
    """`K3Cache.to_states` -> `from_states` (the contract's mapping, as every runner hands state over) loses
    nothing: the next token's logits equal a cache-free forward over every token, and the states round-trip exactly."""
    config = CONFIGS[name]()
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    randomize_weights(model, 0)
    ids = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        states = model(ids[:, :5], use_cache=True).cache.to_states()
        cache = K3Cache.from_states(config, states)
        assert cache.get_seq_length() == 5
        again = cache.to_states()
        assert again.keys() == states.keys() and all(torch.equal(again[n], states[n]) for n in states)
        resumed = model(ids[:, 5:], cache=cache, use_cache=True).logits[:, -1]
        full = model(ids, use_cache=False).logits[:, -1]
    torch.testing.assert_close(resumed, full, rtol=1e-4, atol=1e-4)
