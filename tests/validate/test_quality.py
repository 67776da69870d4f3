"""``validate --quality``: the figures against an independent float64 computation over the same logits, an fp32
export's figures, and the user errors."""

import json
import shutil

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

TEXT = ("The river ran past the mill and under the old stone bridge, where children threw sticks into the water "
        "and watched them race away. In the evening the miller counted his sacks of flour, wrote the numbers in a "
        "book, and walked home along the bank while the light went out of the sky. ") * 2
CONTEXT = 32


def _app():
    from cli.validate import register

    app = typer.Typer()
    register(app)
    return app


@pytest.fixture(scope="module")
def text_model(model_dir, tiny, tmp_path_factory):
    """The tiny model's folder with a tokenizer (the shared `model_dir` has none)."""
    from k3export.tokenizer import write_tiny_tokenizer

    folder = tmp_path_factory.mktemp("quality") / "model"
    shutil.copytree(model_dir, folder)
    write_tiny_tokenizer(folder, tiny.config)
    return folder


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("quality") / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def quality_report(text_model, onnx_dir, text_file, tmp_path_factory):
    report = tmp_path_factory.mktemp("quality") / "r.json"
    res = CliRunner().invoke(_app(), [
        "validate", str(text_model), "--onnx", str(onnx_dir), "--runtimes", "ort,torch-bf16", "--steps", "0",
        "--batch", "1", "--prompt-len", "4", "--quality", str(text_file), "--quality-context", str(CONTEXT),
        "--max-kld", "1", "--min-top1", "0", "--report", str(report), "--plot", str(report.with_suffix(".png"))])
    assert res.exit_code == 0, res.output
    assert "next-token quality" in res.output and "mean KLD" in res.output
    return json.loads(report.read_text())


