"""The tokenizer travels: convert copies the tiktoken files, export writes tokenizer.json (transformers) and what
onnxruntime-genai reads; og.Tokenizer encodes and decodes like the transformers tokenizer beside it, and both like
tiktoken (how the released tokenization_kimi.py encodes)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from genai_fixtures import CHAT_TEMPLATE, VOCAB, tiktoken_encoding

og = pytest.importorskip("onnxruntime_genai")

#: text where genai_tokenizer/ splits exactly as Kimi's pattern: every script but Han / kana boundaries, and
#: Chinese whose Han runs sit in U+4E00-U+9FA5 with at most one space before them
TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog. It's 2026!", "I'M FINE, you're WE'LL they'd",
    "MixedCASE HTTPServer isn't 123456789 3.14159 1,000,000", "  leading spaces\t\ttabs\r\nCRLF\n\n\nend   ",
    "def forward(self, x):\n    return self.proj(x) * 2  # comment\n", "Ünïcödé façade naïve café Привет мир Ωμέγα",
    "emoji 🙂🚀 and ≈ç√ ∑ and 한국어", "你好世界，这是一个测试。我们的模型支持中文。", "使用 Python 编程，Kimi 很好用！",
    "abc你好def", "(括号)「引号」", "<|im_user|>user<|im_middle|>hi<|im_end|>", "[BOS]x[EOS] [PAD]", "a" * 300,
    "You are Kimi, an AI assistant.", "",
]


@pytest.fixture(scope="module")
def hf(tok_export):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_export)


@pytest.fixture(scope="module")
def ogt(tok_export):
    return og.Tokenizer(og.Model(str(tok_export)))


@pytest.fixture(scope="module")
def enc(kimi_tokenizer_dir):
    return tiktoken_encoding(kimi_tokenizer_dir)


def test_convert_copies_the_source_files(tok_checkpoint, kimi_tokenizer_dir):
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        assert (tok_checkpoint / name).read_bytes() == (kimi_tokenizer_dir / name).read_bytes()


def test_export_writes_transformers_and_genai_files(tok_export):
    from k3export.genai import read_genai_config

    for rel in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "genai_tokenizer/tokenizer.json",
                "genai_tokenizer/tokenizer_config.json"):
        assert (tok_export / rel).is_file(), rel
    assert read_genai_config(tok_export)["model"]["tokenizer_dir"] == "genai_tokenizer"
    assert json.loads((tok_export / "genai_tokenizer/tokenizer_config.json").read_text())["chat_template"] == \
        CHAT_TEMPLATE


def test_kimi_pattern_is_not_loadable_by_genai(tok_export, tmp_path):
    """The fact behind genai_tokenizer/: genai 0.18 refuses the HF tokenizer.json of a Kimi tokenizer."""
    import shutil

    for name in ("genai_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_export / name, tmp_path / name)
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    del cfg["model"]["tokenizer_dir"]
    (tmp_path / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="Invalid regex"):
        og.Tokenizer(og.Config(str(tmp_path)))


@pytest.mark.parametrize("text", TEXTS)
def test_og_encodes_like_transformers_and_tiktoken(text, hf, ogt, enc):
    want = enc.encode(text, allowed_special="all")
    assert hf.encode(text, add_special_tokens=False) == want
    assert ogt.encode(text).tolist() == want


def test_checkpoint_tokenizer_equals_export_tokenizer(tok_checkpoint, hf, enc):
    from k3export.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_checkpoint, VOCAB)
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_og_decodes_like_transformers(hf, ogt, enc):
    for text in TEXTS:
        ids = enc.encode(text, allowed_special="all")
        assert ogt.decode(np.asarray(ids, np.int32)) == hf.decode(ids, skip_special_tokens=True)
        stream, out = ogt.create_stream(), ""
        for t in ids:
            out += stream.decode(t)
        assert out == hf.decode(ids, skip_special_tokens=True)
    # every BPE token that is valid UTF-8 on its own (genai ends its text at a NUL byte: token 0 is left out; a
    # lone special token decodes to U+FFFD in genai, to "" in transformers, so specials are checked in TEXTS)
    for i in range(1, len(enc._mergeable_ranks)):
        piece = hf.decode([i], skip_special_tokens=True)
        if "\ufffd" not in piece:
            assert ogt.decode(np.asarray([i], np.int32)) == piece, i


def test_special_tokens_and_chat_template(tok_export, hf, ogt, tok_model):
    cfg = tok_model.config
    assert ogt.bos_token_id == cfg.bos_token_id and list(ogt.eos_token_ids) == [cfg.eos_token_id]
    assert ogt.pad_token_id == cfg.pad_token_id
    assert hf.pad_token_id == cfg.pad_token_id
    messages = [{"role": "user", "content": "Hello, Kimi"}]
    a = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    b = ogt.apply_chat_template(json.dumps(messages), add_generation_prompt=True)
    assert a == b and a.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert ogt.encode(b).tolist() == hf.encode(a, add_special_tokens=False)


def test_genai_differences_are_the_documented_ones(hf, ogt, enc):
    """genai_tokenizer/ splits two spaces before a Han run differently (GENAI_DIFFERENCES); pinned so that the
    documentation stays true (and fails once genai learns \\p{Han})."""
    text = "  你好"
    assert hf.encode(text, add_special_tokens=False) == enc.encode(text)
    pieces = [enc.decode([t]) for t in ogt.encode(text).tolist()]
    assert pieces[0] == "  " and [enc.decode([t]) for t in enc.encode(text)][:2] == [" ", " "]


def test_tokenizer_errors_name_the_file(tmp_path):
    from k3export.tokenizer import TokenizerError, read_tokenizer_source, write_export_tokenizer

    assert write_export_tokenizer(tmp_path, tmp_path / "out") == []  # no tokenizer: nothing written
    (tmp_path / "tiktoken.model").write_text("QQ== 0\nQg== 5\n")
    with pytest.raises(TokenizerError, match="tiktoken.model: ranks are not"):
        read_tokenizer_source(tmp_path)
    (tmp_path / "tiktoken.model").write_text("not base64!! 0\n")
    with pytest.raises(TokenizerError, match="line 1"):
        read_tokenizer_source(tmp_path)
    (tmp_path / "tiktoken.model").write_text("QQ== 0\nQg== 1\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[NOPE]"}))
    with pytest.raises(TokenizerError, match="bos_token"):
        read_tokenizer_source(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"300": {"content": "[X]"}}}))
    with pytest.raises(TokenizerError, match="vocab_size 100"):
        write_export_tokenizer(tmp_path, tmp_path / "out", vocab_size=100)
