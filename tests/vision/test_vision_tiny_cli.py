"""`k3export tiny OUT --vision` through the Typer app: a tiny random image + text checkpoint in the released layout
(K3's media tokens in its tokenizer, the processor files) that `K3ForConditionalGeneration.from_pretrained` loads;
`export` makes it an image + text export, and `generate --image` on torch, ort and genai prints the greedy text of
the PyTorch model run directly on the processor's inputs. The chat template that `tiny` writes (and `convert` and
`export` carry) renders image parts as placeholders: the docs/vision.md example runs as written on each folder, and
its greedy tokens, like `generate --chat --image`'s text, are those of a prompt written with the placeholder by
hand."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from k3export.modeling import K3ForConditionalGeneration, K3Processor
from k3export_cli.main import app
from vision_helpers import random_image, torch_reference

PROMPT = "What is in this picture?"
NEW = 8
#: the docs example's prompt through Kimi's turn format, its image placeholder written by hand
CHAT_PROMPT = ("<|im_user|>user<|im_middle|><|kimi_image_placeholder|>What is in this picture?<|im_end|>"
               "<|im_assistant|>assistant<|im_middle|>")


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


def _reference_text(ckpt, image, text: str | None = None) -> str:
    """Greedy text of `K3ForConditionalGeneration` on the processor's inputs for `text` (default: the placeholder
    before the prompt, as `generate` puts it), stopping at eos, decoded without special tokens."""
    model = K3ForConditionalGeneration.from_pretrained(ckpt).eval()
    proc = K3Processor.from_pretrained(ckpt)  # transformers' AutoTokenizer of the folder
    inputs = proc(text=proc.image_placeholder + PROMPT if text is None else text, images=[str(image)])
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


@pytest.fixture(scope="module")
def converted(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-vision-converted") / "ckpt"
    _invoke("convert", folders[0], out)
    return out


def _docs_example(folder, image, *, model: bool = True) -> dict:
    """The docs/vision.md example that applies the chat template, run as written on `folder` and `image` (its
    names), generating `NEW` tokens (eager decode of the tiny model costs ~0.1 s a token here). Without `model`
    (an export), its processor lines alone."""
    docs = (Path(__file__).parents[2] / "docs" / "vision.md").read_text(encoding="utf-8")
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", docs, re.S) if "apply_chat_template" in b]
    names = {'"path/to/Kimi-K3"': repr(str(folder)), '"cat.png"': repr(str(image)), "max_new_tokens=32":
             f"max_new_tokens={NEW}"}
    for name, value in names.items():
        assert name in code, (name, code)
        code = code.replace(name, value)
    if not model:
        code = "\n".join(line for line in code.splitlines() if not line.startswith(("model =", "out =")))
    scope: dict = {}
    exec(compile(code, "docs/vision.md", "exec"), scope)  # noqa: S102 - the repository's own docs
    return scope


def test_the_docs_chat_example_runs_as_written_on_tiny_convert_and_export(folders, converted):
    from k3export.runtime import greedy_decode
    from k3export.runtime.loop import Images
    from k3export.runtime.ort_runner import OrtRunner

    ckpt, export, images = folders
    for folder in (ckpt, converted):  # the converted folder holds bf16 weights: its own reference
        scope = _docs_example(folder, images[0])
        model = scope["model"]
        by_hand = K3Processor.from_pretrained(folder)(text=CHAT_PROMPT, images=[str(images[0])])
        assert scope["inputs"]["input_ids"].tolist() == by_hand["input_ids"].tolist(), folder
        want = torch_reference(model, by_hand, NEW - 1)[1]  # K3Cache prefill + greedy, not transformers' generate
        new = scope["out"][0, by_hand["input_ids"].shape[1]:].tolist()
        eos = model.config.text_config.eos_token_id
        assert new and new == want[:len(new)] and (len(new) == NEW or new[-1] == eos), folder
        if folder == ckpt:
            want_ckpt = want
    assert (export / "chat_template.jinja").read_text() == (ckpt / "chat_template.jinja").read_text()
    scope = _docs_example(export, images[0], model=False)
    inputs = scope["inputs"]
    assert inputs["input_ids"].tolist() == by_hand["input_ids"].tolist()
    runner = OrtRunner(export)
    try:
        got = greedy_decode(runner, inputs["input_ids"].numpy(), NEW - 1,
                            images=Images(inputs["pixel_values"].numpy(), inputs["grid_thws"].numpy()))
    finally:
        runner.close()
    assert got.tokens[0].tolist() == want_ckpt[:NEW]
    if importlib.util.find_spec("onnxruntime_genai") is not None:  # genai renders the export's template alike
        import onnxruntime_genai as og

        tok = og.Tokenizer(og.Model(str(export)))
        assert tok.apply_chat_template(json.dumps(scope["messages"]), add_generation_prompt=True) == CHAT_PROMPT


def test_generate_chat_with_an_image_renders_an_image_part(folders):
    ckpt, export, images = folders
    want = _reference_text(ckpt, images[0], CHAT_PROMPT)
    assert want.strip() and want.strip() != _reference_text(ckpt, images[0]).strip()  # the chat turn is read
    runtimes = [(ckpt, "torch"), (export, "ort")]
    if importlib.util.find_spec("onnxruntime_genai") is not None:
        runtimes.append((export, "genai"))
    for folder, runtime in runtimes:
        out = _invoke("generate", folder, PROMPT, "--chat", "--runtime", runtime, "--max-new-tokens", NEW,
                      "--image", images[0])
        assert out.strip() == want.strip(), runtime


def test_the_tiny_chat_template_renders_content_lists(folders):
    """Text parts as text, image / image_url and video parts as the processor's placeholders in order, string
    content as it is; a part it cannot render is an error, not dropped."""
    import jinja2

    proc = K3Processor.from_pretrained(folders[0])
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text",
             "text": "b"}, {"type": "image"}, {"type": "video"}]
    got = proc.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}])
    assert got == ("<|im_system|>system<|im_middle|>be brief<|im_end|><|im_user|>user<|im_middle|>"
                   "a<|kimi_image_placeholder|>b<|kimi_image_placeholder|><|kimi_video_placeholder|><|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|>")
    with pytest.raises(jinja2.TemplateError, match="a message part of type input_audio"):
        proc.apply_chat_template([{"role": "user", "content": [{"type": "input_audio"}]}])


def test_generate_chat_refuses_a_template_that_writes_no_image_placeholder(folders, tmp_path):
    """A template that pastes the content as text (that of an older `k3export tiny`) is named in one line, before
    any model is loaded; a prompt holding the placeholder itself still runs through it."""
    import shutil

    ckpt, _, images = folders
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    (old / "chat_template.jinja").write_text(
        "{%- for message in messages -%}<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>"
        "{{ message['content'] }}<|im_end|>{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
    res = CliRunner().invoke(app, ["generate", str(old), PROMPT, "--chat", "--image", str(images[0])])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "the chat template wrote 0 <|kimi_image_placeholder|> for 1 image parts" in res.output
    out = _invoke("generate", old, "<|kimi_image_placeholder|>" + PROMPT, "--chat", "--max-new-tokens", NEW,
                  "--image", images[0])
    assert out.strip() == _reference_text(ckpt, images[0], CHAT_PROMPT).strip()