def _windows(text_model, vocab):
    """The text's windows, tokenized here with `tokenizers` directly."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(text_model / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    assert max(ids) < vocab
    n = len(ids) // CONTEXT
    assert n >= 2, "the test text must fill at least two windows"
    return np.array(ids[:n * CONTEXT]).reshape(n, CONTEXT)


def _figures64(logits, reference, targets):
    """KLD, top-1 and perplexities in float64, written out without the module under test: probabilities by
    exp / sum, KL(P || Q) = sum P log(P / Q) term by term."""
    out = {"kld": [], "top1": [], "nll": [], "nll_ref": [], "dp": []}
    for q_row, p_row, t in zip(logits.astype(np.float64), reference.astype(np.float64), targets):
        p = np.exp(p_row - p_row.max())
        p /= p.sum()
        q = np.exp(q_row - q_row.max())
        q /= q.sum()
        out["kld"].append(float(np.sum(p * (np.log(p) - np.log(q)))))
        out["top1"].append(int(np.argmax(q) == np.argmax(p)))
        out["nll"].append(-np.log(q[t]))
        out["nll_ref"].append(-np.log(p[t]))
        out["dp"].append(q[t] - p[t])
    k = np.array(out["kld"])
    return {"tokens": len(k), "kld_mean": k.mean(), "kld_max": k.max(), "top1_agree": np.mean(out["top1"]),
            "ppl": np.exp(np.mean(out["nll"])), "ppl_reference": np.exp(np.mean(out["nll_ref"])),
            "delta_p_rms": np.sqrt(np.mean(np.square(out["dp"]))),
            "kld_stderr": k.std(ddof=1) / np.sqrt(len(k))}


@pytest.mark.parametrize("runtime", ["ort", "torch-bf16"])
def test_quality_figures_match_an_independent_float64_computation(quality_report, text_model, onnx_dir, tiny,
                                                                  runtime):
    """The report's figures of the fp32 export (ort) and of PyTorch in bf16 against float64 numpy over the logits of
    the same windows, run here again."""
    from k3export.runtime import make_runner, Target
    from k3export.runtime.base import to_numpy

    target = Target(model=tiny, onnx_dir=onnx_dir)
    reference, runner = make_runner("torch", target), make_runner(runtime, target)
    wins = _windows(text_model, tiny.config.vocab_size)
    first = CONTEXT // 2
    rows = {"out": [], "ref": [], "t": []}
    for ids in wins:
        rows["ref"].append(to_numpy(reference.prefill(ids[None]).logits)[0, first:-1])
        rows["out"].append(to_numpy(runner.prefill(ids[None]).logits)[0, first:-1])
        rows["t"].append(ids[first + 1:])
    want = _figures64(*(np.concatenate(rows[k]) for k in ("out", "ref", "t")))
    got = quality_report["quality"][runtime]
    assert got["tokens"] == want["tokens"] == len(wins) * (CONTEXT - 1 - first)
    for key in ("top1_agree", "ppl", "ppl_reference", "delta_p_rms", "kld_max", "kld_mean", "kld_stderr"):
        # the report keeps 4 significant digits. The fp32 export's figures are noise: its KLDs (~1e-11) and delta-p
        # (~3e-9) move by up to ~4e-12 between two runs of one ORT session (its threads' order), so they are held to
        # 1e-10; PyTorch in bf16 (KLD ~1e-3, the same logits every run) carries the exact check.
        assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-10 if runtime == "ort" else 1e-13), key
    assert len(got["kld_by_position"]) == CONTEXT - 1 - first


def test_fp32_export_keeps_the_distribution(quality_report):
    """The issue's target: an fp32 export agrees on top-1 >= 0.999 with mean KLD < 1e-6; bf16 PyTorch is measurably
    further (the figures can tell the two apart)."""
    ort, bf16 = quality_report["quality"]["ort"], quality_report["quality"]["torch-bf16"]
    assert ort["top1_agree"] >= 0.999 and ort["kld_mean"] < 1e-6 and ort["passed"]
    assert abs(ort["ln_ppl_ratio"]) < 1e-6
    assert bf16["kld_mean"] > 1e3 * ort["kld_mean"]
    assert quality_report["model"]["quality_context"] == CONTEXT


def test_default_limits_fail_closed(text_model, onnx_dir, text_file, tmp_path):
    """With the default limits bf16 PyTorch on this random tiny model (flat, chaotic distributions) exceeds bf16's
    mean-KLD limit: the run fails and names the runtime; the fp32 export passes its own."""
    res = CliRunner().invoke(_app(), [
        "validate", str(text_model), "--onnx", str(onnx_dir), "--runtimes", "ort,torch-bf16", "--steps", "0",
        "--batch", "1", "--prompt-len", "4", "--quality", str(text_file), "--quality-context", str(CONTEXT),
        "--report", str(tmp_path / "r.json")])
    assert res.exit_code != 0
    assert "torch-bf16/quality: mean KLD" in res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert not rep["passed"] and rep["quality"]["ort"]["passed"] and not rep["quality"]["torch-bf16"]["passed"]


@pytest.mark.parametrize("args, message", [
    (["--quality", "MISSING"], "not a file"),
    (["--quality", "SHORT", "--quality-context", "512"], "shorter than one --quality-context window of 512"),
    (["--quality", "TEXT", "--max-kld", "-1"], "--max-kld -1.0: must be a finite number >= 0"),
    (["--quality", "TEXT", "--min-top1", "2"], "--min-top1 2.0: must be a fraction in [0, 1]"),
    (["--quality", "TEXT", "--model", "PLAIN"], "neither the model folder nor the export has a tokenizer"),
])
def test_quality_user_errors(text_model, model_dir, onnx_dir, text_file, tmp_path, args, message):
    (tmp_path / "short.txt").write_text("A few words.")
    names = {"MISSING": str(tmp_path / "missing.txt"), "SHORT": str(tmp_path / "short.txt"), "TEXT": str(text_file)}
    args = [names.get(a, a) for a in args]
    model = text_model
    if "--model" in args:  # the shared tiny folder, without a tokenizer (nor has its export one)
        model, args = model_dir, args[:-2]
    res = CliRunner().invoke(_app(), ["validate", str(model), "--onnx", str(onnx_dir), "--steps", "0",
                                      "--batch", "1", "--prompt-len", "4", *args, "--report", str(tmp_path / "r.json")])
    assert res.exit_code == 2, res.output
    assert f"error: {message}" in res.output or message in res.output.splitlines()[-1], res.output
    assert "Traceback" not in res.output and not (tmp_path / "r.json").exists()


@pytest.fixture(scope="module")
def int8_dir(tiny, tmp_path_factory):
    from k3export.converters.onnx import export_onnx

    path = tmp_path_factory.mktemp("quality") / "int8"
    export_onnx(tiny, path, dtype="fp32", quantize="int8")
    return path


def _scale_block(folder, name: str, factor: float) -> None:
    """Multiply the first scale of initializer `name` (one quantized block of one projection) in place."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    ext = {e.key: e.value for e in next(t for t in model.graph.initializer if t.name == name).external_data}
    with open(folder / ext["location"], "r+b") as f:
        f.seek(int(ext["offset"]))
        v = np.frombuffer(f.read(4), np.float32)[0]
        f.seek(int(ext["offset"]))
        f.write(np.float32(v * factor).tobytes())


