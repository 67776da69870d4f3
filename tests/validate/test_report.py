"""The report is a `ValidationReport` (``validation.json``, read by ``push``): round trip, plot, table."""

import io
import json

import pytest
from rich.console import Console

from k3export.artifacts import ArtifactError, ValidationReport
from k3export.runtime import TorchRunner
from k3export.validate import make_scenarios, plot, read_report, render_table, to_report, validate, write_report
from k3export.validate import mutations as mu


@pytest.fixture(scope="module")
def failing_report(tiny, reference):
    scenarios = make_scenarios(tiny.config.vocab_size, prompt_len=6, steps=3, batch=2, seed=2)
    runners = [TorchRunner(tiny), mu.TransposedStateRunner(TorchRunner(tiny), [1], name="bad")]
    result = validate(reference, runners, scenarios, skipped={"trt": "no TensorRT here"})
    return to_report(result, model={"model_dir": "tiny"})


def test_report_round_trip(failing_report, tmp_path):
    rep = failing_report
    assert rep.reference == "torch" and rep.runtimes == ["torch", "bad"] and rep.passed is False
    assert rep.localisation.startswith("bad/decode: first divergence: layer 1 (kda) recurrent_state")
    assert rep.skipped == {"trt": "no TensorRT here"}
    assert rep.scenario_names == ["decode", "chunked_prefill", "batch"]
    logits = [r for r in rep.summary if r.tensor == "logits" and r.runtime == "torch"]
    assert logits and all(r.passed and r.greedy_agreement == 1.0 for r in logits)
    steps = {(s.runtime, s.scenario, s.step, s.tensor) for s in rep.steps}
    assert ("bad", "decode", 3, "past_key_values.1.recurrent_state") in steps
    path = write_report(rep, tmp_path / "v.json")
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    assert json.loads(text)["format"] == ValidationReport.FORMAT
    assert read_report(path) == rep
    data = json.loads(text)
    del data["summary"]
    (tmp_path / "broken.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="broken.json: field 'summary': missing"):
        read_report(tmp_path / "broken.json")


def test_plot_and_table(failing_report, tmp_path):
    png = plot(failing_report, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    buf = io.StringIO()
    render_table(failing_report, Console(file=buf, width=100))
    out = buf.getvalue()
    assert "FAILED" in out and "recurrent_state" in out and "first divergence: layer 1" in out
    assert "skipped trt: no TensorRT here" in out
