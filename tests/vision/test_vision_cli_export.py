"""`k3export export --config k3 --no-weights OUT` through the Typer app: the released model is image + text, so the
preset's graphs are vision.onnx + embedding.onnx + a decoder on ``inputs_embeds``, with the processor files, at the
released sizes (the issue's facts: a 27-block MoonViT-V2 tower 1024 wide, 14-pixel patches, 2 x 2 merge, into the
7168-wide text model). ``--text-only`` gives the text decoder on ``input_ids`` alone; ``--config tiny`` stays text-only;
``--stages`` of an image + text model needs ``--text-only``."""

from __future__ import annotations

import json

import numpy as np
import onnx
from typer.testing import CliRunner

from k3export_cli.main import app
from k3export.artifacts import load_export
from k3export.runtime.base import to_numpy

runner = CliRunner()

#: the released tower and text width (issue 33's facts, not read from k3export)
LAYERS, WIDTH, PATCH, MERGE, TEXT_HIDDEN = 27, 1024, 14, [2, 2], 7168


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _export(*args) -> None:
    r = runner.invoke(app, ["export", *map(str, args), "--no-progress"])
    assert r.exit_code == 0, r.output
    return r.output


def test_k3_preset_exports_the_image_and_text_model(tmp_path):
    out = tmp_path / "k3"
    output = _export("--config", "k3", "--no-weights", out)
    assert "image graphs: vision.onnx, embedding.onnx" in output
    files = {p.name for p in out.iterdir()}
    assert {"model.onnx", "vision.onnx", "embedding.onnx", "preprocessor_config.json", "processor_config.json",
            "runtime_config.json", "state_manifest.json"} <= files
    assert not any(".data" in name for name in files)  # graphs only: no weights written
    rc = json.loads((out / "runtime_config.json").read_text())
    assert [(g["role"], g["model_file"]) for g in rc["graphs"]] == [("vision", "vision.onnx"),
                                                                     ("embedding", "embedding.onnx")]
    assert rc["vision_config"]["vt_num_hidden_layers"] == LAYERS and rc["vision_config"]["vt_hidden_size"] == WIDTH
    loaded = load_export(out)
    assert loaded.has_vision and not loaded.runtime.weights_materialized and loaded.config.num_hidden_layers == 93
    vision = onnx.load(str(out / "vision.onnx"), load_external_data=False)
    assert [_dims(i) for i in vision.graph.input] == [["num_patches", 3 * PATCH * PATCH], ["num_images", 3]]
    assert _dims(vision.graph.output[0]) == ["num_image_tokens", TEXT_HIDDEN]
    blocks = {int(i.name.split(".")[3]) for i in vision.graph.initializer
              if i.name.startswith("vision_tower.encoder.blocks.")}
    assert blocks == set(range(LAYERS))
    wqkv = next(i for i in vision.graph.initializer if i.name.endswith("blocks.0.wqkv.weight"))
    assert list(wqkv.dims) == [3 * 1536, WIDTH]
    decoder = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert decoder.graph.input[0].name == "inputs_embeds" and _dims(decoder.graph.input[0])[-1] == TEXT_HIDDEN
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["patch_size"] == PATCH and pre["merge_kernel_size"] == MERGE


def test_k3_preset_text_only_and_tiny_stay_text_decoders(tmp_path):
    for args in (["--config", "k3", "--text-only"], ["--config", "tiny"]):
        out = tmp_path / args[1]
        _export(*args, "--no-weights", out)
        rc = json.loads((out / "runtime_config.json").read_text())
        assert "graphs" not in rc and "vision_config" not in rc
        assert not (out / "vision.onnx").exists() and not (out / "preprocessor_config.json").exists()
        loaded = load_export(out)
        assert not loaded.has_vision and loaded.manifest.inputs[0].name == "input_ids"


def test_stages_of_the_image_model_put_the_image_graphs_with_stage_0(tmp_path):
    r = runner.invoke(app, ["export", "--config", "k3", "--no-weights", "--stages", "2", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    assert sorted(p.parent.name for p in (tmp_path / "p").glob("*/vision.onnx")) == ["stage-00"]
    assert (tmp_path / "p" / "stage-00" / "embedding.onnx").is_file()


def test_text_only_export_of_an_image_checkpoint(tmp_path):
    """``--text-only`` of a checkpoint with a vision tower: the decoder on ``input_ids`` (vision tensors not read),
    whose greedy tokens and logits are `K3ForCausalLM`'s of the same folder; ``--stages`` works with it."""
    from k3export.modeling import K3ForCausalLM
    from k3export.runtime import greedy_decode
    from k3export.runtime.ort_runner import OrtRunner
    from k3export.runtime.torch_runner import TorchRunner

    ckpt, out = tmp_path / "ckpt", tmp_path / "text"
    r = runner.invoke(app, ["tiny", str(ckpt), "--vision"])
    assert r.exit_code == 0, r.output
    _export(ckpt, out, "--text-only")
    loaded = load_export(out)
    assert not loaded.has_vision and loaded.manifest.inputs[0].name == "input_ids"
    assert not (out / "vision.onnx").exists()
    ids = np.array([[5, 9, 17, 33, 2]], np.int64)
    got = greedy_decode(OrtRunner(out), ids, 4)
    want = greedy_decode(TorchRunner(K3ForCausalLM.from_pretrained(ckpt).eval()), ids, 4)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert np.abs(np.asarray(got.last.logits, np.float64) - to_numpy(want.last.logits, np.float64)).max() < 1e-4
    _export(ckpt, tmp_path / "stages", "--text-only", "--stages", "2")
    assert (tmp_path / "stages" / "pipeline.json").is_file()
