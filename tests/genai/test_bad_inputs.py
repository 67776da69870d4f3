"""Broken tokenizer files, chat templates and genai_config.json fields are refused where they are read (export and
generate alike), as one line naming the file and field; generate's folder options are refused when they would be
ignored."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from genai_fixtures import VOCAB


def _generate(*args: str) -> tuple[int, str]:
    from k3export_cli.main import app

    res = CliRunner().invoke(app, ["generate", *args, "--max-new-tokens", "2"])
    return res.exit_code, res.output


def _one_error(code: int, out: str, *parts: str) -> None:
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), out
    assert "internal error" not in out and all(p in lines[0] for p in parts), (parts, out)


@pytest.fixture
def tok(kimi_tokenizer_dir, tmp_path):
    """A copy of the Kimi-style tokenizer folder, to break."""
    return shutil.copytree(kimi_tokenizer_dir, tmp_path / "tok")


@pytest.fixture
def ckpt(tok_checkpoint, tmp_path):
    """A copy of the tokenizer-bearing checkpoint, to break."""
    return shutil.copytree(tok_checkpoint, tmp_path / "ckpt")


@pytest.fixture
def export(tok_export, tmp_path):
    """A copy of that checkpoint's export (tokenizer.json, genai_config.json, genai_tokenizer/), to break."""
    return shutil.copytree(tok_export, tmp_path / "onnx")


# ---------------------------------------------------------------------------------------------- tokenizer files
def test_empty_tiktoken_model_is_refused(tok, tmp_path):
    from k3export.tokenizer import TokenizerError, load_tokenizer, write_export_tokenizer

    (tok / "tiktoken.model").write_bytes(b"")
    with pytest.raises(TokenizerError, match=f"{tok / 'tiktoken.model'}: no tokens"):
        write_export_tokenizer(tok, tmp_path / "out", vocab_size=VOCAB)
    with pytest.raises(TokenizerError, match="tiktoken.model: no tokens"):
        load_tokenizer(tok, VOCAB)
    assert not (tmp_path / "out" / "tokenizer.json").exists()


BROKEN = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"  # line 2: '}' where '}}' closes


def test_broken_chat_template_names_the_file_and_line(tok, tmp_path):
    from k3export.tokenizer import TokenizerError, load_tokenizer, write_export_tokenizer

    (tok / "chat_template.jinja").write_text(BROKEN)
    for call in (lambda: write_export_tokenizer(tok, tmp_path / "out", vocab_size=VOCAB),
                 lambda: load_tokenizer(tok, VOCAB)):
        with pytest.raises(TokenizerError, match=f"{tok / 'chat_template.jinja'}: chat template line 2: "):
            call()
    (tok / "chat_template.jinja").unlink()
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "x\ny\n{% if %}"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json \(field chat_template\): chat template line 3"):
        load_tokenizer(tok, VOCAB)


