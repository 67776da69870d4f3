"""onnxruntime-genai runs an image + text export: genai_config.json's vision and embedding sections (written by
`export_onnx`, checked by `k3export.genai.check_export`), the processor's tensors handed over with
``Generator.set_inputs`` (genai cannot express MoonViT's preprocessing), and genai's greedy tokens are PyTorch's
`K3ForConditionalGeneration` tokens for a prompt with two images of different sizes."""

from __future__ import annotations

import json

import pytest

from k3export.genai import GenaiError, VISION_MODEL_TYPE, check_export, vision_inputs
from k3export.modeling.contract import INPUTS_EMBEDS

og = pytest.importorskip("onnxruntime_genai")

from test_vision_export_e2e import STEPS, export, inputs, model  # noqa: E402,F401  (fixtures)
from vision_helpers import torch_reference  # noqa: E402


def test_config_has_the_image_sections(export):
    cfg = check_export(export)
    m = cfg["model"]
    assert m["type"] == VISION_MODEL_TYPE
    assert m["vision"]["filename"] == "vision.onnx" and m["embedding"]["filename"] == "embedding.onnx"
    assert m["decoder"]["inputs"]["inputs_embeds"] == INPUTS_EMBEDS and "input_ids" not in m["decoder"]["inputs"]


def test_genai_greedy_tokens_equal_pytorch(model, export, inputs):
    want = torch_reference(model, inputs, STEPS)[1]
    ids = inputs["input_ids"].numpy()
    gm = og.Model(str(export))
    params = og.GeneratorParams(gm)
    params.set_search_options(max_length=ids.shape[1] + STEPS + 1)
    gen = og.Generator(gm, params)
    named = og.NamedTensors()
    feeds = vision_inputs(ids, inputs["pixel_values"], inputs["grid_thws"],
                          model.config.vision_config.merge_kernel_size)
    from vision_helpers import MEDIA_PAD_ID

    assert feeds["num_image_tokens"].sum() == (ids == MEDIA_PAD_ID).sum() and len(feeds["num_image_tokens"]) == 2
    for name, value in feeds.items():
        named[name] = value
    gen.set_inputs(named)
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    assert got == want


def test_check_export_names_a_bad_section(export, tmp_path):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(export, d)
    path = d / "genai_config.json"
    cfg = json.loads(path.read_text())
    cfg["model"]["vision"]["inputs"]["image_grid_thw"] = "grid"
    path.write_text(json.dumps(cfg))
    with pytest.raises(GenaiError, match="model.vision.inputs.image_grid_thw 'grid'"):
        check_export(d)
