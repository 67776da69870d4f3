"""Image in, text out through a pipeline export: ``k3export export CKPT OUT --stages 2`` of an image + text checkpoint
puts vision.onnx, embedding.onnx and the processor with stage 0 (its decoder part on ``inputs_embeds``), later
stages as for a text model; the in-process pipeline runner gives PyTorch's `K3ForConditionalGeneration` logits
(prefill + 8 decode steps) and greedy tokens for a prompt with two images of different sizes, and ``validate
--pipeline`` runs the ``image`` scenario. Also what `load_pipeline` refuses, and ``--text-only``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from k3export.modeling import tiny_vision_model
from k3export.modeling.contract import INPUT_IDS, INPUTS_EMBEDS
from k3export.pipeline import PipelineError, load_pipeline
from k3export.pipeline.runner import PipelineRunner
from k3export.runtime import greedy_decode
from k3export.runtime.loop import Images
from vision_helpers import MEDIA_PAD_ID, torch_reference, two_image_inputs, worst_against_reference

STEPS = 8
IMAGE_FILES = {"vision.onnx", "embedding.onnx", "preprocessor_config.json", "processor_config.json"}


def _cli(*args):
    from k3export_cli.main import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(model, its checkpoint folder, its 2-stage pipeline export written by the CLI)."""
    model = tiny_vision_model(seed=3)
    root = tmp_path_factory.mktemp("vl-pipeline")
    model.save_pretrained(root / "ckpt")
    _cli("export", root / "ckpt", root / "pipe", "--stages", "2", "--no-progress")
    return model, root / "ckpt", root / "pipe"


@pytest.fixture(scope="module")
def inputs():
    """Two images of different sizes in one chat-templated prompt, through the real processor."""
    return two_image_inputs()


def test_stage_0_holds_the_image_graphs(vl):
    _, _, pipe = vl
    p = load_pipeline(pipe)
    assert len(p.stages) == 2 and p.has_vision
    first, second = p.stages
    assert IMAGE_FILES <= {f.name for f in first.root.iterdir()}
    assert not IMAGE_FILES & {f.name for f in second.root.iterdir()} and not second.has_vision
    assert first.manifest.input_names[0] == INPUTS_EMBEDS and INPUT_IDS not in first.manifest.input_names
    rc = json.loads((first.root / "runtime_config.json").read_text())
    assert [g["role"] for g in rc["graphs"]] == ["vision", "embedding"]
    assert rc["media_placeholder_token_id"] == MEDIA_PAD_ID
    stage = json.loads((first.root / "stage.json").read_text())
    assert {"vision.onnx", "embedding.onnx"} <= set(stage["sha256"])
    assert "graphs" not in json.loads((second.root / "runtime_config.json").read_text())


def test_pipeline_matches_pytorch_prefill_and_decode(vl, inputs):
    model, _, pipe = vl
    want_logits, want_tokens = torch_reference(model, inputs, STEPS)
    runner = PipelineRunner(pipe)
    assert runner.takes_images
    worst = worst_against_reference(runner, inputs, want_logits, want_tokens, STEPS)
    assert worst < 1e-4, worst
    print(f"max |pipeline - PyTorch| logits over prefill + {STEPS} steps: {worst:.2e}")
    # the images reach stage 0: the same prompt without them decodes to other logits
    plain = greedy_decode(runner, inputs["input_ids"].numpy(), 0)
    assert not np.allclose(np.asarray(plain.last.logits)[:, -1], want_logits[0], atol=1e-3)
    # and the shared loop's greedy tokens are PyTorch's
    images = Images(inputs["pixel_values"], inputs["grid_thws"])
    assert greedy_decode(runner, inputs["input_ids"].numpy(), STEPS, images=images).tokens.tolist() == [want_tokens]


def test_a_placeholder_mismatch_is_refused(vl, inputs):
    from k3export.errors import K3ExportError

    ids = inputs["input_ids"].numpy()
    ids = np.delete(ids, np.flatnonzero(ids[0] == MEDIA_PAD_ID)[0], axis=1)
    with pytest.raises(K3ExportError, match="placeholder tokens"):
        greedy_decode(PipelineRunner(vl[2]), ids, 0, images=Images(inputs["pixel_values"], inputs["grid_thws"]))


