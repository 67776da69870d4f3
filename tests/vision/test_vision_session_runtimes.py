"""The image path of every session runtime besides ONNX Runtime: OpenVINO and the ONNX reference evaluator run an
image + text export's ``vision.onnx``, ``embedding.onnx`` and decoder (the inlined form, the one both read) and
agree with PyTorch's `K3ForConditionalGeneration` over prefill + decode (two images of different sizes, greedy
tokens identical); their vision stages match PyTorch's forward hooks, so a corrupted block is localised on them."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from k3export.converters.onnx import export_onnx
from k3export.converters.onnx.vision import vision_stages
from k3export.modeling import tiny_vision_model
from k3export.runtime.torch_runner import TorchRunner
from k3export.validate.api import run_validation
from k3export.validate.localise import vision_stage_outputs
from vision_helpers import corrupted_vision_copy, torch_reference, two_image_inputs, worst_against_reference

STEPS = 4


def _openvino(export):
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("openvino is not installed (pip install 'k3export[openvino]')")
    from k3export.runtime.openvino_runner import OpenVinoRunner

    return OpenVinoRunner(export)


def _reference(export):
    from k3export.runtime.reference_runner import ReferenceRunner

    return ReferenceRunner(export)


RUNTIMES = {"openvino": _openvino, "onnx-reference": _reference}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model = tiny_vision_model(seed=4)
    out = export_onnx(model, tmp_path_factory.mktemp("vl-inlined") / "export", dtype="fp32", form="inlined")
    return model, out.out_dir


@pytest.fixture(scope="module")
def reference(vl):
    model, _ = vl
    inputs = two_image_inputs()
    return inputs, *torch_reference(model, inputs, STEPS)


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_image_and_text_decode_matches_pytorch(vl, reference, runtime):
    _, export = vl
    inputs, logits, tokens = reference
    runner = RUNTIMES[runtime](export)
    assert runner.takes_images and "vision.onnx" in runner.describe()
    worst = worst_against_reference(runner, inputs, logits, tokens, STEPS)
    assert worst < 1e-4, worst


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_every_vision_stage_matches_pytorchs_hooks(vl, reference, runtime):
    model, export = vl
    from k3export.runtime.loop import Images

    inputs = reference[0]
    images = Images(inputs["pixel_values"].numpy(), inputs["grid_thws"].numpy())
    want = vision_stage_outputs(TorchRunner(model), images)
    got = vision_stage_outputs(RUNTIMES[runtime](export), images)
    assert sorted(got) == sorted(vision_stages(model.config.vision_config)) == sorted(want)
    for stage, ref in want.items():
        rel = np.linalg.norm(got[stage] - ref) / np.linalg.norm(ref)
        assert got[stage].shape == ref.shape and rel < 1e-4, (stage, rel)


def test_validate_runs_the_image_scenario_on_openvino_and_the_reference_evaluator(vl):
    model, export = vl
    _openvino(export)  # skips without openvino
    run = run_validation(model, runtimes=["openvino", "onnx-reference"], onnx_dir=export, prompt_len=10, steps=2,
                         batch=1)
    assert run.result.passed, run.result.localisation
    image = [r for r in run.result.runs if r.scenario == "image"]
    assert sorted(r.runtime for r in image) == ["onnx-reference", "openvino"]
    assert all(r.steps_run == 2 and all(r.greedy) for r in image)


def test_a_corrupted_block_is_localised_on_openvino(vl, tmp_path):
    """The staged vision graph OpenVINO compiles (read from memory, its weights from the export's data files) sees
    the export's own weights: a corrupted block 1 is the first divergence, and nothing is written into the export."""
    model, export = vl
    bad = corrupted_vision_copy(export, tmp_path, "vision_tower.encoder.blocks.1.mlp.fc0.weight", 1.5)
    before = sorted(p.name for p in bad.iterdir())
    _openvino(bad)
    run = run_validation(model, runtimes=["openvino"], onnx_dir=bad, prompt_len=10, steps=1, batch=1)
    image = next(r for r in run.result.runs if r.scenario == "image")
    assert not image.passed and image.error is None
    assert image.localisation.startswith("first divergence: vision block 1 (vision_tower.encoder.blocks.1)"), \
        image.localisation
    assert sorted(p.name for p in bad.iterdir()) == before
