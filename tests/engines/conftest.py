"""Fixtures of the real TensorRT-RTX engine builds (`trt_builds`): the tiny K3's exports and their engines, each
built once per session; skipped, with the reason, where TensorRT-RTX cannot build here."""

from __future__ import annotations

from pathlib import Path

import pytest
from trt_builds import build, export_fp32, rtx_reason  # tests/engines is on sys.path

from k3export.plugins.flavour import load_flavour


@pytest.fixture(scope="session")
def rtx():
    why = rtx_reason()
    if why is not None:
        pytest.skip(why)
    return load_flavour()


@pytest.fixture(scope="session")
def dense_export(tiny_k3, tmp_path_factory) -> Path:
    return export_fp32(tiny_k3, tmp_path_factory, "trt_dense")


@pytest.fixture(scope="session")
def mxfp4_export(released_random, tmp_path_factory) -> Path:
    """The released-layout tiny (MXFP4 experts of random valid values) exported keeping its MXFP4 experts."""
    return export_fp32(released_random, tmp_path_factory, "trt_mxfp4", experts="mxfp4")


@pytest.fixture(scope="session")
def pipeline_export(tiny_k3, tmp_path_factory) -> Path:
    from k3export.pipeline.export import export_pipeline

    out = tmp_path_factory.mktemp("trt_pipe") / "pipe"
    export_pipeline(tiny_k3, out, stages=2, dtype="fp32")
    return out


@pytest.fixture(scope="session")
def dense_inlined_export(tiny_k3, tmp_path_factory) -> Path:
    """The dense export in the ``inlined`` graph form (k3 functions inlined)."""
    return export_fp32(tiny_k3, tmp_path_factory, "trt_dense_inlined", form="inlined")


@pytest.fixture(scope="session")
def mxfp4_inlined_export(released_random, tmp_path_factory) -> Path:
    """The MXFP4-expert export in the ``inlined`` graph form."""
    return export_fp32(str(released_random), tmp_path_factory, "trt_mxfp4_inlined", experts="mxfp4",
                       form="inlined")


@pytest.fixture(scope="session")
def engine_of(rtx, tmp_path_factory):
    """``engine_of(export_dir)``: the engine of that export, built once per session (`trt_builds.build`)."""
    built: dict[Path, Path] = {}

    def get(onnx_dir: Path) -> Path:
        if onnx_dir not in built:
            built[onnx_dir] = build(onnx_dir, tmp_path_factory.mktemp("trt_engine") / "model.engine")
        return built[onnx_dir]

    return get


@pytest.fixture(scope="session")
def dense_engine(engine_of, dense_export) -> Path:
    return engine_of(dense_export)


@pytest.fixture(scope="session")
def mxfp4_engine(engine_of, mxfp4_export) -> Path:
    return engine_of(mxfp4_export)
