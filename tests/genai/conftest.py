"""Fixtures for the onnxruntime-genai tests: the Kimi-style tokenizer, a tiny K3 checkpoint that carries it, and
that model's export with genai_config.json and the tokenizer files (helpers in genai_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("onnxruntime_genai")

from genai_fixtures import VOCAB, export_for_genai, write_kimi_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def kimi_tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "kimi"
    write_kimi_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tok_model(kimi_tokenizer_dir):
    """A tiny random K3 whose bos / eos / pad are the tokenizer's [BOS], <|im_end|>, [PAD]."""
    from k3export.modeling import tiny_model
    from k3export.tokenizer import read_tokenizer_source

    sp = read_tokenizer_source(kimi_tokenizer_dir, VOCAB).specials
    return tiny_model(0, vocab_size=VOCAB, bos_token_id=sp["[BOS]"], eos_token_id=sp["<|im_end|>"],
                      pad_token_id=sp["[PAD]"])


@pytest.fixture(scope="session")
def tok_checkpoint(tok_model, kimi_tokenizer_dir, tmp_path_factory) -> Path:
    """The tiny model saved as a checkpoint with the tokenizer files beside it (what `convert` writes)."""
    from k3export.modeling import save_pretrained
    from k3export.tokenizer import copy_tokenizer_files

    path = tmp_path_factory.mktemp("ckpt") / "model"
    save_pretrained(tok_model, path)
    copy_tokenizer_files(kimi_tokenizer_dir, path)
    return path


@pytest.fixture(scope="session")
def tok_export(tok_model, tok_checkpoint, tmp_path_factory) -> Path:
    return export_for_genai(tok_model, tok_checkpoint, tmp_path_factory.mktemp("export") / "onnx")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
