"""Every config.json layout users have loads (ours, the released K3, the Hub's remote-code Kimi-Linear, the folder
transformers' own KimiLinearForCausalLM.save_pretrained writes); redundant keys are checked, not rejected; every
field is present, typed, finite and in range before anything is allocated; config.json is read once per load."""

from __future__ import annotations

import copy
import json
import math
import time

import pytest
import torch

from k3export.converters.checkpoints import plan as plan_module
from k3export.converters.checkpoints.synthetic import write_checkpoint
from k3export.errors import CheckpointError
from k3export.modeling import K3Config, K3ForCausalLM, randomize_weights
from k3export.modeling.configuration_k3 import K3ConfigError

# config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct (remote code): note the legacy head_dim = 2304 // 32
HUB_KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                 "AutoModel": "modeling_kimi.KimiLinearModel",
                 "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
    "bos_token_id": 163584, "dtype": "bfloat16", "eos_token_id": 163586, "first_k_dense_replace": 1,
    "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32, "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear", "moe_intermediate_size": 1024,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32, "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8,
    "num_hidden_layers": 27, "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1,
    "pad_token_id": 163839, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False, "topk_group": 1, "transformers_version": "4.56.2", "use_cache": True,
    "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
}


def _transformers_config(**overrides):
    from transformers import KimiLinearConfig

    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                  linear_head_dim=16, linear_num_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    kwargs.update(overrides)
    return KimiLinearConfig(**kwargs)


def _transformers_dict(**overrides) -> dict:
    return json.loads(_transformers_config(**overrides).to_json_string())


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with a trained model's statistics (activations O(1)), whatever the module layout."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                value = torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                value = -3.0 + 0.5 * r
            elif name.endswith("e_score_correction_bias"):
                value = 0.1 * r
            elif "norm" in name:
                value = 1.0 + 0.1 * r
            elif "conv1d" in name:
                value = 0.5 * r
            elif "embed_tokens" in name:
                value = r
            else:
                value = r / math.sqrt(p.shape[-1])
            p.copy_(value)


# ----------------------------------------------------------------------------- transformers' own folder


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_transformers_saved_kimi_linear_loads_and_matches(tmp_path, q_lora_rank):
    from transformers import KimiLinearForCausalLM

    peer = KimiLinearForCausalLM(_transformers_config(q_lora_rank=q_lora_rank)).float().eval()
    _randomize(peer, seed=11)
    peer.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    # the keys that used to break loading ("property 'qk_head_dim' of 'K3Config' object has no setter")
    assert {"qk_head_dim", "head_dim", "layer_types", "mlp_layer_types", "linear_head_dim"} <= set(saved)
    assert "linear_attn_config" not in saved and "first_k_dense_replace" not in saved

    model = K3ForCausalLM.from_pretrained(tmp_path)
    assert model.config.attn_types == ["kda", "mla", "kda", "mla"]
    assert model.config.mlp_types == ["dense", "moe", "moe", "moe"] and model.config.num_experts == 8

    ids = torch.randint(0, 512, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, use_cache=False).logits
        theirs = peer(ids, use_cache=False).logits
    assert ours.std() > 0.1  # a meaningful comparison, not two near-zero tensors
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    prompt = ids[:, :5]
    greedy_ours = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    greedy_theirs = peer.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert greedy_ours.shape == (2, 21)
    assert torch.equal(greedy_ours, greedy_theirs)


