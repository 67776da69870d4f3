"""Every runtime `validate` has, on the NVFP4 fixture's export (NVIDIA's layout: E2M1 + E4M3 block-16 scales + fp32
global scales kept NVFP4): onnxruntime-genai on the ``--genai`` 8-bit graph, OpenVINO on the inlined form, and the
readers that cannot read it refused in one line.

The reference is independent of the code under test: a float64 model built from the checkpoint's bit fields,
dequantised in float64 numpy (`nvfp4_ref`). The CLI run goes through ``validate --reference-dtype fp64`` (whose
reference, ``from_pretrained`` in float64, tests/converters/test_checkpoints_nvfp4.py checks against the same).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from k3export.converters.checkpoints.synthetic import released_tiny_config, write_checkpoint
from k3export.errors import ExportError, K3ExportError
from nvfp4_ref import PREFIX, e2m1, e4m3, reference_model

W1 = "model.layers.1.block_sparse_moe.experts.w1"
TOLS = {"*.rms_rel": 1e-4, "*.max_abs_rel": 2e-4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("nvfp4") / "ckpt", released_tiny_config(),
                            layout="kimi_k3_nvfp4", num_shards=2)


@pytest.fixture(scope="module")
def exports(ckpt, tmp_path_factory) -> dict[str, Path]:
    """The fp32 export in the functions form with ``--genai``, and in the inlined form (OpenVINO's)."""
    from k3export.converters.onnx import export_onnx

    root = tmp_path_factory.mktemp("exports")
    with pytest.warns(UserWarning, match="text model alone"):  # the fixture's vision tower is not MoonViT-V2's
        return {"functions": export_onnx(ckpt, root / "fn", dtype="fp32", genai=True).out_dir,
                "inlined": export_onnx(ckpt, root / "inl", dtype="fp32", form="inlined").out_dir}


@pytest.fixture(scope="module")
def reference(ckpt):
    from k3export.runtime import TorchRunner

    return TorchRunner(reference_model(ckpt))


def _scenarios():
    from k3export.validate.scenarios import make_scenarios

    return make_scenarios(released_tiny_config().vocab_size, prompt_len=12, steps=3, batch=1,
                          which=("decode", "chunked_prefill"))


def _passes(reference, runner) -> None:
    from k3export.validate.compare import Tolerances
    from k3export.validate.core import validate

    result = validate(reference, [runner], _scenarios(), Tolerances.parse(TOLS))
    assert result.passed, result.localisation
    assert result.runs and all(r.passed and r.steps_run > 0 for r in result.runs)
    assert all(all(run.greedy) for run in result.runs)


def test_genai_runs_the_nvfp4_export_like_the_float64_model(ckpt, exports, reference, monkeypatch, tmp_path):
    """``export --genai`` writes the 8-bit graph of the NVFP4 experts (q = 2v + 128 from the checkpoint's nibbles,
    float scales e4m3 / 2, the fp32 global scales as they are); genai runs it and matches the float64 model."""
    pytest.importorskip("onnxruntime_genai")
    from k3export.artifacts import load_export
    from k3export.genai import GENAI_CONFIG_FILE, GENAI_MODEL_FILE, GenaiError
    from k3export.runtime.genai_runner import GenaiRunner

    fn = exports["functions"]
    exp = load_export(fn)
    assert exp.ort_form_path == fn / GENAI_MODEL_FILE and exp.ort_form_data
    assert json.loads((fn / GENAI_CONFIG_FILE).read_text())["model"]["decoder"]["filename"] == GENAI_MODEL_FILE
    # model.onnx keeps the experts NVFP4
    types = {t.name: t.data_type for t in onnx.load(str(fn / "model.onnx"), load_external_data=False).graph.initializer}
    assert [types[f"{W1}.{s}"] for s in ("weight_packed", "weight_scale", "weight_scale_2")] == [
        onnx.TensorProto.FLOAT4E2M1, onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT]
    # the genai graph's 8-bit copy, from the checkpoint's bytes
    ckpt_t = {}
    for f in ckpt.glob("*.safetensors"):
        ckpt_t.update(load_file(f))
    names = [f"{PREFIX}model.layers.1.block_sparse_moe.experts.{e}.w1"
             for e in range(released_tiny_config().num_experts)]
    stored = {k: np.stack([ckpt_t[f"{n}.{k}"].view(torch.uint8).numpy() for n in names])
              for k in ("weight", "weight_scale")}
    scale_2 = np.stack([ckpt_t[f"{n}.weight_scale_2"].float().numpy() for n in names]).reshape(-1)
    genai = onnx.load(str(fn / GENAI_MODEL_FILE))
    got = {t.name: onnx.numpy_helper.to_array(t) for t in genai.graph.initializer if t.name.startswith(W1 + ".")}
    nib = np.stack([stored["weight"] & 15, stored["weight"] >> 4], axis=-1).reshape(*stored["weight"].shape[:-1], -1)
    np.testing.assert_array_equal(got[f"{W1}.weight_packed"], (2 * e2m1(nib) + 128).astype(np.uint8))
    np.testing.assert_array_equal(got[f"{W1}.weight_scale"], (e4m3(stored["weight_scale"]) / 2).astype(np.float32))
    np.testing.assert_array_equal(got[f"{W1}.weight_scale_2"], scale_2)

    monkeypatch.setenv("K3EXPORT_ORT_OPS", "0")
    _passes(reference, GenaiRunner(fn))
    # an export without the genai graph, or of another form: genai is refused naming the fix
    from k3export.converters.onnx import export_onnx

    with pytest.warns(UserWarning, match="text model alone"):
        plain = export_onnx(ckpt, tmp_path / "plain").out_dir
    with pytest.raises(GenaiError, match="MXFP4 or NVFP4, .* export again with --genai"):
        GenaiRunner(plain)
    with pytest.raises(K3ExportError, match="needs graph form 'functions'; export again with --form functions"):
        GenaiRunner(exports["inlined"])
    with pytest.raises(ExportError, match="which graph form 'inlined' inlines: export with --form functions"), \
            pytest.warns(UserWarning, match="text model alone"):
        export_onnx(ckpt, tmp_path / "x", form="inlined", genai=True)


def test_openvino_reads_the_inlined_nvfp4_export(exports, reference):
    """OpenVINO 2026.4 dequantises the E4M3 scales and E2M1 values of the inlined form; the functions form (its k3
    extension converts no NVFP4 node; the inlined bodies fail in its CPU plugin) is refused naming the form."""
    pytest.importorskip("openvino")
    from k3export.runtime.openvino_runner import OpenVinoRunner

    _passes(reference, OpenVinoRunner(exports["inlined"]))
    with pytest.raises(K3ExportError) as info:
        OpenVinoRunner(exports["functions"])
    msg = str(info.value)
    assert "NVFP4 experts" in msg and "--form inlined" in msg and "converts no NVFP4" in msg and "\n" not in msg


def test_readers_of_no_nvfp4_form_are_refused_in_one_line(ckpt, exports, tmp_path):
    """The reference evaluator (its Pad rejects the negative pads that crop an expert from the 4-bit stack, seen
    below) and ONNX Runtime's WebGPU runner read NVFP4 experts in no form; ORT and genai read only the functions
    form (ORT has no Pad on FLOAT4E2M1), so no runtime reads the standard form."""
    from k3export.artifacts import load_export
    from k3export.converters.onnx import export_onnx
    from k3export.converters.onnx.forms import check_export
    from k3export.runtime.reference_runner import ReferenceRunner, ReferenceSession

    for consumer, folder in (("onnx-reference", exports["functions"]), ("onnx-reference", exports["inlined"]),
                             ("ort-webgpu", exports["functions"])):
        with pytest.raises(K3ExportError) as info:
            check_export(consumer, load_export(folder))
        assert str(info.value).endswith("reads NVFP4 experts in no graph form; export with --experts dense")
    with pytest.raises(K3ExportError, match="reads NVFP4 experts in no graph form"):
        ReferenceRunner(exports["inlined"])
    with pytest.raises(K3ExportError, match="needs graph form 'functions'"):
        check_export("ort", load_export(exports["inlined"]))
    with pytest.raises(ExportError, match="no runtime reads graph form 'standard' with nvfp4 experts"), \
            pytest.warns(UserWarning, match="text model alone"):
        export_onnx(ckpt, tmp_path / "std", form="standard")
    # the reason, measured: the evaluator fails on the crop
    exp = load_export(exports["inlined"])
    session = ReferenceSession(exp.model_path)
    feeds = {"input_ids": np.array([[3, 5]], np.int64), "attention_mask": np.ones((1, 2), np.int64),
             **{k: v.astype(np.float32) for k, v in exp.manifest.initial_state(1).items()}}
    with pytest.raises(ValueError, match="negative"):
        session.run(feeds)


@pytest.mark.slow
def test_validate_passes_every_runtime_that_reads_the_nvfp4_export(ckpt, exports, tmp_path):
    """``k3export validate`` against a float64 reference: torch, Triton, ORT (the k3 library where it builds) and
    genai on the functions export, OpenVINO on the inlined one; the reference evaluator refused in one line."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("openvino")
    from k3export_cli.main import app

    base = ["validate", str(ckpt), "--steps", "1", "--triton-steps", "1", "--batch", "1", "--prompt-len", "4",
            "--reference-dtype", "fp64", "--strict"]
    for form, runtimes in (("functions", "torch,triton,ort,genai"), ("inlined", "torch,openvino")):
        report = tmp_path / f"{form}.json"
        res = CliRunner().invoke(app, [*base, "--onnx", str(exports[form]), "--runtimes", runtimes,
                                       "--report", str(report)])
        assert res.exit_code == 0, res.output
        rep = json.loads(report.read_text())
        assert rep["passed"] and rep["runtimes"] == runtimes.split(",") and not rep["skipped"], rep["skipped"]
    res = CliRunner().invoke(app, [*base, "--onnx", str(exports["inlined"]), "--runtimes", "onnx-reference"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "reads NVFP4 experts in no graph form; export with --experts dense" in res.output
