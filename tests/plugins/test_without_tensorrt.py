"""Without TensorRT: imports work, register_plugins / build / run fail with one clear message. With TensorRT-RTX
(the test extra installs it) and no GPU: a build without a target names the targets, and run names the GPU."""

import pytest
from typer.testing import CliRunner

import k3export.plugins as plugins
from k3export.plugins.flavour import flavour_status, load_flavour

no_trt = pytest.mark.skipif(flavour_status() is None, reason="a TensorRT is installed here")


def _no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


rtx_no_gpu = pytest.mark.skipif(flavour_status() is not None or not load_flavour().rtx or not _no_gpu(),
                                reason="needs TensorRT-RTX and no visible GPU")


def test_plugin_modules_import_without_tensorrt():
    import k3export.converters.tensorrt  # noqa: F401
    from k3export.plugins import kda, moe_experts, moe_experts_mxfp4, moe_route, situ_glu  # noqa: F401


@no_trt
def test_register_plugins_says_how_to_install():
    with pytest.raises(plugins.TensorRTUnavailable, match=r"TensorRT is not installed.*pip install tensorrt-rtx-cu12"):
        plugins.register_plugins()


@no_trt
def test_cli_build_and_run_exit_nonzero_with_one_line(tiny_export, tmp_path):
    from k3export_cli.main import app

    r = CliRunner().invoke(app, ["build", str(tiny_export), str(tmp_path / "m.engine")])
    assert r.exit_code == 2 and "TensorRT is not installed" in r.output and "Traceback" not in r.output
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"\0")
    r = CliRunner().invoke(app, ["run", str(engine), "--onnx-dir", str(tiny_export)])
    assert r.exit_code == 2 and "TensorRT is not" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


@rtx_no_gpu
def test_cli_build_without_gpu_or_target_names_the_targets_and_run_names_the_gpu(tiny_export, tmp_path):
    from k3export_cli.main import app

    r = CliRunner().invoke(app, ["build", str(tiny_export), str(tmp_path / "m.engine")])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "no GPU is visible, so TensorRT-RTX needs the compute capability" in r.output and "8.6" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "m.engine").exists()
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"\0")
    r = CliRunner().invoke(app, ["run", str(engine), "--onnx-dir", str(tiny_export)])
    assert r.exit_code == 2 and "running an engine needs a CUDA device" in r.output and "Traceback" not in r.output


def test_cli_build_bad_precision_before_tensorrt(tiny_export, tmp_path):
    from k3export_cli.main import app

    r = CliRunner().invoke(app, ["build", str(tiny_export), str(tmp_path / "m.engine"), "--precision", "fp32"])
    assert r.exit_code == 2 and "exported in bfloat16" in r.output
