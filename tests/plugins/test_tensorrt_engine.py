"""The real thing on a GPU: build the tiny engine with the k3 plugins, run prefill + decode, compare with PyTorch.

Needs a TensorRT (datacenter, or TensorRT-RTX on a GPU it builds for) and an NVIDIA GPU; skipped otherwise with the
reason. Engines are built without a GPU in tests/engines; running one is what needs the GPU."""

import numpy as np
import pytest

from k3export.plugins.flavour import flavour_status, load_flavour

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.tensorrt, pytest.mark.gpu,
              pytest.mark.skipif(flavour_status() is not None, reason=f"no TensorRT here: {flavour_status()}"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="running a TensorRT engine needs a CUDA GPU")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from k3export.converters.onnx import export_onnx
    from k3export.converters.tensorrt import build_engine
    from k3export.modeling import tiny_model

    flavour = load_flavour()
    cc = tuple(torch.cuda.get_device_capability())
    if flavour.targets is not None and cc not in flavour.targets:
        pytest.skip(f"{flavour.label} cannot build for this GPU (compute capability {cc[0]}.{cc[1]}); it builds for "
                    f"{', '.join(f'{a}.{b}' for a, b in flavour.targets)}")
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
