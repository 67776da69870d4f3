"""Image in, text out through the ONNX export: `export_onnx` of an image + text model writes vision.onnx,
embedding.onnx and a decoder on ``inputs_embeds``; ONNX Runtime runs vision -> embedding -> decoder prefill, then
decodes by token ids through the embedding graph, and gives PyTorch's `K3ForConditionalGeneration` logits (prefill +
8 decode steps) and greedy tokens for a prompt with two images of different sizes from the real processor. Also the
folder's documents, the text-only export unchanged, and what `load_export` refuses."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from k3export.artifacts import ArtifactError, load_export
from k3export.converters.onnx import export_onnx
from k3export.errors import K3ExportError
from k3export.modeling import tiny_model, tiny_vision_model
from k3export.modeling.contract import INPUT_IDS, INPUTS_EMBEDS
from k3export.runtime import greedy_decode
from k3export.runtime.loop import Images, with_images
from k3export.runtime.ort_runner import OrtRunner
from k3export.runtime.torch_runner import TorchRunner
from vision_helpers import MEDIA_PAD_ID, torch_reference, two_image_inputs, worst_against_reference

STEPS = 8


@pytest.fixture(scope="module")
def model():
    return tiny_vision_model(seed=2)


@pytest.fixture(scope="module")
def export(model, tmp_path_factory):
    return export_onnx(model, tmp_path_factory.mktemp("vl") / "export").out_dir


@pytest.fixture(scope="module")
def inputs():
    """Two images of different sizes in one chat-templated prompt, through the real processor."""
    return two_image_inputs()




def test_ort_matches_pytorch_prefill_and_decode(model, export, inputs):
    want_logits, want_tokens = torch_reference(model, inputs, STEPS)
    runner = OrtRunner(export)
    assert runner.takes_images and runner.manifest.input_names[0] == INPUTS_EMBEDS
    worst = worst_against_reference(runner, inputs, want_logits, want_tokens, STEPS)
    assert worst < 1e-4, worst
    print(f"max |ORT - PyTorch| logits over prefill + {STEPS} steps: {worst:.2e}")
    # the images matter: the same prompt without them (placeholders as plain tokens) decodes to other logits
    plain = greedy_decode(runner, inputs["input_ids"].numpy(), 0)
    assert not np.allclose(np.asarray(plain.last.logits)[:, -1], want_logits[0], atol=1e-3)


def test_shared_loop_torch_and_ort_agree(model, export, inputs):
    images = Images(inputs["pixel_values"], inputs["grid_thws"])
    ids = inputs["input_ids"].numpy()
    ort_tokens = greedy_decode(OrtRunner(export), ids, STEPS, images=images).tokens
    torch_tokens = greedy_decode(TorchRunner(model), ids, STEPS, images=images).tokens
    assert ort_tokens.tolist() == torch_tokens.tolist() == [torch_reference(model, inputs, STEPS)[1]]


def test_export_documents(model, export):
    files = {p.name for p in export.iterdir()}
    assert {"vision.onnx", "embedding.onnx", "model.onnx", "preprocessor_config.json",
            "processor_config.json"} <= files
    rc = json.loads((export / "runtime_config.json").read_text())
    assert [(g["role"], g["model_file"]) for g in rc["graphs"]] == [("vision", "vision.onnx"),
                                                                     ("embedding", "embedding.onnx")]
    assert rc["vision_config"]["vt_hidden_size"] == model.config.vision_config.vt_hidden_size
    assert rc["media_placeholder_token_id"] == model.config.media_placeholder_token_id
    man = json.loads((export / "state_manifest.json").read_text())
    assert [g["role"] for g in man["graphs"]] == ["vision", "embedding"]
    assert man["graphs"][0]["inputs"][0]["shape"] == ["num_patches", model.config.vision_config.patch_pixels]
    assert man["graphs"][1]["outputs"][0]["shape"] == ["batch", "sequence_length",
                                                       model.config.text_config.hidden_size]
    loaded = load_export(export)
    assert loaded.has_vision and {"vision.onnx", "embedding.onnx"} <= set(loaded.file_names)


def test_text_only_export_is_unchanged(tmp_path):
    out = export_onnx(tiny_model(seed=0), tmp_path / "text").out_dir
    rc = json.loads((out / "runtime_config.json").read_text())
    man = json.loads((out / "state_manifest.json").read_text())
    assert "graphs" not in rc and "vision_config" not in rc and "graphs" not in man
    assert man["inputs"][0]["name"] == INPUT_IDS
    assert not (out / "vision.onnx").exists() and not OrtRunner(out).takes_images
    with pytest.raises(K3ExportError, match="cannot take images"):
        with_images(OrtRunner(out), Images(np.zeros((4, 48), np.float32), np.array([[1, 2, 2]])))


def _copy(export, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(export, dst)
    return dst


@pytest.mark.parametrize("edit, phrase", [
    (lambda d: (d / "vision.onnx").unlink(), "vision.onnx"),
    (lambda d: (d / "embedding.onnx.data.00000").unlink(), "embedding.onnx.data.00000"),
    (lambda d: _rc(d, lambda rc: rc["graphs"][0].update(model_file="../vision.onnx")), "graphs\\[0\\].model_file"),
    (lambda d: _rc(d, lambda rc: rc.pop("vision_config")), "graphs"),
    (lambda d: _man(d, lambda m: m["graphs"][0]["inputs"][0].update(shape=["num_patches", 7])),
     "vision.onnx: field 'input pixel_values': axis 1 is 48, the manifest says 7"),
    (lambda d: _rc(d, lambda rc: rc["graphs"].reverse()), "graphs"),
])
def test_load_export_refuses_bad_image_graphs(export, tmp_path, edit, phrase):
    d = _copy(export, tmp_path)
    edit(d)
    with pytest.raises(ArtifactError, match=phrase) as info:
        load_export(d)
    assert "\n" not in str(info.value)


def _rc(folder, change):
    path = folder / "runtime_config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _man(folder, change):
    path = folder / "state_manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_placeholder_mismatch_is_refused(export, inputs):
    ids = inputs["input_ids"].numpy()
    ids = np.delete(ids, np.flatnonzero(ids[0] == MEDIA_PAD_ID)[0], axis=1)  # one placeholder fewer than tokens
    with pytest.raises(K3ExportError, match="placeholder tokens"):
        greedy_decode(OrtRunner(export), ids, 0, images=Images(inputs["pixel_values"], inputs["grid_thws"]))


def test_vision_refusals(tmp_path):
    with pytest.raises(K3ExportError, match="no vision tower"):
        export_onnx(tiny_model(seed=0), tmp_path / "a", vision=True)
    with pytest.raises(K3ExportError, match="first stage"):
        export_onnx(tiny_vision_model(seed=0), tmp_path / "b", layers=range(1, 2), vision=True)


def test_graph_only_export_of_a_config(tmp_path):
    from k3export.modeling.configuration_k3 import K3VLConfig

    out = export_onnx(K3VLConfig.tiny(), tmp_path / "graphs", weights=False).out_dir
    loaded = load_export(out)
    assert loaded.has_vision and not loaded.runtime.weights_materialized
    assert not any(p.name.startswith(("vision.onnx.data", "embedding.onnx.data")) for p in out.iterdir())


def test_a_push_carries_the_image_graphs_and_the_processor(export):
    """What `push` uploads from an image + text export: every graph the runtime config names, each graph's data
    files, and the processor (settings and code) that feeds the vision graph."""
    from k3export.artifacts import load_export
    from k3export.hub.detect import detect_artifact

    runtime = load_export(export).runtime
    published = {f.path_in_repo for f in detect_artifact(export).files}
    graphs = {g.model_file for g in runtime.graphs} | {n for g in runtime.graphs for n in g.data_files}
    assert {"vision.onnx", "embedding.onnx"} <= graphs <= published
    assert {"preprocessor_config.json", "processor_config.json", "image_processing_k3.py"} <= published
    assert all((export / n).is_file() for n in published)
