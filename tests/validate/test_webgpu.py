"""Runtime ort-webgpu: the tiny export validated against the PyTorch reference on ONNX Runtime's WebGPU EP (WGSL
shaders through Dawn on Vulkan; here Mesa's lavapipe, a Vulkan device on the CPU), fp32 and fp16, and a wrong sign
planted in one exported op failing it. They need a Python with onnxruntime-webgpu (``.ci/webgpu-env`` makes
``.venv-webgpu``; or K3EXPORT_WEBGPU_PYTHON) and a Vulkan device, and skip with the reason without them.
lavapipe compiles every shader on the CPU: prompts of 4 tokens, 2 decode steps."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3export.runtime import RuntimeUnavailable
from k3export.runtime.webgpu_runner import PYTHON_ENV, WEBGPU, OrtWebGpuRunner

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--prompt-len", "4", "--steps", "2", "--batch", "1", "--strict"]


@pytest.fixture(scope="session")
def webgpu_python() -> str:
    """The Python with onnxruntime-webgpu: K3EXPORT_WEBGPU_PYTHON, else the repository's .venv-webgpu."""
    python = os.environ.get(PYTHON_ENV) or str(ROOT / ".venv-webgpu" / "bin" / "python")
    if not os.access(python, os.X_OK):
        pytest.skip(f"no Python with onnxruntime-webgpu ({python}): .ci/webgpu-env makes one")
    return python


@pytest.fixture
def webgpu_env(webgpu_python, monkeypatch) -> str:
    monkeypatch.setenv(PYTHON_ENV, webgpu_python)
    return webgpu_python


def _export(model, path: Path, dtype: str) -> Path:
    from k3export.converters.onnx import export_onnx

    # onnxruntime-webgpu 1.27 loads up to opset 26; at 24..26 Transpose, Pad, Cast and Shape (their newer versions)
    # find no WebGPU kernel and fall back to the CPU EP
    export_onnx(model, path, dtype=dtype, opset=23)
    return path


@pytest.fixture(scope="session")
def webgpu_fp32(tiny, webgpu_python, tmp_path_factory) -> Path:
    folder = _export(tiny, tmp_path_factory.mktemp("webgpu") / "fp32", "fp32")
    try:  # skip (with the reason) where no Vulkan device can be had; anything else is a failure
        OrtWebGpuRunner(folder, python=webgpu_python).close()
    except RuntimeUnavailable as exc:
        if "no WebGPU adapter" not in str(exc):
            raise
        pytest.skip(str(exc))
    return folder


@pytest.fixture(scope="session")
def webgpu_fp16(tiny, webgpu_fp32, tmp_path_factory) -> Path:
    return _export(tiny, tmp_path_factory.mktemp("webgpu") / "fp16", "fp16")


def _validate(model_dir: Path, export: Path, report: Path, *extra: str):
    from k3export_cli.main import app

    return CliRunner().invoke(app, ["validate", str(model_dir), "--onnx", str(export), "--runtimes", "ort-webgpu",
                                    "--report", str(report), *SMALL, *extra])


def test_fp32_passes_on_the_webgpu_ep_with_its_adapter_and_placement(model_dir, webgpu_fp32, webgpu_env, tmp_path):
    """Prefill, decode and the state scenarios within fp32's tolerances; the report names the lavapipe adapter and
    the share of nodes the WebGPU EP ran, the matrix products among them."""
    r = _validate(model_dir, webgpu_fp32, tmp_path / "v.json", "--state")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["passed"] and report["runtimes"] == ["ort-webgpu"]
    assert report["runtime_tolerances"]["ort-webgpu"]["logits"]["rms_rel"] == 1e-3
    scenarios = {s["name"] for s in report["scenarios"]}
    assert {"decode", "prefix_reuse", "fork", "rollback"} <= scenarios, scenarios
    described = report["runtime_descriptions"]["ort-webgpu"]
    assert "WebGpuExecutionProvider" in described and "Vulkan" in described, described
    share = float(described.split("nodes (")[1].split("%")[0])
    assert share > 50, described
    assert f"ort-webgpu: {described}" in " ".join(r.output.split()), r.output  # printed under the table too


