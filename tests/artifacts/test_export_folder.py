"""`load_export` checks a whole export folder before any runtime sees a file of it: the documents, the manifest
against the config's contract, the graph's I/O against the manifest and every external-data reference."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from k3export.artifacts import ArtifactError, ExportFolder, RuntimeConfig, StateManifest, load_export
from k3export.modeling import K3Config



def edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _edit_model(folder: Path, fn) -> None:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    fn(model)
    (folder / "model.onnx").write_bytes(model.SerializeToString())


def _first_external(model):
    return next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)


def _set_location(model, value: str) -> None:
    for e in _first_external(model).external_data:
        if e.key == "location":
            e.value = value


def _refused(folder: Path, *words: str) -> str:
    with pytest.raises(ArtifactError) as info:
        load_export(folder)
    msg = str(info.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_an_export_reads_back_as_written(export_dir):
    exp = load_export(export_dir)
    assert isinstance(exp, ExportFolder) and exp.root == export_dir
    config = K3Config.tiny()
    assert exp.manifest == StateManifest.from_config(config, "float32")
    assert exp.runtime == RuntimeConfig.read(export_dir)
    assert exp.config.to_dict() == config.to_dict()
    assert exp.dtype == "float32" and exp.supports_padding
    assert exp.data_paths and all(p.is_file() for p in exp.data_paths)
    model = onnx.load(str(exp.model_path), load_external_data=False)
    optional = {t.name for t in model.graph.initializer} & {i.name for i in model.graph.input}
    assert optional == {"logits_to_keep"}  # an overridable default, not an input the manifest requires
    assert {i.name for i in model.graph.input} - optional == set(exp.manifest.graph_io()[0])


def test_traversing_location_is_refused_before_onnxruntime(copy_export, monkeypatch):
    import onnxruntime

    from k3export.runtime import OrtRunner

    folder = copy_export()
    _edit_model(folder, lambda m: _set_location(m, "../../../../etc/passwd"))

    def boom(*args, **kwargs):
        raise AssertionError("onnxruntime was called on an unchecked export")

    monkeypatch.setattr(onnxruntime, "InferenceSession", boom)
    with pytest.raises(ArtifactError, match=r"model.onnx: field 'tensor .*location': '\.\./\.\./\.\./\.\./etc/passwd'"
                                            r" leaves the folder"):
        OrtRunner(folder)


@pytest.mark.parametrize("location, word", [("/etc/passwd", "absolute"), ("sub/../../x", "leaves the folder"),
                                            ("model.onnx.data.99999", "missing")])
def test_bad_locations(copy_export, location, word):
    folder = copy_export()
    _edit_model(folder, lambda m: _set_location(m, location))
    _refused(folder, "model.onnx", "location", word)


def test_location_not_listed_in_data_files(copy_export):
    folder = copy_export()
    shutil.copy(folder / "model.onnx.data.00000", folder / "other.bin")
    _edit_model(folder, lambda m: _set_location(m, "other.bin"))
    _refused(folder, "runtime_config.json: field 'data_files'", "other.bin")


def test_data_beyond_the_end_of_its_file(copy_export):
    folder = copy_export()
    data = folder / "model.onnx.data.00000"
    with open(data, "r+b") as fh:
        fh.truncate(data.stat().st_size // 2)
    _refused(folder, "model.onnx", "offset", "past the end of model.onnx.data.00000")


def test_length_that_disagrees_with_the_tensor(copy_export):
    folder = copy_export()

    def edit(m):
        for e in _first_external(m).external_data:
            if e.key == "length":
                e.value = str(int(e.value) + 4)

    _edit_model(folder, edit)
    _refused(folder, "model.onnx", "length")


def test_unreferenced_data_file(copy_export):
    folder = copy_export()
    (folder / "stray.bin").write_bytes(b"x")
    edit_json(folder / "runtime_config.json", lambda d: d["data_files"].append("stray.bin"))
    _refused(folder, "runtime_config.json: field 'data_files'", "never references")


def test_data_file_link_leaving_the_folder(copy_export, tmp_path):
    folder = copy_export()
    outside = tmp_path / "outside.bin"
    shutil.move(folder / "model.onnx.data.00000", outside)
    os.symlink(outside, folder / "model.onnx.data.00000")
    _refused(folder, "runtime_config.json: field 'data_files[0]'", "symlink escapes the folder")
    os.unlink(folder / "model.onnx.data.00000")
    os.makedirs(folder / "weights")
    shutil.move(outside, folder / "weights" / "w.bin")
    os.symlink("weights/w.bin", folder / "model.onnx.data.00000")
    load_export(folder)  # a link that stays inside is fine


def test_garbage_model_is_one_line(copy_export):
    folder = copy_export()
    (folder / "model.onnx").write_bytes(os.urandom(4096))
    _refused(folder, "model.onnx")


def test_empty_or_graphless_model_is_named_as_such(copy_export):
    """Protobuf parses 0 bytes (and some other bytes) as a model without a graph; that is said, not a missing
    input far from the cause."""
    folder = copy_export()
    (folder / "model.onnx").write_bytes(b"")
    _refused(folder, "model.onnx", "is empty (0 bytes)")
    (folder / "model.onnx").write_bytes(onnx.ModelProto(ir_version=10).SerializeToString())
    _refused(folder, "model.onnx", "holds no graph")


def test_an_export_marked_partial_is_refused(copy_export):
    """A folder k3export marked partial (a stopped run whose files may be cut short, here copied out of its
    hidden work folder) is refused by everything that reads an export; a complete marker, or none (a Hub
    snapshot), reads."""
    from k3export.errors import K3ExportError
    from k3export.safety import COMPLETE, EXPORT, PARTIAL, write_marker

    folder = copy_export()
    load_export(folder)
    write_marker(folder, EXPORT, PARTIAL)
    with pytest.raises(K3ExportError, match="marked partial by k3export .its export did not finish"):
        load_export(folder)
    write_marker(folder, EXPORT, COMPLETE)
    load_export(folder)


def test_model_file_outside_the_folder(copy_export, tmp_path):
    folder = copy_export()
    shutil.copy(folder / "model.onnx", tmp_path / "elsewhere.onnx")
    edit_json(folder / "runtime_config.json", lambda d: d.update(model_file=str(tmp_path / "elsewhere.onnx")))
    _refused(folder, "runtime_config.json: field 'model_file'", "absolute")
    edit_json(folder / "runtime_config.json", lambda d: d.update(model_file="../elsewhere.onnx"))
    _refused(folder, "'model_file'", "leaves the folder")


@pytest.mark.parametrize("edit, words", [
    (lambda m: setattr(m.graph.input[0], "name", "ids"), ("input input_ids", "missing")),
    (lambda m: m.graph.output[-1].type.tensor_type.__setattr__("elem_type", onnx.TensorProto.FLOAT16),
     ("output present.5.value", "float16", "float32")),
    (lambda m: next(i for i in m.graph.input if i.name == "past_key_values.5.value").type.tensor_type.shape.dim.pop(),
     ("input past_key_values.5.value", "rank 3")),
    (lambda m: m.graph.input[2].type.tensor_type.shape.dim[1].__setattr__("dim_value", 191),
     ("axis 1 is 191", "192")),
])
def test_graph_io_must_be_the_manifests(copy_export, edit, words):
    folder = copy_export()
    _edit_model(folder, edit)
    _refused(folder, "model.onnx", *words)


def test_manifest_that_disagrees_with_the_config(copy_export):
    """The graph is checked against the manifest at load; the config, on first use of `config` (building it imports
    transformers, which an ONNX runtime never needs), against the contract the manifest states."""
    folder = copy_export()
    edit_json(folder / "state_manifest.json", lambda d: d["states"].pop())
    _refused(folder, "model.onnx: field 'input past_key_values.5.value'", "not declared in state_manifest.json")
    folder = copy_export("b")
    edit_json(folder / "runtime_config.json", lambda d: d["config"].update(vocab_size=1024))
    export = load_export(folder)
    with pytest.raises(ArtifactError) as info:
        export.config
    assert "\n" not in str(info.value)
    assert "state_manifest.json: field 'outputs[0].shape'" in str(info.value) and "512" in str(info.value)


def test_missing_documents(copy_export, tmp_path):
    folder = copy_export()
    (folder / "runtime_config.json").unlink()
    _refused(folder, "runtime_config.json is missing")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ArtifactError, match="not an export folder"):
        load_export(a_file)


def test_graph_only_export_reads_but_does_not_run(tmp_path):
    from k3export.converters.onnx import export_onnx
    from k3export.runtime import OrtRunner

    export_onnx(K3Config.tiny(), tmp_path / "g", weights=False)
    exp = load_export(tmp_path / "g")
    assert not exp.runtime.weights_materialized and not any(p.exists() for p in exp.data_paths)
    with pytest.raises(ArtifactError, match="weights_materialized.*cannot run"):
        OrtRunner(tmp_path / "g")


def test_hub_cache_snapshot_links_into_blobs(export_dir, tmp_path):
    """A Hugging Face cache snapshot holds links into the repository's blobs/: they are inside the artifact."""
    repo = tmp_path / "models--alice--k3"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in export_dir.iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        os.symlink(f"../../blobs/blob-{f.name}", snap / f.name)
    exp = load_export(snap)
    assert exp.manifest == load_export(export_dir).manifest
    np.testing.assert_array_equal(np.fromfile(exp.data_paths[0], np.uint8)[:64],
                                  np.fromfile(export_dir / exp.runtime.data_files[0], np.uint8)[:64])
