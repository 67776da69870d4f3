"""`k3export validate` / `k3export quickstart` and the TensorRT runner's guard."""

import json

import pytest
import typer
from typer.testing import CliRunner

from k3export.errors import ExportError
from k3export.runtime import TrtRunner


def _app():
    from cli.validate import register

    app = typer.Typer()
    register(app)
    return app


def test_commands_are_discovered_by_main():
    from k3export_cli.main import app

    names = {c.name for c in app.registered_commands}
    assert {"validate", "quickstart"} <= names


def test_validate_cli_passes_on_correct_export(model_dir, onnx_dir, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]))
    res = CliRunner().invoke(_app(), [
        "validate", str(model_dir), "--onnx", str(onnx_dir), "--runtimes", "torch,ort,trt", "--steps", "3",
        "--prompts", str(prompts), "--report", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png"),
        "--tol", "logits=1e-3"])
    assert res.exit_code == 0, res.output
    assert "PASSED" in res.output and "skipped trt" in res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passed"] and rep["runtimes"] == ["torch", "ort"] and "trt" in rep["skipped"]
    assert rep["scenarios"][0]["prompts"] == [[5, 6, 7, 8, 9, 10]]
    assert (onnx_dir / "validation.json").is_file() and (tmp_path / "p.png").is_file()
    import hashlib

    assert rep["artifacts"]["model.onnx"] == hashlib.sha256((onnx_dir / "model.onnx").read_bytes()).hexdigest()
    assert set(rep["artifacts"]) >= {"model.onnx", "state_manifest.json", "runtime_config.json"}
    assert rep["tolerance_overrides"] == {"logits": {"rms_rel": 1e-3}}
    assert rep["reference_dtype"] == "float32" and rep["runtime_dtypes"] == {"torch": "float32", "ort": "float32"}


