"""`k3export tiny` and `k3export info` through the real Typer app."""

from __future__ import annotations

import re

import torch
from typer.testing import CliRunner

from k3export.info import count_parameters, decode_state_bytes
from k3export.modeling import K3Cache, K3Config, K3ForCausalLM
from k3export_cli.main import app

runner = CliRunner()


def test_tiny_writes_a_loadable_checkpoint_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "tiny"
    res = runner.invoke(app, ["tiny", str(out), "--seed", "3"])
    assert res.exit_code == 0, res.output
    model = K3ForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]]), use_cache=False).logits
    assert 0.1 < logits.std() < 10  # activations O(1)
    again = runner.invoke(app, ["tiny", str(out)])
    assert again.exit_code == 2 and "not empty" in again.output
    assert not list(tmp_path.glob(".tiny.partial-*"))


def test_info_counts_match_a_real_model(tmp_path):
    for config in (K3Config.tiny(), K3Config.tiny_kimi_linear()):
        model = K3ForCausalLM(config)
        counts = count_parameters(config)
        assert counts.total == sum(p.numel() for p in model.parameters())
        per_expert = sum(p.numel() for p in model.model.layers[1].block_sparse_moe.experts[0].parameters())
        n_moe = config.mlp_types.count("moe")
        assert counts.total - counts.active == n_moe * per_expert * (config.num_experts - config.num_experts_per_token)


def test_state_bytes_match_a_real_cache(tiny_k3):
    cache = K3Cache(tiny_k3.config)
    with torch.no_grad():
        tiny_k3(torch.randint(0, 512, (2, 13)), cache=cache)
    expected = decode_state_bytes(tiny_k3.config, context=13, batch=2, dtype="fp32")
    assert cache.bytes() == expected.per_sequence


def test_info_on_the_released_config():
    res = runner.invoke(app, ["info", "k3", "--context", "131072"])
    assert res.exit_code == 0, res.output
    assert re.search(r"total\s+│\s+2\.78T", res.output) and "93 layers" in res.output


def test_info_bad_input(tmp_path):
    res = runner.invoke(app, ["info", str(tmp_path)])
    assert res.exit_code == 2 and "no config.json" in res.output
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    res = runner.invoke(app, ["info", str(tmp_path)])
    assert res.exit_code == 2 and "llama" in res.output


def test_info_counts_the_vision_tower_of_a_vision_checkpoint(tmp_path):
    """The tower and projector rows equal the parameters of the model `from_pretrained` builds from the folder."""
    from k3export.checkpoint_io import load_vision_config
    from k3export.converters.checkpoints.synthetic_vision import write_vision_checkpoint
    from k3export.info import count_vision_parameters
    from k3export.modeling import K3ForConditionalGeneration

    folder = write_vision_checkpoint(tmp_path / "vl", num_shards=1)
    model = K3ForConditionalGeneration.from_pretrained(folder)
    want = {name: sum(p.numel() for p in getattr(model, name).parameters()) for name in ("vision_tower", "mm_projector")}
    assert count_vision_parameters(load_vision_config(folder)) == want and all(want.values())
    res = runner.invoke(app, ["info", str(folder)])
    assert res.exit_code == 0, res.output
    assert "vision_tower (per image)" in res.output and "mm_projector (per image)" in res.output
    assert load_vision_config("tiny") is None