def test_transformers_config_folds_into_ours():
    cfg = K3Config.from_released_dict(_transformers_dict())
    assert cfg.linear_attn_config["full_attn_layers"] == [2, 4] and cfg.linear_attn_config["kda_layers"] == [1, 3]
    assert cfg.linear_attn_config["num_heads"] == 4 and cfg.first_k_dense_replace == 1
    assert cfg.num_experts_per_token == 2 and cfg.mla_use_nope
    saved = cfg.to_dict()  # folded away: our config.json carries the primary fields only
    assert not {"qk_head_dim", "head_dim", "layer_types", "mlp_layer_types", "linear_head_dim"} & set(saved)
    # the same keys as Python keyword arguments
    again = K3Config.tiny_kimi_linear(qk_head_dim=24, head_dim=8, linear_num_heads=4,
                                      layer_types=["linear_attention", "full_attention"] * 2,
                                      mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    assert again.attn_types == cfg.attn_types


# ----------------------------------------------------------------------------- the Hub's remote-code layout


def test_hub_remote_code_config_loads():
    cfg = K3Config.from_released_dict(copy.deepcopy(HUB_KIMI_LINEAR))
    assert cfg.num_hidden_layers == 27 and cfg.attn_types.count("mla") == 7 and cfg.attn_types[26] == "mla"
    assert cfg.num_experts == 256 and cfg.moe_intermediate_size == 1024 and cfg.first_k_dense_replace == 1
    assert cfg.kda_head_dim == 128 and cfg.linear_attn_config["gate_lower_bound"] is None
    assert not cfg.linear_attn_config["use_full_rank_gate"] and cfg.q_lora_rank is None
    dropped = {"head_dim", "rope_theta", "moe_layer_freq", "use_grouped_topk", "num_key_value_heads", "auto_map"}
    assert not dropped & set(cfg.to_dict())


def test_hub_remote_code_folder_loads(tmp_path):
    model = K3ForCausalLM(K3Config.tiny_kimi_linear()).eval()
    randomize_weights(model, seed=5)
    model.save_pretrained(tmp_path)
    c = model.config
    hub = copy.deepcopy(HUB_KIMI_LINEAR)
    hub.update({k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                                            "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
                                            "num_shared_experts", "moe_intermediate_size", "bos_token_id",
                                            "eos_token_id", "pad_token_id")})
    hub.update(head_dim=c.hidden_size // c.num_attention_heads, dtype="float32",
               linear_attn_config={k: c.linear_attn_config[k] for k in ("full_attn_layers", "head_dim", "kda_layers",
                                                                        "num_heads", "short_conv_kernel_size")})
    (tmp_path / "config.json").write_text(json.dumps(hub))
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


# ----------------------------------------------------------------------------- redundant keys: checked, not rejected


@pytest.mark.parametrize(
    "edit, fields",
    [
        (dict(qk_head_dim=25), ("qk_head_dim", "qk_nope_head_dim + qk_rope_head_dim")),
        (dict(head_dim=7), ("head_dim", "qk_rope_head_dim")),
        (dict(num_local_experts=6), ("num_local_experts", "num_experts")),
        (dict(linear_attn_config={"num_heads": 2}), ("linear_num_heads", "linear_attn_config.num_heads")),
        (dict(linear_attn_config={"full_attn_layers": [4]}), ("layer_types", "linear_attn_config.full_attn_layers")),
        (dict(first_k_dense_replace=2), ("mlp_layer_types", "first_k_dense_replace")),
        (dict(num_hidden_layers=5), ("layer_types", "num_hidden_layers")),
    ],
)
def test_inconsistent_redundant_keys_name_both_fields(edit, fields):
    d = _transformers_dict()
    d.update(edit)
    with pytest.raises(K3ConfigError) as err:
        K3Config.from_released_dict(d)
    for field in fields:
        assert field in str(err.value), str(err.value)


def test_consistent_redundant_keys_are_accepted():
    d = _transformers_dict()
    d.update(num_local_experts=8, first_k_dense_replace=1, linear_attn_config={"num_heads": 4, "kda_layers": [1, 3]})
    assert K3Config.from_released_dict(d).attn_types == ["kda", "mla", "kda", "mla"]
    with pytest.raises(K3ConfigError, match="qk_head_dim"):
        K3Config.tiny(qk_head_dim=99)
    with pytest.raises(K3ConfigError, match="mla_latent_dim"):  # any derived view of ours is checked the same way
        K3Config.tiny(mla_latent_dim=1)


# ----------------------------------------------------------------------------- sanity before allocation


@pytest.mark.parametrize("layout", ["hub", "transformers", "released"])
@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "rms_norm_eps"])
def test_missing_required_field_is_named(layout, field):
    if layout == "hub":
        config = copy.deepcopy(HUB_KIMI_LINEAR)
        config.pop(field)
    elif layout == "transformers":
        config = _transformers_dict()
        config.pop(field)
    else:
        text = {**K3Config.tiny().to_dict(), "model_type": "kimi_linear"}
        text.pop(field)
        config = {"model_type": "kimi_k3", "text_config": text}
    with pytest.raises(K3ConfigError, match=f"{field} is missing"):
        K3Config.from_released_dict(config)


