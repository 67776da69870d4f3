import json

import numpy as np
import pytest

from k3export.errors import K3ExportError
from k3export.runtime import ManifestError, OrtRunner, StateManifest, TorchRunner, to_numpy


def test_manifest_from_config_names_shapes(tiny):
    m = StateManifest.from_config(tiny.config)
    c = tiny.config
    assert m.attn_types == ["kda", "kda", "mla", "kda", "kda", "mla"]
    names = m.names()
    assert names[:4] == [f"past_key_values.0.{k}" for k in ("conv_state_q", "conv_state_k", "conv_state_v",
                                                           "recurrent_state")]
    assert "past_key_values.2.latent" in names and "past_key_values.2.recurrent_state" not in names
    e = m.by_name()
    hk = c.kda_num_heads * c.kda_head_dim
    assert e["past_key_values.0.conv_state_q"].concrete_shape(3) == (3, hk, c.kda_conv_kernel - 1)
    assert e["past_key_values.0.recurrent_state"].dtype == "float32"
    assert e["past_key_values.5.latent"].concrete_shape(2, 7) == (2, 7, c.kv_lora_rank + c.qk_rope_head_dim)
    assert e["past_key_values.5.latent"].present == "present.5.latent"
    init = m.initial_state(2)
    assert init["past_key_values.5.latent"].shape == (2, 0, c.mla_latent_dim)
    assert all(not v.any() for v in init.values())


def test_torch_state_roundtrips_through_cache(reference):
    ids = np.random.default_rng(1).integers(0, 512, (2, 5))
    out = reference.prefill(ids)
    assert set(out.state) == set(reference.manifest.names())
    again = reference.from_cache(reference.to_cache(out.state))
    for name, t in out.state.items():
        assert np.array_equal(to_numpy(t), to_numpy(again[name])), name
    # chunking through the manifest state equals one shot
    a = reference.prefill(ids[:, :2])
    b = reference.prefill(ids[:, 2:], a.state)
    np.testing.assert_allclose(to_numpy(b.logits), to_numpy(out.logits)[:, 2:], rtol=0, atol=1e-4)


def test_export_manifest_matches_torch_names(onnx_dir, reference):
    m = StateManifest.load(onnx_dir)
    m.check_compatible(reference.manifest)
    assert m.attn_types == reference.manifest.attn_types
    assert m.by_name()["past_key_values.0.conv_state_k"].kind == "conv_state_k"
    assert m.dtype == "float32"


def test_manifest_tolerant_spellings_and_errors(tmp_path):
    data = {"states": [
        {"name": "past_key_values.0.conv_state", "kind": "conv", "component": "v", "shape": ["batch", 8, 3],
         "dtype": "fp32", "initial_value": "zeros", "present_name": "out.0.v"},
        {"name": "past_key_values.1.latent", "shape": ["batch", "past_len", 6], "dtype": "bf16", "init": "empty"},
    ], "inputs": [{"name": "input_ids"}], "outputs": [{"name": "logits"}]}
    m = StateManifest.from_dict(data)
    e = m.by_name()
    assert e["past_key_values.0.conv_state"].kind == "conv_state_v"
    assert e["past_key_values.0.conv_state"].present == "out.0.v"
    assert e["past_key_values.1.latent"].attn_type == "mla" and e["past_key_values.1.latent"].layer == 1
    assert e["past_key_values.1.latent"].present == "present.1.latent"
    with pytest.raises(ManifestError, match="initial value"):
        StateManifest.from_dict({"states": [dict(data["states"][1], init="ones")]})
    with pytest.raises(ManifestError, match="no 'states'"):
        StateManifest.from_dict({"states": []})
    with pytest.raises(ManifestError, match="no state manifest"):
        StateManifest.load(tmp_path)
    (tmp_path / "state_manifest.json").write_text("{broken")
    with pytest.raises(K3ExportError, match="not valid JSON"):
        StateManifest.load(tmp_path)
    other = StateManifest.from_dict({"states": [dict(data["states"][0], shape=["batch", 9, 3])]})
    mine = StateManifest.from_dict({"states": [data["states"][0]]})
    with pytest.raises(ManifestError, match=r"shape \['batch', 9, 3\]"):
        other.check_compatible(mine)


def test_ort_runner_rejects_manifest_naming_missing_input(onnx_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(onnx_dir, bad)
    man = json.loads((bad / "state_manifest.json").read_text())
    man["states"][0]["name"] = "past_key_values.0.no_such_state"
    (bad / "state_manifest.json").write_text(json.dumps(man))
    with pytest.raises(ManifestError, match="no_such_state"):
        OrtRunner(bad)


def test_ort_runner_runs_and_matches_prefill(onnx_dir, reference):
    ort = OrtRunner(onnx_dir)
    ids = np.random.default_rng(2).integers(0, 512, (1, 6))
    a, b = reference.prefill(ids), ort.prefill(ids)
    assert b.logits.shape == tuple(a.logits.shape)
    np.testing.assert_allclose(b.logits, to_numpy(a.logits), atol=1e-3, rtol=0)
    step = ort.step(np.array([5]), b.state)
    assert step.state["past_key_values.2.latent"].shape[1] == 7


def test_torch_runner_from_pretrained(model_dir, reference):
    r = TorchRunner.from_pretrained(model_dir)
    ids = np.array([[4, 5, 6]])
    np.testing.assert_array_equal(to_numpy(r.prefill(ids).logits), to_numpy(reference.prefill(ids).logits))
