"""What a new user meets first, through the real `k3export` command: the embedded default (`tiny`) takes text and
gives text through every runtime, a pipeline folder given as --onnx is named as such, and `info` shows a repeating
layer pattern as its runs."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3export.info import Run, repeating_runs

PROMPT = "Hello world, the model says hello. Ünïcödé 你好"


def _cli(*args: str | Path) -> tuple[int, str]:
    from k3export_cli.main import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.stdout if res.exit_code == 0 else res.output


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """`k3export tiny M`, then `k3export export M E`: the two folders a quick start makes."""
    root = tmp_path_factory.mktemp("newcomer")
    code, out = _cli("tiny", root / "M")
    assert code == 0, out
    code, out = _cli("export", root / "M", root / "E", "--no-progress")
    assert code == 0, out
    return root / "M", root / "E"


def test_tiny_writes_a_tokenizer_that_fits_the_model(tiny_dirs):
    from k3export.checkpoint_io import load_config
    from k3export.tokenizer import load_tokenizer

    ckpt, _ = tiny_dirs
    config = load_config(ckpt)
    tok = load_tokenizer(ckpt, config.vocab_size)
    vocab = tok.get_vocab()
    assert sorted(vocab.values()) == list(range(config.vocab_size))  # every logit row is a token, no id beyond
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (config.pad_token_id, config.bos_token_id,
                                                                      config.eos_token_id)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    assert tok.decode(ids) == PROMPT  # byte level: any text round-trips
    assert len(ids) < len(PROMPT.encode())  # and the merges learnt something: fewer tokens than bytes
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert all(tok.convert_tokens_to_ids(t) < config.vocab_size for t in ("<|im_user|>", "<|im_end|>"))


def test_the_tiny_tokenizer_is_the_same_every_time(tiny_dirs, tmp_path):
    ckpt, _ = tiny_dirs
    code, out = _cli("tiny", tmp_path / "again", "--seed", "7")
    assert code == 0, out
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "again" / name).read_bytes() == (ckpt / name).read_bytes(), name


@pytest.mark.parametrize("chat", [False, True])
def test_text_in_text_out_on_torch_and_ort(tiny_dirs, chat):
    """The checkpoint (PyTorch) and its export (ONNX Runtime) print the same greedy text."""
    ckpt, export = tiny_dirs
    flags = ["--max-new-tokens", "12"] + (["--chat"] if chat else [])
    torch_run = _cli("generate", ckpt, PROMPT, *flags)
    ort_run = _cli("generate", export, PROMPT, "--runtime", "ort", *flags)
    assert torch_run[0] == ort_run[0] == 0, (torch_run, ort_run)
    assert torch_run[1] == ort_run[1] and torch_run[1].strip()


def test_export_carries_the_tokenizer_to_genai(tiny_dirs):
    """`export` writes the tokenizer and genai_config.json; onnxruntime-genai's own tokenizer (another
    implementation) encodes as transformers does, and its generator prints text."""
    og = pytest.importorskip("onnxruntime_genai")
    from k3export.tokenizer import load_tokenizer

    _, export = tiny_dirs
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "genai_config.json"} <= {
        p.name for p in export.iterdir()}
    assert not (export / "genai_tokenizer").exists()  # genai reads the tiny tokenizer.json itself
    genai_ids = list(og.Tokenizer(og.Model(str(export))).encode(PROMPT))
    assert genai_ids == load_tokenizer(export).encode(PROMPT, add_special_tokens=False)
    code, out = _cli("generate", export, PROMPT, "--runtime", "genai", "--max-new-tokens", "12")
    assert code == 0 and out.strip(), out


def test_an_old_tiny_checkpoint_without_tokenizer_still_says_what_is_missing(tiny_dirs, tmp_path):
    ckpt, _ = tiny_dirs
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((ckpt / "config.json").read_text())
    code, out = _cli("generate", bare, "Hello")
    assert code == 2 and "no tokenizer" in out


def test_a_pipeline_folder_given_as_onnx_is_named(tiny_dirs, tmp_path):
    ckpt, _ = tiny_dirs
    code, out = _cli("export", ckpt, tmp_path / "P", "--stages", "2", "--no-progress")
    assert code == 0, out
    code, out = _cli("validate", ckpt, "--onnx", tmp_path / "P", "--runtimes", "ort", "--steps", "1")
    assert code == 2, out
    assert "pipeline export" in out and f"--pipeline {tmp_path / 'P'}" in out.replace("\n", "")
    assert "runtime_config.json is missing" not in out and "Traceback" not in out


def test_info_prints_the_layer_pattern_as_runs():
    code, out = _cli("info", "k3")
    assert code == 0, out
    assert "(kda, kda, kda, mla) x 23" in out and "FFN: moe, except layer 0: dense" in out
    rows = re.findall(r"^│ (\d+(?:-\d+)?) +│ (.+?) +│$", out, flags=re.M)
    assert rows[:2] == [("0-91", "(kda, kda, kda, mla) x 23"), ("92", "mla")]
    code, out = _cli("info", "tiny")
    assert code == 0 and "(kda, kda, mla) x 2" in out, out


def _expand(runs: list[Run]) -> list[str]:
    return [kind for run in runs for _ in range(run.repeats) for kind in run.block]


@pytest.mark.parametrize("seed", range(20))
def test_runs_spell_out_the_layers(seed):
    """Expanding the runs gives the layers back; runs are contiguous; a run of one is never beside another."""
    rng = random.Random(seed)
    block = [rng.choice("ab") for _ in range(rng.randint(1, 5))]
    kinds = block * rng.randint(1, 8) + [rng.choice("abc") for _ in range(rng.randint(0, 6))]
    for i in rng.sample(range(len(kinds)), k=min(2, len(kinds))):  # a few exceptions inside the pattern
        kinds[i] = "c"
    runs = repeating_runs(kinds)
    assert _expand(runs) == kinds
    assert [r.start for r in runs] == [0] + [r.stop for r in runs[:-1]]
    assert not any(a.repeats == 1 and b.repeats == 1 for a, b in zip(runs, runs[1:]))


def test_runs_of_known_layouts():
    k3 = ["kda", "kda", "kda", "mla"] * 23 + ["mla"]
    assert [str(r) for r in repeating_runs(k3)] == ["(kda, kda, kda, mla) x 23", "mla"]
    assert [str(r) for r in repeating_runs(list("aaab"))] == ["a x 3", "b"]
    assert [str(r) for r in repeating_runs(list("abcd"))] == ["(a, b, c, d)"]
    assert repeating_runs([]) == []


def test_tiny_tokenizer_refuses_a_vocabulary_too_small():
    from k3export.tokenizer import TokenizerError, build_tiny_tokenizer

    with pytest.raises(TokenizerError, match="vocab_size 200"):
        build_tiny_tokenizer(200, 0, 1, 2)
    with pytest.raises(TokenizerError, match="three different ids"):
        build_tiny_tokenizer(512, 0, 0, 2)


def test_genai_config_names_the_tiny_eos(tiny_dirs):
    _, export = tiny_dirs
    cfg = json.loads((export / "genai_config.json").read_text())
    tok_cfg = json.loads((export / "tokenizer_config.json").read_text())
    eos = cfg["model"]["eos_token_id"]
    assert tok_cfg["added_tokens_decoder"][str(eos if isinstance(eos, int) else eos[0])]["content"] == "[EOS]"
