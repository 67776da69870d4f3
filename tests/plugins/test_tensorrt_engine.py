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
    from k3export.converters.tensorrt import TrtSession
    from k3export.runtime.manifest import StateManifest

    model, onnx_dir, path = engine
    manifest = StateManifest.load(onnx_dir)
    sess = TrtSession(path, onnx_dir)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(2, 7), dtype=np.int64)
    state = manifest.initial_state(2)
    cache = None
    with torch.no_grad():
        ref = model(torch.from_numpy(ids), use_cache=True)
    outs = sess.run({"input_ids": ids, **state})
    np.testing.assert_allclose(outs["logits"], ref.logits.numpy(), rtol=2e-3, atol=2e-3)
    cache = ref.cache
    for _ in range(3):
        nxt = outs["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        state = {s.name: outs[s.present] for s in manifest.states}
        outs = sess.run({"input_ids": nxt, **state})
        with torch.no_grad():
            ref = model(torch.from_numpy(nxt), cache=cache, use_cache=True)
        cache = ref.cache
        np.testing.assert_allclose(outs["logits"], ref.logits.numpy(), rtol=2e-3, atol=2e-3)


def test_feed_outside_profile_is_rejected_before_tensorrt(engine):
    from k3export.converters.tensorrt import ProfileError, TrtSession
    from k3export.runtime.manifest import StateManifest

    _, onnx_dir, path = engine
    manifest = StateManifest.load(onnx_dir)
    sess = TrtSession(path, onnx_dir)
    with pytest.raises(ProfileError, match="input_ids.*--max-seq"):
        sess.run({"input_ids": np.zeros((1, 33), np.int64), **manifest.initial_state(1)})