def test_a_corrupted_quantized_block_fails_quality_naming_the_runtime(text_model, int8_dir, text_file, tmp_path):
    """The issue's test: one block of one projection with its scale x16. The clean int8 export matches the model
    holding its weights elementwise (fp32 tolerances) and sets the bar (mean KLD x2); the corrupted one fails the
    quality verdict above it, named by runtime (and its elementwise checks, localised)."""
    def run(folder, *limits):
        report = tmp_path / f"{folder.name}.json"
        res = CliRunner().invoke(_app(), [
            "validate", str(text_model), "--onnx", str(folder), "--runtimes", "ort", "--steps", "2", "--batch", "1",
            "--prompt-len", "4", "--quality", str(text_file), "--quality-context", str(CONTEXT), *limits,
            "--report", str(report)])
        return res, json.loads(report.read_text())

    res, clean = run(int8_dir, "--max-kld", "1", "--min-top1", "0")
    assert res.exit_code == 0, res.output
    bar = 2 * clean["quality"]["ort"]["kld_mean"]
    assert 0 < bar
    bad = tmp_path / "int8-bad"
    shutil.copytree(int8_dir, bad)
    _scale_block(bad, "model.layers.2.self_attn.o_proj.weight.int8_scales", 16.0)
    res, rep = run(bad, "--max-kld", f"{bar:.6e}", "--min-top1", "0")
    assert res.exit_code == 2 and "ort/quality: mean KLD" in res.output, res.output
    assert not rep["quality"]["ort"]["passed"] and rep["quality"]["ort"]["kld_mean"] > bar
    # ONNX Runtime rounds the projections' inputs to int8 (the default): no elementwise rows, the quality judges it
    assert not [r for r in rep["summary"] if r["runtime"] == "ort"] and "judged by --quality" in \
        rep["runtime_descriptions"]["ort"]


def test_int8_inputs_need_quality_and_exact_inputs_compare_elementwise(text_model, tiny, int8_dir, tmp_path):
    """An export whose ONNX Runtime projections round their inputs to int8 is refused without --quality (fail
    closed); one with fp32 inputs (--no-quantize-activations) matches the model holding its weights to fp32
    tolerances, and a block's scale x16 fails that comparison, localised."""
    from k3export.converters.onnx import export_onnx

    res = CliRunner().invoke(_app(), ["validate", str(text_model), "--onnx", str(int8_dir), "--runtimes", "ort",
                                      "--steps", "1", "--batch", "1", "--prompt-len", "4"])
    assert res.exit_code == 2 and "add --quality TEXT_FILE" in res.output, res.output
    exact = tmp_path / "exact"
    export_onnx(tiny, exact, dtype="fp32", quantize="int8", accuracy_level=0)
    args = ["--runtimes", "ort", "--steps", "2", "--batch", "1", "--prompt-len", "4"]
    res = CliRunner().invoke(_app(), ["validate", str(text_model), "--onnx", str(exact), *args])
    assert res.exit_code == 0, res.output
    _scale_block(exact, "model.layers.2.self_attn.o_proj.weight.int8_scales", 16.0)
    res = CliRunner().invoke(_app(), ["validate", str(text_model), "--onnx", str(exact), *args])
    assert res.exit_code == 2 and "ort/decode: first divergence: layer 3" in res.output, res.output
