"""The real thing: build the tiny engine with the k3 plugins, run prefill + decode, compare with PyTorch.

Needs TensorRT >= 10.9 (with tensorrt.plugin) and an NVIDIA GPU; skipped otherwise with the reason."""

import numpy as np
import pytest

trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install tensorrt-cu12 on a GPU machine)")
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.tensorrt, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="TensorRT engines need a CUDA GPU")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from k3export.converters.onnx import export_onnx
    from k3export.converters.tensorrt import build_engine
    from k3export.modeling import tiny_model

    model = tiny_model(seed=0)
    root = tmp_path_factory.mktemp("trt")
    export_onnx(model, root / "onnx", dtype="fp32")
    path = build_engine(root / "onnx", root / "tiny.engine", precision="fp32", max_batch=2, max_seq=32,
                        max_context=64, timing_cache=root / "timing.cache", progress=None)
    return model, root / "onnx", path


def test_prefill_and_decode_match_pytorch(engine):
    """Through the validation harness: prefill + decode, chunked prefill, batch 2, every state compared."""
    from k3export.validate.api import run_validation

    model, onnx_dir, path = engine
    run = run_validation(model, runtimes=["trt"], onnx_dir=onnx_dir, engine=path, prompt_len=8, steps=8,
                         batch=2, device="cuda", strict=True)
    assert run.result.passed, run.result.localisation


def test_feed_outside_profile_is_rejected_before_tensorrt(engine):
    from k3export.artifacts.export_folder import load_export
    from k3export.converters.tensorrt import ProfileError
    from k3export.runtime.trt_runner import TrtSession

    _, onnx_dir, path = engine
    export = load_export(onnx_dir)
    sess = TrtSession(path, export)
    with pytest.raises(ProfileError, match="input_ids.*--max-seq"):
        sess.run({"input_ids": np.zeros((1, 33), np.int64), **export.manifest.initial_state(1)})
