"""`validate` of an image + text export: besides the text scenarios, an ``image`` scenario (two images of
different sizes, prepared by the export's own processor, spliced at their placeholders) runs through PyTorch's
`K3ForConditionalGeneration` and ONNX Runtime's vision -> embedding -> decoder, compared step by step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from k3export.converters.onnx import export_onnx
from k3export.modeling import tiny_vision_model
from k3export.runtime import Decoding
from k3export.runtime.loop import with_images
from k3export.runtime.torch_runner import TorchRunner
from k3export.validate.api import run_validation
from k3export.validate.scenarios import IMAGE_SIZES, image_scenario


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model = tiny_vision_model(seed=4)
    root = tmp_path_factory.mktemp("vl-validate")
    model.save_pretrained(root / "ckpt")
    return model, root / "ckpt", export_onnx(model, root / "export", dtype="fp32").out_dir


def test_the_image_scenario_is_two_images_at_their_placeholders(vl):
    model, _, export = vl
    placeholder = model.config.media_placeholder_token_id
    sc = image_scenario(export, placeholder, model.config.text_config.vocab_size, prompt_len=12, steps=3)
    grids = np.asarray(sc.images.grid_thws)
    assert grids.shape == (2, 3) and not np.array_equal(grids[0], grids[1]) and len(IMAGE_SIZES) == 2
    kh, kw = model.config.vision_config.merge_kernel_size
    assert int((sc.prompts == placeholder).sum()) == int(sum(h // kh * (w // kw) for _, h, w in grids))
    # the images change what the model computes: the scenario is not text in disguise
    runner = TorchRunner(model)
    with torch.no_grad():
        plain = Decoding(runner).feed(sc.prompts).logits
        seen = Decoding(with_images(runner, sc.images)).feed(sc.prompts).logits
    assert float(np.abs(np.asarray(seen) - np.asarray(plain)).max()) > 1e-3


def test_validate_runs_the_image_scenario_on_onnx_runtime(vl, tmp_path):
    model, _, export = vl
    run = run_validation(model, runtimes=["ort"], onnx_dir=export, prompt_len=12, steps=6, batch=2,
                         report_path=tmp_path / "report.json")
    assert run.result.passed, run.result.localisation
    image = [r for r in run.result.runs if r.scenario == "image"]
    assert len(image) == 1 and image[0].steps_run == 6 and all(image[0].greedy)
    entry = next(s for s in json.loads((tmp_path / "report.json").read_text())["scenarios"] if s["name"] == "image")
    assert len(entry["image_grids"]) == 2 and entry["results"][0]["passed"]


def test_the_cli_validates_a_vision_checkpoint_folder_against_its_export(vl, tmp_path):
    from k3export_cli.main import app

    _, ckpt, export = vl
    res = CliRunner().invoke(app, ["validate", str(ckpt), "--onnx", str(export), "--runtimes", "ort",
                                   "--steps", "4", "--prompt-len", "10", "--report", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    names = [s["name"] for s in json.loads((tmp_path / "r.json").read_text())["scenarios"]]
    assert "image" in names and "decode" in names
