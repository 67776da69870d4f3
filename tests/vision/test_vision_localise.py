"""Localisation of a failing ``image`` scenario in the vision tower: the first vision stage (patch embedding, a
block, the final norm, the merge, the projector) whose output differs between PyTorch and ONNX Runtime is named.

The faults are injected on one side only, the other side left as the checkpoint has it: one block's weight
corrupted in the export's vision data (an export bug), or the reference copy's projector perturbed; PyTorch's stage
outputs come from forward hooks, ONNX Runtime's from the export's own ``vision.onnx`` with its stage values exposed."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch

from k3export.converters.onnx import export_onnx
from k3export.converters.onnx.vision import VISION_FILE, build_vision_proto, vision_stages, with_stage_outputs
from k3export.errors import ExportError
from k3export.modeling import tiny_vision_model
from k3export.runtime.ort_runner import OrtRunner
from k3export.runtime.torch_runner import TorchRunner
from k3export.validate.compare import Tolerances
from k3export.validate.core import validate
from k3export.validate.localise import vision_stage_outputs
from k3export.validate.scenarios import image_scenario
from vision_helpers import corrupted_vision_copy


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model = tiny_vision_model(seed=4)
    root = tmp_path_factory.mktemp("vl-localise")
    return model, export_onnx(model, root / "export", dtype="fp32").out_dir


def _scenario(model, export):
    return image_scenario(export, model.config.media_placeholder_token_id, model.config.text_config.vocab_size,
                          prompt_len=10, steps=2)


def _run(reference_model, export, model):
    return validate(TorchRunner(reference_model), [OrtRunner(export)], [_scenario(model, export)],
                    Tolerances("float32")).runs[0]


def test_an_unperturbed_run_passes_and_every_vision_stage_agrees(vl):
    model, export = vl
    run = _run(model, export, model)
    assert run.passed and run.localisation is None
    images = _scenario(model, export).images
    ref = vision_stage_outputs(TorchRunner(model), images)
    ours = vision_stage_outputs(OrtRunner(export), images)
    stages = vision_stages(model.config.vision_config)
    assert list(ref) == stages and sorted(ours) == sorted(stages)  # torch's hooks fire in the order of the stages
    assert len(stages) == model.config.vision_config.vt_num_hidden_layers + 4
    for s in stages:
        rel = np.linalg.norm(ours[s] - ref[s]) / np.linalg.norm(ref[s])
        assert ours[s].shape == ref[s].shape and rel < 1e-4, (s, rel)


def test_a_corrupted_block_in_the_export_is_named_and_no_earlier_stage(vl, tmp_path):
    model, export = vl
    bad = corrupted_vision_copy(export, tmp_path, "vision_tower.encoder.blocks.1.mlp.fc0.weight", 1.5)
    run = _run(model, bad, model)
    assert not run.passed and run.error is None
    line = run.localisation
    assert line.startswith("first divergence: vision block 1 (vision_tower.encoder.blocks.1)"), line
    assert "block 0" not in line and "patch embedding" not in line
    # independently of the line: block 0 agrees, block 1 does not
    images = _scenario(model, export).images
    ref, ours = vision_stage_outputs(TorchRunner(model), images), vision_stage_outputs(OrtRunner(bad), images)
    err = {s: np.linalg.norm(ours[s] - ref[s]) / np.linalg.norm(ref[s]) for s in ref}
    assert err["vision_tower.encoder.blocks.0"] < 1e-4 < 1e-2 < err["vision_tower.encoder.blocks.1"]


def test_a_perturbed_reference_projector_is_named_after_an_agreeing_tower(vl):
    model, export = vl
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.mm_projector.proj[2].weight.mul_(1.2).add_(0.01)
    run = _run(reference, export, model)
    assert not run.passed
    assert run.localisation.startswith("first divergence: projector (mm_projector)"), run.localisation


def test_the_stage_outputs_refuse_a_graph_that_is_not_this_builders(vl):
    model, export = vl
    graph = onnx.load(str(export / VISION_FILE), load_external_data=False)
    exposed, stages = with_stage_outputs(graph, model.config.vision_config)
    assert set(stages) == set(vision_stages(model.config.vision_config))
    assert {o.name for o in exposed.graph.output} == set(stages.values())
    assert len(graph.graph.output) == 1  # the export's own vision.onnx has no debug outputs
    del graph.graph.node[5]
    with pytest.raises(ExportError, match="nodes differ"):
        with_stage_outputs(graph, model.config.vision_config)
    for dtype in ("fp16", "bf16"):  # the stages are found in a graph of any export dtype
        plain, _ = build_vision_proto(model.config.vision_config, dtype)
        exposed, stages = with_stage_outputs(plain, model.config.vision_config)
        added = len(exposed.graph.node) - len(plain.graph.node)  # one Identity per stage but image_features
        assert len(exposed.graph.output) == len(stages) and added == len(stages) - 1


def test_a_text_layer_fault_in_the_image_scenario_keeps_the_text_localisation(vl):
    model, export = vl
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.language_model.model.layers[1].self_attn.v_proj.weight.mul_(1.3)
    run = _run(reference, export, model)
    assert not run.passed
    assert run.localisation.startswith("first divergence: layer 1 ") and "vision" not in run.localisation, \
        run.localisation