def test_placement_puts_the_matrix_products_on_the_gpu(webgpu_fp32, webgpu_python):
    import numpy as np

    runner = OrtWebGpuRunner(webgpu_fp32, python=webgpu_python)
    try:
        assert runner.placement is None
        runner.prefill(np.array([[3, 1, 4, 1]]))
        p = runner.placement
        assert runner.ort.adapter is not None and runner.ort.adapter["backend"] == "Vulkan"
    finally:
        runner.close()
    gpu, cpu = p.providers[WEBGPU], p.providers["CPUExecutionProvider"]
    # every float product and every k3 body's transcendental ran as a shader; what stayed on the CPU is the
    # int64 shape arithmetic and the control flow (Loop / If) of the MoE experts' body
    for op in ("MatMul", "Gemm", "RMSNormalization", "Softmax", "Tanh", "Sigmoid", "Exp", "Transpose"):
        assert op in gpu and op not in cpu, (op, gpu, cpu)
    assert {"Loop", "If", "Slice"} <= cpu.keys()
    assert p.nodes(WEBGPU) + p.nodes("CPUExecutionProvider") == p.total


def test_fp16_passes_with_its_own_tolerances(model_dir, webgpu_fp16, webgpu_env, tmp_path):
    r = _validate(model_dir, webgpu_fp16, tmp_path / "v.json")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["runtime_dtypes"]["ort-webgpu"] == "float16"
    assert report["runtime_tolerances"]["ort-webgpu"]["recurrent_state"]["rms_rel"] == \
        OrtWebGpuRunner.tolerances["float16"]["rms_rel"]


def test_a_wrong_sign_in_one_exported_op_fails_on_the_webgpu_ep(model_dir, webgpu_fp16, webgpu_env, tmp_path):
    """situ_glu's body with its first Tanh negated (the shared experts' activation): caught even with fp16's
    tolerances, at the first layer the op runs in."""
    from k3export.validate.mutations import flip_function_sign

    bad = flip_function_sign(webgpu_fp16, tmp_path / "bad", "situ_glu", "Tanh")
    r = _validate(model_dir, bad, tmp_path / "v.json", "--steps", "0")
    assert r.exit_code == 2 and "error: validation failed: ort-webgpu/decode: first divergence: layer 1" in r.output, \
        r.output  # layer 0's FFN is the first situ_glu: localised by the state it hands to layer 1
    report = json.loads((tmp_path / "v.json").read_text())
    assert not report["passed"]
    worst = max(s["rms_rel"] for s in report["steps"] if s["runtime"] == "ort-webgpu")
    assert worst > 10 * OrtWebGpuRunner.tolerances["float16"]["rms_rel"], worst  # not a near miss


def test_no_vulkan_device_is_one_line(model_dir, webgpu_fp32, webgpu_env, monkeypatch):
    monkeypatch.setenv("VK_ICD_FILENAMES", "/nonexistent/icd.json")  # the loader finds no driver
    from k3export_cli.main import app

    r = CliRunner().invoke(app, ["validate", str(model_dir), "--onnx", str(webgpu_fp32), "--runtimes", "ort-webgpu",
                                 "--strict"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ort-webgpu: no WebGPU adapter") \
        and "lavapipe" in lines[0] and "Traceback" not in r.output, r.output


def test_an_opset_onnxruntime_1_27_does_not_know_is_refused_naming_the_fix(onnx_dir, webgpu_python):
    """The default export (opset 27): onnxruntime-webgpu 1.27 knows up to 26; the refusal says how to export."""
    with pytest.raises(RuntimeUnavailable, match=r"(?i)opset 27.*export --opset 23"):
        OrtWebGpuRunner(onnx_dir, python=webgpu_python)


def test_without_a_webgpu_python_the_runtime_says_how_to_get_one(webgpu_fp32, monkeypatch):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    with pytest.raises(RuntimeUnavailable, match=f"set {PYTHON_ENV}.*webgpu-env"):
        OrtWebGpuRunner(webgpu_fp32)
