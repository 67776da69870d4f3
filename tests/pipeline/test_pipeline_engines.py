"""``k3export build PIPELINE_DIR``: every stage checked before any build, and the one-line refusal without a
TensorRT that can build here. Real per-stage builds (and a stage built the same way kept) are in
``tests/engines/test_engine_builds.py``."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
from typer.testing import CliRunner

from k3export.pipeline.engines import STAGE_ENGINE

no_trt = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")


@pytest.fixture
def pipe(tiny_exports, tmp_path):
    """A private copy of the 3-stage fp32 pipeline export (engines are written into its stage folders)."""
    return shutil.copytree(tiny_exports[3], tmp_path / "pipe")


def _cli(*args):
    from k3export_cli.main import app

    return CliRunner().invoke(app, ["build", *map(str, args)])


def test_every_stage_is_checked_before_any_build(pipe):
    r = _cli(pipe)  # default precision bf16; the stages are fp32
    assert r.exit_code == 2 and "stage-00" in r.output and "exported in float32" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    r = _cli(pipe, pipe / "x.engine")
    assert r.exit_code == 2 and "give no ENGINE_PATH" in r.output


@no_trt
def test_without_a_gpu_or_tensorrt_the_checked_pipeline_is_refused_in_one_line(pipe):
    """No TensorRT: refused naming it; TensorRT-RTX and no GPU: refused naming --target-cc for each stage."""
    r = _cli(pipe, "--precision", "fp32")
    lines = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output
    assert "TensorRT is not installed" in r.output or "--target-cc" in r.output, r.output
    assert not list(pipe.glob(f"*/{STAGE_ENGINE}"))
