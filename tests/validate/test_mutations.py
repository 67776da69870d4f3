"""Deliberately wrong artifacts fail (non-zero exit) and localisation names the right layer.

Tiny model layers (0-based): 0 kda (dense FFN), 1 kda, 2 mla, 3 kda, 4 kda, 5 mla; MoE from layer 1.
"""

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from k3export.errors import ValidationFailed
from k3export.runtime import OrtRunner, TorchRunner
from k3export.validate import make_scenarios, validate
from k3export.validate import mutations as mu
from k3export.validate.api import raise_on_failure, run_validation

from export_names import KDA_IN_PROJ  # tests/ is on sys.path


def _scenarios(tiny):
    return make_scenarios(tiny.config.vocab_size, prompt_len=8, steps=3, batch=1, which=("decode",))


def _check_fails_at(result, layer, tensor_word):
    assert not result.passed
    loc = result.localisation
    assert loc is not None and f"layer {layer} " in loc, loc
    assert tensor_word in loc, loc
    return loc


def test_perturbed_weight_in_one_layer(tiny, reference):
    bad = TorchRunner(mu.perturb_weight(tiny, 3, "self_attn.v_proj.weight"), name="mutant")
    loc = _check_fails_at(validate(reference, [bad], _scenarios(tiny)), 3, "(kda)")
    assert "prefill" in loc


def test_kda_decay_sign_flipped(tiny, reference):
    bad = TorchRunner(mu.flip_decay_sign(tiny, 4), name="mutant")
    _check_fails_at(validate(reference, [bad], _scenarios(tiny)), 4, "recurrent_state")


def test_router_bias_dropped(tiny, reference):
    bad = TorchRunner(mu.drop_router_bias(tiny, 2), name="mutant")
    # with per-layer hidden states the FFN of layer 2 is named (its MLA state is unaffected)
    _check_fails_at(validate(reference, [bad], _scenarios(tiny)), 2, "hidden_states")


def test_state_fed_back_transposed(tiny, reference):
    bad = mu.TransposedStateRunner(TorchRunner(tiny), layers=[3], name="mutant")
    result = validate(reference, [bad], _scenarios(tiny))
    loc = _check_fails_at(result, 3, "recurrent_state")
    assert "decode step 1" in loc  # the prefill is right; the first fed-back state is wrong
    with pytest.raises(ValidationFailed, match="layer 3"):
        raise_on_failure(type("Run", (), {"result": result})())


def test_onnx_initializer_edited_fails_cli_with_nonzero_exit(tiny, model_dir, onnx_dir, tmp_path):
    from cli.validate import register

    bad_dir = mu.mutate_onnx_initializer(onnx_dir, tmp_path / "bad", KDA_IN_PROJ, lambda w: w * 1.05)
    app = typer.Typer()
    register(app)
    report = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["validate", str(model_dir), "--onnx", str(bad_dir), "--runtimes", "ort",
                                   "--prompt-len", "8", "--steps", "2", "--batch", "1", "--report", str(report)])
    assert res.exit_code == 2, res.output
    assert "first divergence: layer 3 (kda)" in res.output
    import json

    data = json.loads(report.read_text())
    assert data["passed"] is False and "layer 3" in data["localisation"]
    assert json.loads((bad_dir / "validation.json").read_text())["passed"] is False


def test_onnx_router_bias_zeroed_localised_by_state(tiny, onnx_dir, tmp_path, reference):
    """Without per-layer debug outputs in the export, the carried states localise: the FFN of layer 2 shows in
    layer 3's state and the line says the previous layer's FFN may be the cause."""
    bad_dir = mu.mutate_onnx_initializer(onnx_dir, tmp_path / "bias",
                                         "model.layers.2.block_sparse_moe.gate.e_score_correction_bias",
                                         lambda b: np.zeros_like(b))
    ort = OrtRunner(bad_dir)
    result = validate(reference, [ort], _scenarios(tiny))
    loc = _check_fails_at(result, 3 if not ort.manifest.hidden_outputs else 2, "")
    if not ort.manifest.hidden_outputs:
        assert "previous layer's FFN" in loc


def test_correct_export_via_api_passes(tiny, onnx_dir, tmp_path):
    run = run_validation(tiny, runtimes=["ort"], onnx_dir=onnx_dir, prompt_len=8, steps=2, batch=1,
                         report_path=tmp_path / "ok.json")
    raise_on_failure(run)
    assert run.report.passed is True
