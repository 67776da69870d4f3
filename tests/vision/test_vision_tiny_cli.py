"""`k3export tiny OUT --vision` through the Typer app: a tiny random image + text checkpoint in the released layout
(K3's media tokens in its tokenizer, the processor files) that `K3ForConditionalGeneration.from_pretrained` loads;
`export` makes it an image + text export, and `generate --image` on torch, ort and genai prints the greedy text of
the PyTorch model run directly on the processor's inputs."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from k3export.modeling import K3ForConditionalGeneration, K3Processor
from k3export_cli.main import app
from vision_helpers import random_image, torch_reference

PROMPT = "What is in this picture?"
NEW = 8


def _invoke(*args) -> str:
    res = CliRunner().invoke(app, [*map(str, args)])
    assert res.exit_code == 0, res.output
    return res.stdout


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vision")
    ckpt, export = root / "ckpt", root / "onnx"
    out = _invoke("tiny", ckpt, "--vision", "--seed", 4)
    assert "--image" in out
    _invoke("export", ckpt, export, "--no-progress")
    images = [root / "cat.png", root / "dog.png"]
    random_image(64, 48, 1).save(images[0])
    random_image(30, 70, 2).save(images[1])
    return ckpt, export, images


def _reference_text(ckpt, image) -> str:
    """Greedy text of `K3ForConditionalGeneration` on the processor's inputs (the placeholder before the prompt, as
    `generate` puts it), stopping at eos, decoded without special tokens."""
    model = K3ForConditionalGeneration.from_pretrained(ckpt).eval()
    proc = K3Processor.from_pretrained(ckpt)  # transformers' AutoTokenizer of the folder
    inputs = proc(text=proc.image_placeholder + PROMPT, images=[str(image)])
    _, tokens = torch_reference(model, inputs, NEW - 1)
    eos = model.config.text_config.eos_token_id
    tokens = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens  # generate stops at eos
    return proc.tokenizer.decode(tokens, skip_special_tokens=True)


def test_tiny_vision_checkpoint_loads_with_its_media_tokens(folders):
    ckpt, export, _ = folders
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and "vision_config" in config
    model = K3ForConditionalGeneration.from_pretrained(ckpt)
    pid = model.config.media_placeholder_token_id
    proc = K3Processor.from_pretrained(ckpt)
    assert proc.media_placeholder_token_id == pid
    assert proc.tokenizer.convert_tokens_to_ids("<|media_pad|>") == pid < model.config.text_config.vocab_size
    assert len(proc.tokenizer) == model.config.text_config.vocab_size
    assert any(n.startswith("vision_tower.") for n, _ in model.named_parameters())
    rc = json.loads((export / "runtime_config.json").read_text())
    assert [g["model_file"] for g in rc["graphs"]] == ["vision.onnx", "embedding.onnx"]
    assert rc["media_placeholder_token_id"] == pid


def test_generate_with_an_image_prints_the_pytorch_text(folders):
    ckpt, export, images = folders
    want = _reference_text(ckpt, images[0])
    assert want.strip()
    runtimes = [(ckpt, "torch"), (export, "ort")]
    if importlib.util.find_spec("onnxruntime_genai") is not None:
        runtimes.append((export, "genai"))
    for folder, runtime in runtimes:
        out = _invoke("generate", folder, PROMPT, "--runtime", runtime, "--max-new-tokens", NEW, "--image", images[0])
        assert out.strip() == want.strip(), runtime
    # another image gives another text: the image is read
    other = _invoke("generate", export, PROMPT, "--max-new-tokens", NEW, "--image", images[1])
    assert other.strip() == _reference_text(ckpt, images[1]).strip() != want.strip()


def test_tiny_vision_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    res = CliRunner().invoke(app, ["tiny", str(tmp_path), "--vision"])
    assert res.exit_code == 2 and (tmp_path / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "config.json").exists()
    assert np.array_equal(sorted(p.name for p in tmp_path.iterdir()), ["notes.txt"])
