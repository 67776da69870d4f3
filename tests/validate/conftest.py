"""Fixtures for the validation tests: a tiny K3, its ONNX export, the PyTorch reference runner.

TRITON_INTERPRET must be set before triton is first imported (the Triton runner runs the k3 kernels on CPU
tensors through the interpreter), so it is set here, at import time.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    from k3export.modeling import tiny_model

    return tiny_model(0)


@pytest.fixture(scope="session")
def model_dir(tiny, tmp_path_factory):
    from k3export.modeling import save_pretrained

    path = tmp_path_factory.mktemp("validate") / "model"
    save_pretrained(tiny, path)
    return path


@pytest.fixture(scope="session")
def onnx_dir(tiny, tmp_path_factory):
    """fp32 ONNX export of the same tiny model (exported in this session: the model code may change)."""
    export = pytest.importorskip("k3export.converters.onnx").export_onnx
    path = tmp_path_factory.mktemp("validate") / "onnx"
    export(tiny, path, dtype="fp32")
    return path


@pytest.fixture(scope="session")
def reference(tiny):
    from k3export.runtime import TorchRunner

    return TorchRunner(tiny)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The tiny model runs hundreds of small ops per step: on 2 shared cores one intra-op thread is several
    times faster than two (no oversubscription). Restored at the end of the session."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