def test_chat_template_is_compiled_as_transformers_does(tok):
    """transformers' {% generation %} tag (its AssistantTracker extension) parses; and the loaded template works."""
    from k3export.tokenizer import chat_prompt, load_tokenizer

    (tok / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    assert chat_prompt(load_tokenizer(tok, VOCAB), "hi") == "hi"


def test_generate_refuses_a_broken_template(ckpt):
    (ckpt / "chat_template.jinja").write_text(BROKEN)
    _one_error(*_generate(str(ckpt), "hi", "--chat"), str(ckpt / "chat_template.jinja"), "line 2")


def test_special_token_outside_the_vocabulary_is_refused_by_generate_as_by_export(ckpt, tmp_path):
    from k3export_cli.main import app

    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["9999"] = {"content": "[X]", "special": True}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    expected = (str(ckpt / "tokenizer_config.json"), "id 9999 ('[X]')", f"vocab_size {VOCAB}")
    _one_error(*_generate(str(ckpt), "hi"), *expected)
    res = CliRunner().invoke(app, ["export", str(ckpt), str(tmp_path / "out")])
    _one_error(res.exit_code, res.output, *expected)


@pytest.mark.parametrize("text,why", [('{"x":', "not JSON"), ('{"x": 1}', "not a tokenizers tokenizer.json"),
                                      ("[1, 2]", "expected a JSON object")])
def test_unreadable_tokenizer_json_names_the_file(export, text, why):
    (export / "tokenizer.json").write_text(text)
    _one_error(*_generate(str(export), "hi"), str(export / "tokenizer.json"), why)


def test_tokenizer_json_id_outside_the_vocabulary_is_refused(export):
    from k3export.tokenizer import TokenizerError, load_tokenizer

    data = json.loads((export / "tokenizer.json").read_text())
    data["added_tokens"][-1]["id"] = VOCAB + 7
    (export / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match=f"token id {VOCAB + 7}, outside the model's vocab_size {VOCAB}"):
        load_tokenizer(export, VOCAB)


# ---------------------------------------------------------------------------------------------- genai_config.json
@pytest.mark.parametrize("edit,field,expected", [
    (lambda c: c["model"].update(vocab_size="512"), "model.vocab_size", "a non-negative integer"),
    (lambda c: c["model"].update(bos_token_id=-1), "model.bos_token_id", "a non-negative integer"),
    (lambda c: c["model"].update(pad_token_id=VOCAB), "model.pad_token_id",
     f"a token id in [0, vocab_size) = [0, {VOCAB})"),
    (lambda c: c["model"].update(eos_token_id=[]), "model.eos_token_id", "a token id or a non-empty list"),
    (lambda c: c["model"].update(eos_token_id=[1, "2"]), "model.eos_token_id", "a token id or"),
    (lambda c: c["model"]["decoder"].update(hidden_size=0), "model.decoder.hidden_size", "a positive integer"),
    (lambda c: c["model"]["decoder"]["inputs"].update(input_ids=3), "model.decoder.inputs.input_ids", "a string"),
    (lambda c: c["search"].update(do_sample="no"), "search.do_sample", "true or false"),
    (lambda c: c["search"].update(top_k=1.5), "search.top_k", "an integer"),
    (lambda c: c["search"].update(max_length=True), "search.max_length", "an integer"),
    (lambda c: c["search"].update(temperature="1"), "search.temperature", "a number"),
])
def test_genai_config_types_are_checked(tok_model, tmp_path, edit, field, expected):
    from k3export.genai import GENAI_CONFIG_FILE, GenaiError, read_genai_config, write_genai_config

    path = write_genai_config(tmp_path, tok_model.config)
    data = json.loads(path.read_text())
    assert read_genai_config(tmp_path) == data  # as written: every type right
    data["search"]["temperature"] = 1  # an integer is a number
    path.write_text(json.dumps(data))
    read_genai_config(tmp_path)
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(GenaiError) as info:
        read_genai_config(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / GENAI_CONFIG_FILE}: field {field} must be {expected}"), info.value


def test_generate_genai_names_a_wrong_type(export):
    cfg = json.loads((export / "genai_config.json").read_text())
    cfg["model"]["vocab_size"] = "x"
    (export / "genai_config.json").write_text(json.dumps(cfg))
    _one_error(*_generate(str(export), "hi", "--runtime", "genai"), str(export / "genai_config.json"),
               "model.vocab_size", '"x"')


def test_generate_genai_chat_parses_the_template_genai_reads(export):
    from k3export.genai import read_genai_config

    tok_dir = export / read_genai_config(export)["model"].get("tokenizer_dir", ".")
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": BROKEN}))
    (tok_dir / "chat_template.jinja").unlink(missing_ok=True)
    _one_error(*_generate(str(export), "hi", "--runtime", "genai", "--chat"), str(tok_dir / "tokenizer_config.json"),
               "line 2")


# ---------------------------------------------------------------------------------------------- generate's options
def test_model_and_onnx_options_are_refused_when_they_would_be_ignored(tok_checkpoint, tok_export, tmp_path):
    ckpt, onnx = str(tok_checkpoint), str(tok_export)
    missing = str(tmp_path / "nonexist")
    _one_error(*_generate(onnx, "hi", "--model", missing), f"--model {missing}: not a folder")
    _one_error(*_generate(ckpt, "hi", "--runtime", "ort", "--onnx", missing), f"--onnx {missing}: not a folder")
    _one_error(*_generate(onnx, "hi", "--runtime", "genai", "--model", ckpt), "--model is not used by runtime genai")
    _one_error(*_generate(ckpt, "hi", "--model", ckpt), "--model is for an ONNX export")
    _one_error(*_generate(onnx, "hi", "--onnx", onnx), "--onnx is for a checkpoint")
    _one_error(*_generate(onnx, "hi", "--model", onnx), f"--model {onnx}: expected a checkpoint folder")
    _one_error(*_generate(ckpt, "hi", "--runtime", "ort", "--onnx", ckpt), f"--onnx {ckpt}: expected a k3export ONNX")
    code, out = _generate(onnx, "hi", "--model", ckpt)  # the checkpoint's config gives the eos: meaningful
    assert code == 0, out
