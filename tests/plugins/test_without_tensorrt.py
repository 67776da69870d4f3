"""Without TensorRT: imports work, register_plugins / build / run fail with one clear message."""

import importlib.util

import pytest
from typer.testing import CliRunner

import k3export.plugins as plugins

no_trt = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")


def test_plugin_modules_import_without_tensorrt():
    import k3export.converters.tensorrt  # noqa: F401
    from k3export.plugins import kda, moe_experts, moe_experts_mxfp4, moe_route, situ_glu  # noqa: F401


@no_trt
def test_register_plugins_says_how_to_install():
    with pytest.raises(plugins.TensorRTUnavailable, match=r"TensorRT is not installed.*pip install tensorrt-cu12"):
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


def test_cli_build_bad_precision_before_tensorrt(tiny_export, tmp_path):
    from k3export_cli.main import app

    r = CliRunner().invoke(app, ["build", str(tiny_export), str(tmp_path / "m.engine"), "--precision", "fp32"])
    assert r.exit_code == 2 and "exported in bfloat16" in r.output
