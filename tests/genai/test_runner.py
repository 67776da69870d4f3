"""The genai runner in the validation harness: onnxruntime-genai's generator on our export matches the PyTorch
reference (logits and every carried state), a planted export bug fails the genai row, and what genai cannot run is
refused with a reason, never silently wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from export_names import KDA_IN_PROJ  # tests/ is on sys.path
from genai_fixtures import export_for_genai

pytest.importorskip("onnxruntime_genai")


@pytest.fixture(scope="module")
def plain_export(tok_model, tmp_path_factory):
    return export_for_genai(tok_model, None, tmp_path_factory.mktemp("runner") / "onnx")


@pytest.fixture(scope="module")
def reference(tok_model):
    from k3export.runtime import Target, make_runner

    return make_runner("torch", Target(model=tok_model))


def _scenarios(config, steps=6):
    from k3export.validate.scenarios import make_scenarios

    return make_scenarios(config.vocab_size, prompt_len=8, steps=steps, batch=2, seed=3)


def test_genai_row_passes_with_ort(tok_model, plain_export, reference):
    from k3export.runtime import Target, make_runner
    from k3export.runtime.genai_runner import GenaiRunner
    from k3export.validate.core import validate

    genai, ort = GenaiRunner(plain_export), make_runner("ort", Target(onnx_dir=plain_export))
    result = validate(reference, [ort, genai], _scenarios(tok_model.config))
    rows = {(r.runtime, r.scenario): r for r in result.runs}
    assert {s for _, s in rows} == {"decode", "chunked_prefill", "batch"}
    for (rt, sc), r in rows.items():
        assert r.passed, (rt, sc, r.error, r.localisation)
        assert r.steps_run > 0 and any(rec.kind == "recurrent_state" for rec in r.records)
    assert result.passed


@pytest.mark.parametrize("form", ["standard", "ort"])
def test_genai_reads_the_portable_forms(tok_model, reference, tmp_path, form):
    """onnxruntime-genai's generator on the standard form (LinearAttention-27, CausalConvWithState-27, Attention) and
    the ort form (GatedDeltaNet, Attention): PyTorch's logits and states, as `forms.READERS` says."""
    from k3export.artifacts.graph_forms import readable
    from k3export.runtime.genai_runner import GenaiRunner
    from k3export.validate.core import validate

    assert form in readable("genai")
    export = export_for_genai(tok_model, None, tmp_path / form, form=form)
    result = validate(reference, [GenaiRunner(export)], _scenarios(tok_model.config, steps=3))
    assert result.passed, result.localisation
    assert all(r.steps_run > 0 for r in result.runs)


def test_planted_export_bug_fails_the_genai_row(tok_model, plain_export, reference, tmp_path):
    from k3export.genai import write_genai_config
    from k3export.runtime.genai_runner import GenaiRunner
    from k3export.validate.core import validate
    from k3export.validate.mutations import mutate_onnx_initializer

    bad = mutate_onnx_initializer(plain_export, tmp_path / "bad", KDA_IN_PROJ, lambda w: w * 1.05)
    write_genai_config(bad, tok_model.config)
    result = validate(reference, [GenaiRunner(bad)], _scenarios(tok_model.config, steps=2))
    assert not result.passed
    failed = [r for r in result.runs if not r.passed]
    assert failed and all(r.runtime == "genai" and r.error is None for r in failed)  # numbers, not a crash
    assert "layer 3" in (result.localisation or "")


def test_refuses_what_genai_cannot_run(tok_model, plain_export):
    from k3export.errors import K3ExportError
    from k3export.runtime import Decoding, left_pad
    from k3export.runtime.genai_runner import GenaiRunner, genai_mask

    runner = GenaiRunner(plain_export)
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]], pad_id=tok_model.config.pad_token_id)
    with pytest.raises(K3ExportError, match="left padding"):
        Decoding(runner).feed(ids, mask)
    pad = tok_model.config.pad_token_id
    assert genai_mask(np.array([[5, 6, pad], [7, pad, pad]]), pad, first=True).tolist() == [[1, 1, 0], [1, 0, 0]]
    d = Decoding(runner)
    out = d.feed(np.array([[5, 6, 7]]))
    tampered = dict(out.state)
    name = next(s.name for s in runner.manifest.states if s.role == "recurrent")
    tampered[name] = np.swapaxes(tampered[name], -1, -2).copy()
    with pytest.raises(K3ExportError, match="not the one this runner returned"):
        runner.forward(np.array([[8]]), tampered, np.ones((1, 4), np.int64))
    with pytest.raises(K3ExportError, match="cannot resume"):
        runner.forward(np.array([[8]]), {**runner.initial_state(1), name: np.ones_like(tampered[name])},
                       np.ones((1, 1), np.int64))


def test_validate_cli_with_genai(tok_checkpoint, tok_export, tmp_path):
    from k3export import runtime

    if "genai" not in runtime.RUNNERS:
        pytest.skip("the genai runner is not in k3export.runtime.RUNNERS yet (registry edit pending)")
    from cli.validate import register

    app = typer.Typer()
    register(app)
    report = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["validate", str(tok_checkpoint), "--onnx", str(tok_export), "--runtimes",
                                   "torch,ort,genai", "--prompt-len", "8", "--steps", "4", "--report", str(report)])
    assert res.exit_code == 0, res.output
    data = json.loads(report.read_text())
    assert data["passed"] and "genai" in data["runtimes"]

    from k3export.genai import write_genai_config
    from k3export.runtime import load_model
    from k3export.validate.mutations import mutate_onnx_initializer

    bad = mutate_onnx_initializer(tok_export, tmp_path / "bad", KDA_IN_PROJ, lambda w: w * 1.05)
    write_genai_config(bad, load_model(tok_checkpoint).config)
    res = CliRunner().invoke(app, ["validate", str(tok_checkpoint), "--onnx", str(bad), "--runtimes", "torch,genai",
                                   "--prompt-len", "8", "--steps", "2", "--batch", "1"])
    assert res.exit_code == 2 and "genai" in res.output and "layer 3" in res.output, res.output
