"""`k3export generate` prints the same text through every runtime available here, from a tokenizer-bearing tiny
checkpoint (torch, triton) and its export (ort, genai); trt says why it cannot run."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from genai_fixtures import VOCAB, export_for_genai

pytest.importorskip("onnxruntime_genai")

PROMPT = "Hello world, the model"
NEW = 24


@pytest.fixture(scope="module")
def printable(tok_model, kimi_tokenizer_dir, tmp_path_factory):
    """The tiny model with the lm_head rows of tokens that are not whole UTF-8 text zeroed, so that its greedy text
    is printable: transformers shows a broken UTF-8 sequence as U+FFFD, onnxruntime-genai drops it (and its
    decode stops at the first one), so random bytes would not print alike."""
    import copy

    from k3export.modeling import save_pretrained
    from k3export.tokenizer import copy_tokenizer_files, load_tokenizer

    tok = load_tokenizer(kimi_tokenizer_dir, VOCAB)
    model = copy.deepcopy(tok_model)
    with torch.no_grad():
        for i in range(VOCAB):
            text = tok.decode([i])
            if "\ufffd" in text or "\x00" in text:
                model.lm_head.weight[i].zero_()
    root = tmp_path_factory.mktemp("generate")
    save_pretrained(model, root / "ckpt")
    copy_tokenizer_files(kimi_tokenizer_dir, root / "ckpt")
    export_for_genai(model, root / "ckpt", root / "onnx")
    return root / "ckpt", root / "onnx"


@pytest.fixture(scope="module")
def inlined(printable, tmp_path_factory):
    """The same model exported in the inlined graph form (what OpenVINO reads), with its tokenizer."""
    from k3export.converters.onnx import export_onnx

    ckpt, _ = printable
    out = tmp_path_factory.mktemp("generate") / "inlined"
    export_onnx(str(ckpt), out, dtype="fp32", form="inlined")  # a checkpoint folder: its tokenizer travels
    return out


def _generate(*args: str) -> tuple[int, str]:
    from k3export_cli.main import app

    res = CliRunner().invoke(app, ["generate", *args])
    return res.exit_code, res.stdout if res.exit_code == 0 else res.output


@pytest.mark.parametrize("chat", [False, True])
def test_same_text_through_every_runtime(printable, chat):
    ckpt, onnx = printable
    flags = ["--max-new-tokens", str(NEW)] + (["--chat"] if chat else [])
    runs = {"torch": _generate(str(ckpt), PROMPT, *flags),
            "ort": _generate(str(onnx), PROMPT, "--runtime", "ort", *flags),
            "genai": _generate(str(onnx), PROMPT, "--runtime", "genai", *flags),
            "ort (checkpoint + --onnx)": _generate(str(ckpt), PROMPT, "--runtime", "ort", "--onnx", str(onnx), *flags)}
    for name, (code, _) in runs.items():
        assert code == 0, (name, runs[name][1])
    texts = {name: out for name, (_, out) in runs.items()}
    assert len(set(texts.values())) == 1, texts
    assert len(texts["torch"].strip()) > 0


def test_triton_prints_the_same_text(printable):
    from k3export.runtime.torch_runner import triton_status

    why = triton_status("cpu")
    if why is not None:
        pytest.skip(why)
    ckpt, _ = printable
    a = _generate(str(ckpt), PROMPT, "--runtime", "triton", "--max-new-tokens", "4")
    b = _generate(str(ckpt), PROMPT, "--max-new-tokens", "4")
    assert a[0] == 0 and a == b, (a, b)


def test_clear_errors(printable, tmp_path):
    ckpt, onnx = printable
    code, out = _generate(str(onnx), PROMPT, "--runtime", "torch")
    assert code == 2 and "runs a checkpoint" in out
    code, out = _generate(str(ckpt), PROMPT, "--runtime", "genai")
    assert code == 2 and "runs an ONNX export" in out
    code, out = _generate(str(onnx), PROMPT, "--runtime", "trt")
    assert code == 2 and ("TensorRT" in out or "tensorrt" in out or "--engine" in out), out
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((ckpt / "config.json").read_text())
    code, out = _generate(str(bare), PROMPT)
    assert code == 2 and "no tokenizer" in out


@pytest.mark.parametrize("runtime", ["torch", "ort"])
def test_prefill_in_chunks_gives_the_same_text(printable, runtime):
    """The prompt fed 3 tokens at a time continues exactly as the whole prompt at once (the carried state)."""
    ckpt, onnx = printable
    where = str(ckpt if runtime == "torch" else onnx)
    whole = _generate(where, PROMPT, "--runtime", runtime, "--max-new-tokens", str(NEW))
    chunked = _generate(where, PROMPT, "--runtime", runtime, "--max-new-tokens", str(NEW), "--prefill-chunk", "3")
    assert whole[0] == chunked[0] == 0 and whole[1] == chunked[1] and whole[1].strip()
    code, out = _generate(str(onnx), PROMPT, "--runtime", "genai", "--prefill-chunk", "3")
    assert code != 0 and "genai" in out and "prompt whole" in out


@pytest.mark.parametrize("runtime", ["openvino", "onnx-reference"])
def test_openvino_and_the_reference_evaluator_print_the_same_text(printable, inlined, runtime):
    """Through the one decode loop, whole and in chunks of 3 prompt tokens: PyTorch's text."""
    if runtime == "openvino":
        pytest.importorskip("openvino")
    ckpt, _ = printable
    flags = ["--max-new-tokens", str(NEW)]
    want = _generate(str(ckpt), PROMPT, *flags)
    got = _generate(str(inlined), PROMPT, "--runtime", runtime, *flags)
    chunked = _generate(str(inlined), PROMPT, "--runtime", runtime, *flags, "--prefill-chunk", "3")
    assert want[0] == 0 and want[1].strip() and got == want == chunked, (want, got, chunked)


def test_the_reference_evaluator_prints_pytorchs_text_from_a_long_prompt(printable, inlined, kimi_tokenizer_dir):
    """A prompt of over 200 tokens in one prefill (onnx's own GatherElements took 63 entries along its axis: the
    short conv's window failed from 61 prompt tokens on): PyTorch's text."""
    from k3export.tokenizer import load_tokenizer

    prompt = " ".join([PROMPT] * 50)
    assert len(load_tokenizer(kimi_tokenizer_dir, VOCAB).encode(prompt, add_special_tokens=False)) >= 200
    ckpt, _ = printable
    want = _generate(str(ckpt), prompt, "--max-new-tokens", "4")
    got = _generate(str(inlined), prompt, "--runtime", "onnx-reference", "--max-new-tokens", "4")
    assert want[0] == 0 and want[1].strip() and got == want, (want, got)
