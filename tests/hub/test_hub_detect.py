"""`k3export.hub.detect_artifact`: which kind a folder holds and exactly which of its files are published."""

from __future__ import annotations

import json

import pytest

from hub_folders import make_checkpoint, make_onnx_export
from k3export import hub as k3hub
from k3export.errors import K3ExportError


def test_detect_checkpoint_lists_artifact_files_only(tmp_path):
    art = k3hub.detect_artifact(make_checkpoint(tmp_path / "ckpt"))
    assert art.kind == k3hub.CHECKPOINT
    assert [f.path_in_repo for f in art.files] == [
        "config.json", "configuration_k3.py", "conversion.json", "generation_config.json", "model.safetensors",
        "modeling_k3.py", "tokenizer_config.json", "validation.json",
    ]
    assert art.skipped == ["notes.txt"]
    assert all(f.size == (tmp_path / "ckpt" / f.path_in_repo).stat().st_size for f in art.files)


def test_detect_onnx_export_lists_what_the_export_holds(onnx_export):
    art = k3hub.detect_artifact(onnx_export)
    assert art.kind == k3hub.ONNX
    assert sorted(f.path_in_repo for f in art.files) == [
        "genai_config.json", "model.onnx", "model.onnx.data.00000", "runtime_config.json", "state_manifest.json",
        "validation.json",
    ]
    assert art.skipped == ["export.log"]
    assert art.export is not None and art.export.runtime.data_files == ["model.onnx.data.00000"]


def test_external_data_in_a_subfolder_is_published_under_its_path(tiny_export, tmp_path):
    folder = make_onnx_export(tiny_export, tmp_path / "onnx", data_in="weights/model.onnx.data.00000")
    (folder / "scratch").mkdir()
    art = k3hub.detect_artifact(folder)
    assert "weights/model.onnx.data.00000" in {f.path_in_repo for f in art.files}
    assert art.skipped == ["export.log", "scratch/"]  # a folder the export does not use stays home


def test_onnx_export_with_missing_external_data_is_refused(onnx_export):
    (onnx_export / "model.onnx.data.00000").unlink()
    with pytest.raises(K3ExportError, match=r"runtime_config.json: field 'data_files\[0\]'.*is missing"):
        k3hub.detect_artifact(onnx_export)


def test_onnx_export_is_read_strictly(onnx_export):
    """The documents go through their strict readers (`k3export.artifacts`), not a loose look at a few keys."""
    runtime = json.loads((onnx_export / "runtime_config.json").read_text())
    (onnx_export / "runtime_config.json").write_text(json.dumps(dict(runtime, surprise=1)))
    with pytest.raises(K3ExportError, match="runtime_config.json: field 'surprise': unknown field"):
        k3hub.detect_artifact(onnx_export)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: (d / "weights.bin").write_bytes(b"x"), "neither a converted K3 checkpoint"),
        (lambda d: (d / "config.json").write_text('{"model_type": "llama"}'), "model_type 'llama'"),
        (lambda d: (d / "config.json").write_text('{"model_type": "k3"}'), "no \\*.safetensors"),
        (lambda d: (d / "model.onnx").write_bytes(b""), "state_manifest.json and runtime_config.json is missing"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    ],
)
def test_other_folders_are_refused(tmp_path, setup, message):
    folder = tmp_path / "other"
    folder.mkdir()
    setup(folder)
    with pytest.raises(k3hub.HubError, match=message):
        k3hub.detect_artifact(folder)


def test_sharded_checkpoint_needs_every_indexed_shard(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(k3hub.HubError, match="model-00002-of-00002.safetensors"):
        k3hub.detect_artifact(folder)


def test_graph_only_onnx_export_is_publishable_with_a_note(graph_only_export, tmp_path):
    folder = make_onnx_export(graph_only_export, tmp_path / "onnx", validated=False)  # a graph cannot run
    art = k3hub.detect_artifact(folder)
    assert [f.path_in_repo for f in art.files if ".data" in f.path_in_repo] == []
    assert art.notes and "graph-only export" in art.notes[0]
    plan = k3hub.plan_push(folder, "alice/x", force=True)
    assert any("graph-only export" in w for w in plan.warnings)
