"""The JSON report keeps schema version 1 (the Hub helper reads it): round trip, plot, table."""

import io
import json

import pytest
from rich.console import Console

from k3export.runtime import TorchRunner
from k3export.validate import check_schema, make_scenarios, plot, read_json, render_table, to_json, validate, write_json
from k3export.validate import mutations as mu
from k3export.validate.report import REQUIRED_KEYS, SUMMARY_KEYS


@pytest.fixture(scope="module")
def failing_report(tiny, reference):
    scenarios = make_scenarios(tiny.config.vocab_size, prompt_len=6, steps=3, batch=2, seed=2)
    runners = [TorchRunner(tiny), mu.TransposedStateRunner(TorchRunner(tiny), [1], name="bad")]
    return to_json(validate(reference, runners, scenarios, skipped={"trt": "no TensorRT here"}),
                   model={"model_dir": "tiny"})


def test_report_schema_round_trip(failing_report, tmp_path):
    rep = failing_report
    check_schema(rep)
    assert set(REQUIRED_KEYS) <= set(rep)
    assert rep["schema_version"] == 1 and rep["reference"] == "torch" and rep["runtimes"] == ["torch", "bad"]
    assert rep["passed"] is False
    assert rep["localisation"].startswith("bad/decode: first divergence: layer 1 (kda) recurrent_state")
    assert rep["skipped"] == {"trt": "no TensorRT here"}
    assert [s["name"] for s in rep["scenarios"]] == ["decode", "chunked_prefill", "batch"]
    for row in rep["summary"]:
        assert set(SUMMARY_KEYS) <= set(row)
    logits = [r for r in rep["summary"] if r["tensor"] == "logits" and r["runtime"] == "torch"]
    assert logits and all(r["passed"] and r["greedy_agreement"] == 1.0 for r in logits)
    steps = {(s["runtime"], s["scenario"], s["step"], s["tensor"]) for s in rep["steps"]}
    assert ("bad", "decode", 3, "past_key_values.1.recurrent_state") in steps
    path = write_json(rep, tmp_path / "v.json")
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    back = read_json(path)
    assert back == json.loads(json.dumps(rep))
    broken = dict(back)
    del broken["summary"]
    with pytest.raises(ValueError, match="summary"):
        check_schema(broken)
    with pytest.raises(ValueError, match="schema_version"):
        check_schema(dict(back, schema_version=2))


def test_plot_and_table(failing_report, tmp_path):
    png = plot(failing_report, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    buf = io.StringIO()
    render_table(failing_report, Console(file=buf, width=100))
    out = buf.getvalue()
    assert "FAILED" in out and "recurrent_state" in out and "first divergence: layer 1" in out
    assert "skipped trt: no TensorRT here" in out