def test_presets_and_our_layout_keep_defaults():
    assert K3Config().hidden_size == 2304
    assert K3Config.from_released_dict({"model_type": "k3"}).num_experts == K3Config().num_experts


@pytest.mark.parametrize(
    "edit, phrase",
    [
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number"),
        (dict(rms_norm_eps=float("inf")), "rms_norm_eps must be a finite number"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps must be > 0"),
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a finite number"),
        (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
        (dict(num_experts=True), "num_experts must be an integer, got bool"),
        (dict(hidden_size="2304"), "hidden_size must be an integer, got str"),
        (dict(num_experts=1e10), "num_experts must be an integer, got float"),
        (dict(num_experts=10**10), "num_experts must be in 1..2147483647"),
        (dict(num_hidden_layers=10**9), "num_hidden_layers must be in 1..4096"),
        (dict(num_attention_heads=0), "num_attention_heads must be in 1.."),
        (dict(mla_use_nope=1), "mla_use_nope must be true or false"),
        (dict(linear_attn_config={**HUB_KIMI_LINEAR["linear_attn_config"], "num_heads": 2.0}),
         "linear_attn_config.num_heads must be an integer"),
        (dict(linear_attn_config={**HUB_KIMI_LINEAR["linear_attn_config"], "kda_layers": [True]}),
         "linear_attn_config.kda_layers must be a list of integer"),
        (dict(linear_attn_config=[1, 2]), "linear_attn_config must be an object"),
        (dict(moe_layer_freq=2), "moe_layer_freq=1"),
        (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers=0"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(edit, phrase):
    config = copy.deepcopy(HUB_KIMI_LINEAR)
    config.update(edit)
    with pytest.raises(K3ConfigError, match=phrase):
        K3Config.from_released_dict(config)


def test_nan_eps_in_a_python_config_is_refused():
    with pytest.raises(K3ConfigError, match="rms_norm_eps"):
        K3Config.tiny(rms_norm_eps=float("nan"))


def _kimi_linear_folder(tmp_path, **edit):
    src = write_checkpoint(tmp_path / "kl", layout="kimi_linear", num_shards=2)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(edit)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize(
    "edit, phrase",
    [
        (dict(num_experts=10**6), "refusing before allocating anything"),
        (dict(num_experts=10**9, moe_intermediate_size=10**6), "refusing before allocating anything"),
        (dict(num_experts=1e10), "num_experts must be an integer"),
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number"),
    ],
)
def test_bombs_and_bad_configs_are_refused_in_milliseconds(tmp_path, edit, phrase):
    src = _kimi_linear_folder(tmp_path, **edit)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=phrase) as err:
        K3ForCausalLM.from_pretrained(src)
    assert time.perf_counter() - start < 2.0
    assert "\n" not in str(err.value)
    if "allocating" in phrase:
        assert "num_experts=" in str(err.value) and "config.json" in str(err.value)


def test_config_json_is_read_once_per_load(tmp_path, monkeypatch):
    src = _kimi_linear_folder(tmp_path)

    def no_second_read(*args, **kwargs):
        raise AssertionError("config.json read again")

    monkeypatch.setattr(plan_module, "read_config_json", no_second_read)
    monkeypatch.setattr("k3export.converters.checkpoints.loader.read_config_json", no_second_read)
    model = K3ForCausalLM.from_pretrained(src)
    assert model.config.attn_types == K3Config.tiny_kimi_linear().attn_types


# ----------------------------------------------------------------------------- a retired option


def test_old_config_with_ops_backend_loads(tmp_path):
    old = {**K3Config.tiny().to_dict(), "ops_backend": "triton"}
    for cfg in (K3Config.from_dict(old), K3Config.from_released_dict(old), K3Config(**old)):
        assert "ops_backend" not in cfg.to_dict() and cfg.num_experts == 8
    model = K3ForCausalLM(K3Config.tiny()).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "ops_backend" not in saved
    (tmp_path / "config.json").write_text(json.dumps({**saved, "ops_backend": "auto"}))
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    assert "ops_backend" not in loaded.config.to_dict()