def test_validate_runs_the_image_scenario_on_the_pipeline(vl, tmp_path):
    _, ckpt, pipe = vl
    _cli("validate", ckpt, "--pipeline", pipe, "--runtimes", "pipeline", "--steps", "6", "--prompt-len", "10",
         "--batch", "1", "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    image = next(s for s in report["scenarios"] if s["name"] == "image")
    assert len(image["image_grids"]) == 2 and image["results"] and all(r["passed"] for r in image["results"])
    assert "decode" in [s["name"] for s in report["scenarios"]]


def test_validate_runs_the_image_scenario_on_ray(vl, tmp_path, ray_cluster):
    _, ckpt, pipe = vl
    _cli("validate", ckpt, "--pipeline", pipe, "--runtimes", "ray", "--steps", "3", "--prompt-len", "10",
         "--batch", "1", "--report", tmp_path / "r.json")
    image = next(s for s in json.loads((tmp_path / "r.json").read_text())["scenarios"] if s["name"] == "image")
    assert [r["runtime"] for r in image["results"]] == ["ray"] and image["results"][0]["passed"]


def _copy(pipe, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(pipe, dst)
    return dst


def test_load_pipeline_refuses_a_changed_image_graph(vl, tmp_path):
    d = _copy(vl[2], tmp_path)
    graph = d / "stage-00" / "vision.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    model.doc_string += " (edited)"  # still a valid graph with the same I/O: only the digest can tell
    onnx.save(model, str(graph))
    with pytest.raises(PipelineError, match="vision.onnx: changed since") as info:
        load_pipeline(d)
    assert "\n" not in str(info.value)


def test_load_pipeline_refuses_image_graphs_outside_stage_0(vl, tmp_path):
    d = _copy(vl[2], tmp_path)
    stage0, stage1 = d / "stage-00", d / "stage-01"
    shutil.rmtree(stage1)  # stage 1 becomes a copy of stage 0's folder with stage 1's marker: a stage with images
    shutil.copytree(stage0, stage1)
    marker = json.loads((vl[2] / "stage-01" / "stage.json").read_text())
    (stage1 / "stage.json").write_text(json.dumps(marker))
    with pytest.raises(PipelineError, match="stage 1 lists image graphs") as info:
        load_pipeline(d)
    assert "\n" not in str(info.value)


def test_text_only_stages_of_the_image_checkpoint(vl, tmp_path):
    _, ckpt, _ = vl
    _cli("export", ckpt, tmp_path / "text", "--stages", "2", "--text-only", "--no-progress")
    p = load_pipeline(tmp_path / "text")
    assert not p.has_vision and not PipelineRunner(p).takes_images
    assert p.stages[0].manifest.input_names[0] == INPUT_IDS
    assert not IMAGE_FILES & {f.name for s in p.stages for f in s.root.iterdir()}


@pytest.mark.parametrize("edit", [False, True])
def test_an_interrupted_pipeline_keeps_its_finished_image_stage(vl, tmp_path, edit):
    """A run stopped after stage 0 (a checkpoint folder's pipeline resumes): the next run keeps stage 0, its image
    graphs checked against the sha256 stage.json recorded (an image graph changed since: stage 0 is written again),
    and writes stage 1."""
    from k3export.pipeline import export_pipeline
    from k3export.safety import partial_path

    _, ckpt, _ = vl

    def stop(line):
        raise KeyboardInterrupt(line)

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt, match="stage 1/2"):
        export_pipeline(ckpt, out, stages=2, progress=stop)
    if edit:
        graph = partial_path(out) / "stage-00" / "embedding.onnx"
        model = onnx.load(str(graph), load_external_data=False)
        model.doc_string += " (edited)"
        onnx.save(model, str(graph))
    lines: list[str] = []
    export_pipeline(ckpt, out, stages=2, progress=lines.append)
    assert ("kept from the interrupted run" in lines[0]) is not edit and "kept" not in lines[1]
    assert load_pipeline(out).has_vision


def _tensor_bytes(graph):
    """Bytes of a graph's external tensors, as its initializers reference them (shard padding left out)."""
    model = onnx.load(str(graph), load_external_data=False)
    return sum(int({e.key: e.value for e in t.external_data}.get("length", 0)) for t in model.graph.initializer)


def test_the_plan_counts_the_image_graphs_with_stage_0(vl):
    """The bytes the planner adds to stage 0 for the tower and projector are what stage 0's vision.onnx holds
    (fp32); the embedding graph's table is the embedding stage 0 already counts (its decoder part has none)."""
    from k3export.pipeline import layer_costs

    model, _, pipe = vl
    text, vision = model.config.text_config, model.config.vision_config
    extra = layer_costs(text, "fp32", vision_config=vision).first - layer_costs(text, "fp32").first
    stage0 = load_pipeline(pipe).stages[0]
    assert extra == _tensor_bytes(stage0.graph_paths["vision"]) > 0
    assert _tensor_bytes(stage0.graph_paths["embedding"]) == text.vocab_size * text.hidden_size * 4
    assert "model.embed_tokens.weight" not in {t.name for t in onnx.load(
        str(stage0.model_path), load_external_data=False).graph.initializer}


def test_the_ray_runner_matches_pytorch(vl, inputs, ray_cluster):
    """Stage 0's actor runs the image graphs; prefill + decode give PyTorch's logits and greedy tokens."""
    from k3export.errors import K3ExportError
    from k3export.pipeline.ray_runner import RayPipelineRunner

    model, _, pipe = vl
    want_logits, want_tokens = torch_reference(model, inputs, STEPS)
    runner = RayPipelineRunner(pipe)
    try:
        assert runner.takes_images
        worst = worst_against_reference(runner, inputs, want_logits, want_tokens, STEPS)
        assert worst < 1e-4, worst
        print(f"max |ray - PyTorch| logits over prefill + {STEPS} steps: {worst:.2e}")
        from k3export.runtime.torch_runner import TorchRunner
        from k3export.validate.localise import vision_stage_outputs

        images = Images(inputs["pixel_values"].numpy(), inputs["grid_thws"].numpy())
        want = vision_stage_outputs(TorchRunner(model), images)  # localisation: stage 0's actor exposes its stages
        got = vision_stage_outputs(runner, images)
        assert sorted(got) == sorted(want)
        assert all(np.linalg.norm(got[s] - w) < 1e-4 * np.linalg.norm(w) for s, w in want.items())
        bad = inputs["input_ids"].numpy().copy()
        bad[0, np.flatnonzero(bad[0] == MEDIA_PAD_ID)[0]] = 4  # one placeholder fewer than the images' tokens
        with pytest.raises(K3ExportError, match="placeholder tokens") as info:
            greedy_decode(runner, bad, 0, images=images)
        assert "\n" not in str(info.value)
    finally:
        runner.close()


def test_the_ray_runner_splits_an_image_batch_into_micro_batches(vl, inputs, ray_cluster):
    """Two rows, each the two-image prompt, cut into one micro-batch per row: each row gets its own images' features
    (batch row-major, as PyTorch splices them)."""
    import torch

    from k3export.modeling import K3Cache
    from k3export.pipeline.ray_runner import RayPipelineRunner

    model, _, pipe = vl
    ids = inputs["input_ids"].repeat(2, 1)
    pixels, grids = inputs["pixel_values"], inputs["grid_thws"]
    pixels2, grids2 = torch.cat([pixels, 0.5 * pixels]), torch.cat([grids, grids])  # row 1: dimmer images
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=pixels2, grid_thws=grids2, cache=K3Cache(model.config.text_config),
                     use_cache=True).logits[:, -1].numpy()
    runner = RayPipelineRunner(pipe, micro_batches=2)
    try:
        got = greedy_decode(runner, ids.numpy(), 0, images=Images(pixels2.numpy(), grids2.numpy())).last.logits
    finally:
        runner.close()
    got = np.asarray(got)[:, -1]
    assert np.abs(got - want).max() < 1e-4 and np.abs(want[0] - want[1]).max() > 1e-3