def test_validate_cli_fp64_reference(model_dir, onnx_dir, tmp_path):
    """A float64 reference: the fp32 export is judged with fp32 tolerances, torch in float64 with float64's."""
    res = CliRunner().invoke(_app(), [
        "validate", str(model_dir), "--onnx", str(onnx_dir), "--runtimes", "torch,ort", "--steps", "2",
        "--batch", "1", "--reference-dtype", "fp64", "--report", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["reference_dtype"] == "float64" and rep["runtime_dtypes"] == {"torch": "float64", "ort": "float32"}
    assert rep["runtime_tolerances"]["ort"]["logits"]["rms_rel"] == 1e-3
    assert rep["runtime_tolerances"]["torch"]["logits"]["rms_rel"] == 1e-9


def test_validate_runs_a_200_token_prefill_on_the_reference_evaluator(model_dir, onnx_dir, tmp_path):
    """The prompt in one prefill (the decode scenario) past the 63 entries onnx's own GatherElements took."""
    res = CliRunner().invoke(_app(), [
        "validate", str(model_dir), "--onnx", str(onnx_dir), "--runtimes", "ort,onnx-reference", "--prompt-len",
        "200", "--steps", "1", "--batch", "1", "--report", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passed"] and rep["runtimes"] == ["ort", "onnx-reference"]
    assert len(rep["scenarios"][0]["prompts"][0]) == 200


def test_validate_refuses_a_broken_export_and_writes_no_report(model_dir, onnx_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(onnx_dir, bad)
    (bad / "validation.json").unlink(missing_ok=True)
    (bad / "runtime_config.json").unlink()
    res = CliRunner().invoke(_app(), ["validate", str(model_dir), "--onnx", str(bad), "--runtimes", "ort",
                                      "--steps", "1", "--report", str(tmp_path / "r.json")])
    assert res.exit_code == 2 and "runtime_config.json is missing" in res.output, res.output
    assert not (tmp_path / "r.json").exists() and not (bad / "validation.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--runtimes", "ort"], "needs --onnx"),
    (["--runtimes", "tvm"], "unknown runtime"),
    (["--runtimes", "torch", "--tol", "logits"], "KIND=VALUE"),
    (["--runtimes", "trt", "--engine", "x.engine", "--strict"], "trt runner"),
    (["--runtimes", ""], "no runtime to validate"),
    (["--runtimes", " , "], "no runtime to validate"),
    (["--runtimes", "torch", "--triton-steps", "-3"], "--triton-steps"),
    (["--runtimes", "torch", "--reference-dtype", "bf16"], "--reference-dtype 'bf16': choose one of fp32, fp64"),
])
def test_validate_cli_user_errors(model_dir, args, message):
    res = CliRunner().invoke(_app(), ["validate", str(model_dir), "--steps", "1", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert "Traceback" not in res.output


def test_validate_cli_missing_model_dir(tmp_path):
    res = CliRunner().invoke(_app(), ["validate", str(tmp_path / "nope"), "--runtimes", "torch"])
    assert res.exit_code == 2 and "not a model folder" in res.output


def test_quickstart_small(tmp_path):
    res = CliRunner().invoke(_app(), ["quickstart", str(tmp_path / "qs"), "--prompt-len", "4", "--steps", "2",
                                      "--triton-steps", "1"])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "qs" / "report.json").read_text())
    assert rep["passed"] and "ort" in rep["runtimes"]
    assert (tmp_path / "qs" / "onnx" / "validation.json").is_file()
    assert (tmp_path / "qs" / "model" / "config.json").is_file()
    assert "generate (ONNX Runtime, greedy): 'Hello' -> '" in res.output  # text in, text out
    # image in, text out: the picture goes through the export's vision and embedding graphs
    assert "generate (ONNX Runtime, greedy, picture.png): 'What is in this picture?' -> '" in res.output
    assert (tmp_path / "qs" / "vision-onnx" / "vision.onnx").is_file()


def test_trt_runner_names_a_wrong_path_first(tmp_path):
    """With TensorRT or without, a missing engine is named before anything about TensorRT."""
    with pytest.raises(ExportError, match="no such engine file"):
        TrtRunner(tmp_path / "nonexistent")
    with pytest.raises(ExportError, match=r"expected one \.engine/\.plan file"):
        TrtRunner(tmp_path)


def _relabel(shard, tensor: str, dtype: str) -> None:
    """Rewrite `tensor`'s dtype in a safetensors header in place (same length: its bytes stay where they are)."""
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header[tensor]["dtype"] = dtype
    new = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(new) == n
    raw[8:8 + n] = new
    shard.write_bytes(bytes(raw))


@pytest.mark.parametrize("case", ["relabelled", "escaping symlink"])
def test_validate_reads_the_checkpoint_through_the_checked_reader(model_dir, tmp_path, case):
    """validate's (and generate's: one `load_model`) PyTorch model is read as export reads it: a shard whose
    header relabels a float tensor as I32 (same byte size), or a shard that is a symlink out of the folder, is
    one line naming the file and the tensor, exit 2; transformers' loader took both."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    if case == "relabelled":
        _relabel(bad / "model.safetensors", "model.norm.weight", "I32")
        expected = "tensor 'model.norm.weight' has wrong dtype I32"
    else:
        outside = tmp_path / "outside.safetensors"
        (bad / "model.safetensors").rename(outside)
        (bad / "model.safetensors").symlink_to(outside)
        expected = "symlink escapes the source folder"
    res = CliRunner().invoke(_app(), ["validate", str(bad), "--runtimes", "torch", "--steps", "1", "--prompt-len",
                                      "2", "--batch", "1"])
    assert res.exit_code == 2, res.output
    assert expected in res.output and "model.safetensors" in res.output and "Traceback" not in res.output


def test_report_and_plot_paths_never_replace_another_file(model_dir, tmp_path):
    """--report / --plot replace only a report / plot k3export wrote, and a bad path fails before the work: a
    mistyped --report naming the checkpoint's shard left the shard a JSON file (the next run: not readable)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(model_dir, ckpt)
    shard = ckpt / "model.safetensors"
    before = shard.read_bytes()
    base = ["validate", str(ckpt), "--runtimes", "torch", "--steps", "1", "--prompt-len", "2", "--batch", "1"]
    for extra, expect in ((["--report", str(shard)], "is not a k3export.validation_report file"),
                          (["--plot", str(shard)], "is not a PNG plot"),
                          (["--report", str(tmp_path)], "is a folder"),
                          (["--plot", str(tmp_path / "nope" / "p.png")], "no such folder")):
        res = CliRunner().invoke(_app(), base + extra)
        assert res.exit_code == 2 and expect in res.output and "PASSED" not in res.output, res.output
    assert shard.read_bytes() == before
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    for _ in range(2):  # the second run replaces the first run's report and plot
        res = CliRunner().invoke(_app(), base + ["--report", str(report), "--plot", str(plot)])
        assert res.exit_code == 0, res.output
    assert json.loads(report.read_text())["passed"] and plot.read_bytes()[:4] == b"\x89PNG"
