"""The tiny K3 (the root conftest's `tiny_k3`) and its fp32 export with per-layer debug outputs."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny(tiny_k3):
    return tiny_k3


@pytest.fixture(scope="session")
def export_dir(tiny, tmp_path_factory) -> Path:
    from k3export.converters.onnx import export_onnx

    out = tmp_path_factory.mktemp("runtime") / "export"
    export_onnx(tiny, out, dtype="fp32", debug_outputs=True)
    return out
