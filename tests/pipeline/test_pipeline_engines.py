"""``k3export build PIPELINE_DIR``: every stage checked before any build, one engine per stage folder, a stage
built the same way kept. Without TensorRT only the checks and the refusal run; the kept / rebuilt choice is tested
with TensorRT's entry points replaced by a stand-in that records which stages it was asked to build (it builds
nothing, and no test reads its file as an engine)."""

from __future__ import annotations

import importlib.util
import shutil
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from k3export.converters.tensorrt import build as trt_build
from k3export.pipeline.engines import STAGE_ENGINE, build_stage_engines

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


def test_a_stage_built_the_same_way_is_kept(pipe, monkeypatch):
    """Stage 0's engine has the sidecar this build would write: kept. Stage 1 has none, stage 2's names another
    TensorRT: both built, in order, each into its own folder."""
    trt = SimpleNamespace(__version__="10.99.0")
    monkeypatch.setattr("k3export.plugins.require_tensorrt", lambda: (trt, None))
    monkeypatch.setattr(trt_build, "_gpu_capability", lambda: ((9, 0), "stand-in GPU"))
    built = []
    monkeypatch.setattr(trt_build, "build_engine", lambda onnx_dir, engine, **_: built.append(engine))
    stages = sorted(p for p in pipe.iterdir() if p.name.startswith("stage-"))
    plan = trt_build.prepare_build(stages[0], "fp32")
    (stages[0] / STAGE_ENGINE).write_bytes(b"stand-in")
    sidecar = trt_build.engine_sidecar(plan, trt.__version__, "stand-in GPU", (9, 0), True)
    sidecar.write_for(stages[0] / STAGE_ENGINE)
    (stages[2] / STAGE_ENGINE).write_bytes(b"stand-in")
    other = trt_build.engine_sidecar(trt_build.prepare_build(stages[2], "fp32"), "10.0.0", "stand-in GPU", (9, 0),
                                     True)
    other.write_for(stages[2] / STAGE_ENGINE)
    lines: list[str] = []
    out = build_stage_engines(pipe, precision="fp32", progress=lines.append)
    assert out == [s / STAGE_ENGINE for s in stages]
    assert built == [stages[1] / STAGE_ENGINE, stages[2] / STAGE_ENGINE]
    assert "kept (built the same way)" in lines[0] and "building" in lines[1]
