"""The tiny K3 (the root conftest's `tiny_k3`) and its fp32 exports with per-layer debug outputs: the default graph
form (`export_dir`) and the standard form (`standard_dir`, what OpenVINO reads), and a runner of each runtime."""

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


@pytest.fixture(scope="session")
def standard_dir(tiny, tmp_path_factory) -> Path:
    from k3export.converters.onnx import export_onnx

    out = tmp_path_factory.mktemp("runtime") / "standard"
    export_onnx(tiny, out, dtype="fp32", debug_outputs=True, form="standard")
    return out


#: the runtimes that run the tiny export on this CPU, and the export fixture each reads
EXPORT_RUNTIMES = {"ort": "export_dir", "openvino": "standard_dir", "openvino-stateless": "standard_dir",
                   "onnx-reference": "export_dir"}


@pytest.fixture
def make(request, tiny):
    """``make(runtime)``: a fresh runner of `runtime` (torch: the tiny model; others: the export it reads)."""
    from k3export.runtime import Target, TorchRunner, make_runner

    def build(runtime: str):
        if runtime == "torch":
            return TorchRunner(tiny)
        if runtime.startswith("openvino"):
            pytest.importorskip("openvino")
        return make_runner(runtime, Target(onnx_dir=request.getfixturevalue(EXPORT_RUNTIMES[runtime])))

    return build
