"""`k3export generate ... --image` through the Typer app: a tiny image + text checkpoint (with a word-level
tokenizer and its processor files) on torch and its ONNX export on ort and genai print the same text, which is the
greedy text of `K3ForConditionalGeneration` run directly on the processor's inputs; bad inputs are one `error:` line."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from typer.testing import CliRunner

from k3export.converters.onnx import export_onnx
from k3export.modeling import K3ImageProcessor, K3Processor, tiny_model, tiny_vision_model
from vision_helpers import MEDIA_PAD_ID, random_image, tiny_tokenizer, torch_reference

PROMPT = "what is in this picture ?"
NEW = 8
#: the tokenizer's plain words (ids 4..13): the only rows of lm_head left, so the greedy text is all words
WORDS = range(4, 14)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate-image")
    model = tiny_vision_model(seed=3)
    with torch.no_grad():  # greedy picks words only: a token the word-level tokenizer cannot print is never chosen
        keep = torch.zeros(model.config.text_config.vocab_size, dtype=torch.bool)
        keep[list(WORDS)] = True
        model.language_model.lm_head.weight[~keep] = 0.0
        model.language_model.lm_head.weight[keep] *= 10.0  # so a word's logit beats the zeroed rows' 0
    ckpt = root / "ckpt"
    model.save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    ip = K3ImageProcessor(patch_size=4, in_patch_limit=24, patch_limit_on_one_side=8, max_frames_per_chunk=2)
    K3Processor(ip, media_placeholder_token_id=MEDIA_PAD_ID).save_pretrained(ckpt)
    images = [root / "wide.png", root / "tall.png"]
    random_image(20, 12, 1).save(images[0])
    random_image(9, 17, 2).save(images[1])
    export = root / "onnx"
    export_onnx(str(ckpt), export)
    text_only = root / "text"
    export_onnx(tiny_model(seed=0), text_only)
    return model, ckpt, export, text_only, images, ip


def _generate(*args) -> tuple[int, str]:
    from k3export_cli.main import app

    res = CliRunner().invoke(app, ["generate", *map(str, args)])
    return res.exit_code, res.stdout if res.exit_code == 0 else res.output


def _reference_text(model, ip, images) -> str:
    """Greedy text of the PyTorch model on the processor's inputs (placeholders in front of the prompt)."""
    tok = tiny_tokenizer()
    proc = K3Processor(ip, tok, media_placeholder_token_id=MEDIA_PAD_ID)
    inputs = proc(text="<|kimi_image_placeholder|>" * len(images) + PROMPT, images=[str(p) for p in images])
    _, tokens = torch_reference(model, inputs, NEW - 1)  # NEW tokens: the prefill's, then NEW - 1 steps'
    assert all(t in WORDS for t in tokens)
    return tok.decode(tokens, skip_special_tokens=True)


def test_torch_and_ort_print_the_reference_text(folders):
    model, ckpt, export, _, images, ip = folders
    want = _reference_text(model, ip, images)
    assert want.strip()
    image_args = [a for p in images for a in ("--image", p)]
    runtimes = [(ckpt, "torch"), (export, "ort")]
    if importlib.util.find_spec("onnxruntime_genai") is not None:
        runtimes.append((export, "genai"))
    for folder, runtime in runtimes:
        code, out = _generate(folder, PROMPT, "--runtime", runtime, "--max-new-tokens", NEW, *image_args)
        assert code == 0, out
        assert out.strip() == want.strip(), runtime
    # one image fewer gives another prompt and, here, another text: the images are read
    code, out = _generate(export, PROMPT, "--max-new-tokens", NEW, "--image", images[0])
    assert code == 0 and out.strip() != want.strip()


@pytest.mark.parametrize("case, phrase", [
    ("missing", "no-such.png"),
    ("text-only", "text-only export cannot take images"),
    ("chunk", "prefill-chunk"),
])
def test_bad_image_requests_are_one_line(folders, case, phrase, tmp_path):
    _, ckpt, export, text_only, images, _ = folders
    args = {"missing": [export, PROMPT, "--image", tmp_path / "no-such.png"],
            "text-only": [text_only, PROMPT, "--image", images[0]],
            "chunk": [export, PROMPT, "--prefill-chunk", 2, "--image", images[0]]}[case]
    code, out = _generate(*args)
    assert code == 2, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and phrase in lines[0], out


def test_export_cli_writes_the_image_graphs_whole_and_with_stage_0(folders, tmp_path):
    from k3export_cli.main import app

    _, ckpt, _, _, _, _ = folders
    res = CliRunner().invoke(app, ["export", str(ckpt), str(tmp_path / "out"), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "vision.onnx, embedding.onnx" in res.stdout
    assert (tmp_path / "out" / "vision.onnx").is_file() and (tmp_path / "out" / "embedding.onnx").is_file()
    assert (tmp_path / "out" / "genai_config.json").is_file()
    res = CliRunner().invoke(app, ["export", str(ckpt), str(tmp_path / "pipe"), "--no-progress", "--stages", "2"])
    assert res.exit_code == 0, res.output
    assert sorted(p.parent.name for p in (tmp_path / "pipe").glob("*/vision.onnx")) == ["stage-00"]


@pytest.fixture(scope="module")
def inlined_export(folders, tmp_path_factory):
    """The checkpoint's export in the inlined graph form, the one OpenVINO reads."""
    ckpt = folders[1]
    out = tmp_path_factory.mktemp("generate-image-inlined") / "onnx"
    export_onnx(str(ckpt), out, form="inlined")
    return out


@pytest.mark.parametrize("runtime", ["openvino", "onnx-reference"])
def test_openvino_and_the_reference_evaluator_print_the_reference_text(folders, inlined_export, runtime):
    if runtime == "openvino" and importlib.util.find_spec("openvino") is None:
        pytest.skip("openvino is not installed (pip install 'k3export[openvino]')")
    model, _, _, _, images, ip = folders
    want = _reference_text(model, ip, images)
    image_args = [a for p in images for a in ("--image", p)]
    code, out = _generate(inlined_export, PROMPT, "--runtime", runtime, "--max-new-tokens", NEW, *image_args)
    assert code == 0, out
    assert out.strip() == want.strip()
