"""Artifact folders for the Hub tests (tests/hub/, tests/reliability/test_push.py): a small well-formed converted
checkpoint, a copy of a real ONNX export with its validation report, and the CLI runner; the stand-in Hub itself
is tests/hub_server.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import typer
from click.testing import CliRunner
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_standin_Secret_7f3a9c"
OTHER_TOKEN = "hf_standin_Other_1b2c3d"


def _cli_app():
    try:
        from k3export_cli.main import app
    except ModuleNotFoundError:  # editable install without the cli/ -> k3export_cli mapping
        spec = importlib.util.spec_from_file_location(
            "k3export_cli", ROOT / "cli" / "__init__.py", submodule_search_locations=[str(ROOT / "cli")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["k3export_cli"] = module
        spec.loader.exec_module(module)
        from k3export_cli.main import app
    return app


def run_cli(*args: str):
    # get_group: the `push` sub-command stays addressable by name even while it is the app's only command
    result = CliRunner().invoke(typer.main.get_group(_cli_app()), list(args))
    assert TOKEN not in result.output and OTHER_TOKEN not in result.output
    # rich wraps long lines at the terminal width: compare messages with whitespace collapsed
    result.text = " ".join(result.output.split())
    return result


def validation_report(passed: bool = True) -> dict:
    """A validation.json as `k3export validate` writes it (`k3export.artifacts.ValidationReport`)."""
    from k3export.artifacts import ScenarioEntry, SummaryRow, ToleranceEntry, ValidationReport

    def row(scenario, tensor, max_abs, rms_rel, cosine, top1, greedy, ok):
        return SummaryRow("onnxruntime", scenario, tensor, tensor, None, max_abs, max_abs, rms_rel, cosine, top1, top1,
                          greedy, ok)

    return ValidationReport(
        passed=passed, created="2026-03-01T12:00:00Z", tool_version="0.1.0", reference="torch",
        runtimes=["onnxruntime"], skipped={}, runtime_descriptions={}, model={}, artifacts={},
        tolerances={"logits": ToleranceEntry(1e-3, 1e-2, 1e-6)}, tolerance_overrides={},
        scenarios=[ScenarioEntry("prefill-32", 1, 32, 0, None, [[1] * 32], []),
                   ScenarioEntry("decode-8", 1, 1, 8, None, [[1]], [])],
        summary=[row("prefill-32", "logits", 1.2e-5, 3.4e-6, 0.9999999, 1.0, None, True),
                 row("decode-8", "recurrent_state", 2.0e-6, 1.0e-6, 1.0, None, 1.0, passed)],
        steps=[], localisation=None).to_json()


def conversion_record(folder: Path) -> dict:
    """A conversion.json as `k3export convert` writes it, for the shard in `folder`."""
    from k3export.artifacts import ConversionRecord, ConversionSource, FileDigest

    shard = folder / "model.safetensors"
    return ConversionRecord(
        tool="k3export", tool_version="0.1.0", created="2026-03-01T11:00:00Z",
        source=ConversionSource("Kimi-K3-src", "moonshotai/Kimi-K3", "0123456789abcdef0123456789abcdef01234567",
                                "released", [FileDigest("model-00001-of-00002.safetensors", 1234, "ab" * 32)]),
        options={"dtype": "bfloat16", "experts": "mxfp4->bf16"},
        outputs=[FileDigest("model.safetensors", shard.stat().st_size, "cd" * 32)],
        skipped={"mtp": 1}, plan_fingerprint="f00d").to_json()


def make_checkpoint(folder: Path, *, validation: dict | None = None, conversion: bool = True) -> Path:
    """A small but well-formed converted checkpoint folder (the real model is not needed to push)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "k3", "hidden_size": 8, "vocab_size": 16}))
    save_file({"model.embed_tokens.weight": torch.arange(128, dtype=torch.float32).reshape(16, 8)},
              str(folder / "model.safetensors"))
    (folder / "configuration_k3.py").write_bytes((ROOT / "k3export" / "modeling" / "configuration_k3.py").read_bytes())
    (folder / "modeling_k3.py").write_bytes((ROOT / "k3export" / "modeling" / "modeling_k3.py").read_bytes())
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    (folder / "notes.txt").write_text("scratch notes, not part of the artifact\n")
    if conversion:
        (folder / "conversion.json").write_text(json.dumps(conversion_record(folder)))
    if validation is not False:
        report = validation if validation is not None else validation_report()
        (folder / "validation.json").write_text(json.dumps(report))
    return folder


def relocate_data(folder: Path, location: str, *, move: bool = True) -> None:
    """Point `folder`'s model.onnx at external data `location` instead of its one data shard: every tensor, with
    the shard moved there and runtime_config.json's ``data_files`` following (`move`), or else the first tensor
    only, nothing else changed (a reference no export writes)."""
    import onnx

    rc_path = folder / "runtime_config.json"
    runtime = json.loads(rc_path.read_text())
    (shard,) = runtime["data_files"]
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    entries = [e for t in model.graph.initializer for e in t.external_data if e.key == "location" and e.value == shard]
    for e in entries if move else entries[:1]:
        e.value = location
    onnx.save(model, str(folder / "model.onnx"))
    if move:
        (folder / location).parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder / shard, folder / location)
        rc_path.write_text(json.dumps(dict(runtime, data_files=[location]), indent=1))


def make_onnx_export(source: Path, folder: Path, *, data_in: str | None = None, validated: bool = True) -> Path:
    """A copy of the real export `source` with a log file beside it (not part of the artifact), its data shard
    moved to `data_in` when given, and (`validated`) a passing validation.json of exactly its files."""
    from k3export.artifacts import load_export

    shutil.copytree(source, folder)
    (folder / "export.log").write_text("log\n")
    if data_in is not None:
        relocate_data(folder, data_in)
    if validated:
        report = dict(validation_report(), artifacts=load_export(folder).file_digests())
        (folder / "validation.json").write_text(json.dumps(report))
    return folder
