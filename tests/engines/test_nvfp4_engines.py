"""Real TensorRT-RTX engines of NVIDIA's NVFP4 layout (the tiny K3 written by the fixture writer), built here with no
GPU: the experts kept NVFP4 through the ``k3::moe_experts_nvfp4`` plugin, and the attention's block FP8 kept where
TensorRT-RTX builds FP8 (compute capability >= 8.9) and refused in one line where it does not. Running an engine
needs a GPU: that test skips, saying so."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from test_engine_builds import TARGET_CC, check_engine, embedded_kernels  # tests/engines on sys.path
from trt_builds import LIMITS, OPTIMIZATION_LEVEL, build, export_fp32
from typer.testing import CliRunner

from k3export.artifacts import EngineSidecar


@pytest.fixture(scope="module")
def nvfp4_ckpt(tmp_path_factory) -> Path:
    from k3export.converters.checkpoints.synthetic import released_tiny_config, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("trt_nvfp4") / "ckpt", released_tiny_config(),
                            layout="kimi_k3_nvfp4", num_shards=1)


@pytest.fixture(scope="module")
def nvfp4_export(nvfp4_ckpt, tmp_path_factory) -> Path:
    """Experts NVFP4 (the checkpoint's bytes), attention decoded (``--projections dense``)."""
    return export_fp32(nvfp4_ckpt, tmp_path_factory, "trt_nvfp4", projections="dense")


@pytest.fixture(scope="module")
def fp8_export(nvfp4_ckpt, tmp_path_factory) -> Path:
    """The default export of the layout: experts NVFP4, attention block FP8."""
    return export_fp32(nvfp4_ckpt, tmp_path_factory, "trt_nvfp4_fp8")


def test_nvfp4_experts_build_with_their_plugin(nvfp4_export, rtx, tmp_path):
    engine = build(nvfp4_export, tmp_path / "model.engine")
    car = check_engine(engine, nvfp4_export, rtx)
    assert "k3::moe_experts_nvfp4" in car.plugins and "k3::moe_experts" not in car.plugins


def test_fp8_projections_are_refused_in_one_line_for_a_target_without_fp8(fp8_export, rtx, tmp_path):
    from k3export_cli.main import app

    r = CliRunner().invoke(app, ["build", str(fp8_export), str(tmp_path / "x.engine"), "--precision", "fp32",
                                 "--target-cc", "8.6"])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "block FP8" in text and "compute capability 8.6 has no FP8" in text and "--projections dense" in text
    assert not (tmp_path / "x.engine").exists()


def test_fp8_projections_build_for_a_target_with_fp8(fp8_export, rtx, tmp_path):
    """Kept FP8 (the graph's FLOAT8E4M3FN weights, 1 byte a weight) into an engine for 8.9, with the NVFP4 plugin."""
    from k3export.converters.tensorrt import build_engine

    model = onnx.load(str(fp8_export / "model.onnx"), load_external_data=False)
    assert sum(n.op_type == "DequantizeLinear" for n in model.graph.node) >= 8
    engine = build_engine(fp8_export, tmp_path / "model.engine", precision="fp32", target_cc="8.9",
                          optimization_level=OPTIMIZATION_LEVEL, progress=None, **LIMITS)
    car = EngineSidecar.read_for(engine)
    assert car.target_compute_capability == (8, 9) and "k3::moe_experts_nvfp4" in car.plugins
    kernels = embedded_kernels(engine)
    assert {k["op"] for k in kernels} >= {"moe_experts_nvfp4"}
    assert all(".target sm_89" in k["ptx"] for k in kernels)


def test_running_an_nvfp4_engine_needs_a_gpu(nvfp4_ckpt, nvfp4_export, rtx, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("running a TensorRT engine needs an NVIDIA GPU; none is visible (the NVFP4 engines here are "
                    "built, not run)")
    cc = torch.cuda.get_device_capability()
    if cc != TARGET_CC:
        pytest.skip(f"the engine is built for compute capability {TARGET_CC}; this GPU is {cc[0]}.{cc[1]}")
    from k3export.validate.api import run_validation

    engine = build(nvfp4_export, tmp_path / "model.engine")
    run = run_validation(str(nvfp4_ckpt), runtimes=["trt"], onnx_dir=nvfp4_export, engine=engine,
                         prompt_len=6, steps=4, batch=2, device="cuda", strict=True)
    assert run.result.passed, run.result.localisation
