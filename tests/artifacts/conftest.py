"""A tiny fp32 export (made once per session) and a fixture that copies it for a test to damage."""

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    from k3export.converters.onnx import export_onnx
    from k3export.modeling import tiny_model

    out = tmp_path_factory.mktemp("artifacts") / "export"
    export_onnx(tiny_model(0), out, dtype="fp32")
    return out


@pytest.fixture
def copy_export(export_dir, tmp_path):
    """A fresh copy of the export to damage."""

    def make(name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(export_dir, dst)
        return dst

    return make


@pytest.fixture(scope="session")
def tiny_export_other(tmp_path_factory):
    """Two exports a state of `export_dir` must not be fed to: another model (seed 1), and the same in float16."""
    from k3export.converters.onnx import export_onnx
    from k3export.modeling import tiny_model

    root = tmp_path_factory.mktemp("other")
    export_onnx(tiny_model(1), root / "seed1", dtype="fp32")
    export_onnx(tiny_model(0), root / "fp16", dtype="fp16")
    return root / "seed1", root / "fp16"
