"""`k3export.hub.plan_push` offline: the validation report and conversion record it reads, the model card it
builds, what it refuses, and what ``k3export push --dry-run`` prints from it."""

from __future__ import annotations

import json

import pytest

from hub_folders import conversion_record, make_checkpoint, run_cli, validation_report
from hub_server import validate_card_content
from k3export import hub as k3hub
from k3export.errors import K3ExportError


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: [1, 2], "JSON object"),
        (lambda d: dict(d, passed="yes"), "field 'passed': expected a boolean"),
        (lambda d: dict(d, summary=[dict(d["summary"][0], max_abs="big")]), r"field 'summary\[0\].max_abs'"),
        (lambda d: dict(d, format_version=7), "field 'format_version': is 7"),
        (lambda d: {k: v for k, v in d.items() if k != "runtimes"}, "field 'runtimes': missing"),
        (lambda d: dict(d, surprise=1), "field 'surprise': unknown field"),
    ],
)
def test_malformed_validation_report_is_a_clear_error(tmp_path, mutate, message):
    (tmp_path / "validation.json").write_text(json.dumps(mutate(validation_report())))
    with pytest.raises(K3ExportError, match=message):
        k3hub.load_validation(tmp_path)
    (tmp_path / "validation.json").write_text('{"passed": tru')
    with pytest.raises(K3ExportError, match="validation.json: is not valid JSON"):
        k3hub.load_validation(tmp_path)


def test_validation_report_as_k3export_validate_writes_it(tmp_path):
    report = validation_report(passed=False)
    report["summary"][1].update(max_abs="inf", rms_rel="nan", cosine=None)
    report.update(skipped={"tensorrt": "no CUDA device"}, localisation="onnxruntime/decode-8: layer 3 latent, step 2",
                  tolerance_overrides={"logits": {"rms_rel": 0.01}})
    (tmp_path / "validation.json").write_text(json.dumps(report))
    parsed = k3hub.load_validation(tmp_path)
    assert parsed.summary[1].max_abs == float("inf") and parsed.skipped == {"tensorrt": "no CUDA device"}
    make_checkpoint(tmp_path / "ckpt", validation=report)
    card = k3hub.plan_push(tmp_path / "ckpt", "alice/x", force=True).card
    assert "| inf | nan | – |" in card and "Not run: tensorrt (no CUDA device)" in card
    assert "layer 3 latent, step 2" in card and "Tolerance override: logits rms_rel=0.01" in card


def test_conversion_record_is_read_strictly(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt")
    record = json.loads((folder / "conversion.json").read_text())
    record["source"]["path"] = "/models/Kimi-K3-src"  # an absolute local path has no place in the record
    (folder / "conversion.json").write_text(json.dumps(record))
    with pytest.raises(K3ExportError, match=r"conversion.json: field 'source.path': unknown field"):
        k3hub.plan_push(folder, "alice/x")
    (folder / "conversion.json").write_text(json.dumps(conversion_record(folder)))
    (folder / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(K3ExportError, match=r"field 'outputs\[0\].bytes'"):
        k3hub.plan_push(folder, "alice/x")


def test_model_card_metadata_provenance_and_table(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# source card\n")
    plan = k3hub.plan_push(folder, "alice/k3-ckpt")
    meta = k3hub.check_model_card(plan.card)
    assert meta["library_name"] == "transformers"
    assert meta["license"] == "mit"
    assert meta["base_model"] == "moonshotai/Kimi-K3"
    assert meta["pipeline_tag"] == "text-generation"
    assert {"k3export", "kimi-k3", "safetensors"} <= set(meta["tags"])
    assert "0123456789abcdef0123456789abcdef01234567" in plan.card  # source revision
    assert "ab" * 32 in plan.card and "cd" * 32 in plan.card  # source + output sha256
    assert "| onnxruntime | prefill-32 | logits | 1.200e-05 | 3.400e-06 | 1 | 1 | – | pass |" in plan.card
    assert "| onnxruntime | decode-8 | recurrent_state |" in plan.card
    assert validate_card_content(plan.card) == []  # huggingface_hub's parser, as the stand-in's validate-yaml


def test_model_card_license_fallbacks(tmp_path, onnx_export):
    folder = make_checkpoint(tmp_path / "ckpt")
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# source card\n")
    assert k3hub.check_model_card(k3hub.plan_push(folder, "alice/x").card)["license"] == "apache-2.0"
    (folder / "README.md").unlink()
    meta = k3hub.check_model_card(k3hub.plan_push(folder, "alice/x").card)
    assert meta["license"] == "other" and meta["license_link"] == "https://huggingface.co/moonshotai/Kimi-K3"
    onnx_meta = k3hub.check_model_card(k3hub.plan_push(onnx_export, "alice/x").card)
    assert onnx_meta["library_name"] == "onnx" and "onnx" in onnx_meta["tags"]


def test_push_refuses_without_passing_validation(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", validation=False)
    with pytest.raises(k3hub.HubError, match="no validation.json"):
        k3hub.plan_push(folder, "alice/x")
    assert k3hub.plan_push(folder, "alice/x", force=True).warnings[0].startswith("no validation.json")
    (folder / "validation.json").write_text(json.dumps(validation_report(passed=False)))
    with pytest.raises(k3hub.HubError, match="decode-8 / recurrent_state"):
        k3hub.plan_push(folder, "alice/x")
    assert "FAILED" in k3hub.plan_push(folder, "alice/x", force=True).card


def test_cli_refusals_are_one_line_exit_2(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", validation=validation_report(passed=False))
    result = run_cli("push", str(folder), "alice/x", "--dry-run")
    assert result.exit_code == 2 and "validation failed" in result.text and "Traceback" not in result.output
    result = run_cli("push", str(tmp_path), "alice/x", "--dry-run")
    assert result.exit_code == 2 and "neither a converted K3 checkpoint" in result.text
    result = run_cli("push", str(folder), "not a/valid//id", "--dry-run")
    assert result.exit_code == 2 and "invalid repo id" in result.text


def test_dry_run_prints_files_sizes_card_and_needs_no_token(onnx_export, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    folder = onnx_export
    result = run_cli("push", str(folder), "alice/k3-onnx", "--dry-run")
    assert result.exit_code == 0, result.output
    plan = k3hub.plan_push(folder, "alice/k3-onnx")
    for name, size in plan.files:
        assert any(line.split()[:1] == [str(size)] and line.endswith(name) for line in result.output.splitlines()), name
    assert "not uploaded: export.log" in result.output
    assert plan.card.strip().splitlines()[-1] in result.output
    assert "base_model: moonshotai/Kimi-K3" in result.output
    assert hub.state.requests == []  # nothing reached the (stand-in) Hub


def test_a_file_above_the_hubs_limit_is_refused_before_any_upload(onnx_export):
    """A (sparse) data shard above the Hub's 50 GB per-file limit: refused by the plan, in one line naming it."""
    folder = onnx_export
    with open(folder / "model.onnx.data.00000", "r+b") as fh:
        fh.truncate(k3hub.HUB_MAX_FILE_BYTES + 1)
    with pytest.raises(k3hub.HubError) as exc:
        k3hub.plan_push(folder, "alice/x", force=True)
    msg = str(exc.value)
    assert "\n" not in msg and "model.onnx.data.00000" in msg and "above the Hub's 50 GB limit" in msg
