"""Runners: the registry, the PyTorch runners' state naming (the contract), and the session runner's checks."""

import numpy as np
import pytest

from k3export.artifacts import ArtifactError, StateManifest, load_export
from k3export.errors import K3ExportError
from k3export.modeling import K3Cache, contract
from k3export.runtime import (
    RUNNERS, RuntimeUnavailable, SessionRunner, Target, TorchRunner, TritonRunner, make_runner, tensorrt_status,
    to_numpy, triton_status,
)


def test_registry_names_every_runtime(tiny, export_dir):
    assert {"torch", "triton", "ort", "ort-cuda", "trt"} <= set(RUNNERS)  # other packages may add theirs
    assert make_runner("torch", Target(model=tiny)).name == "torch"
    assert make_runner("ort", Target(onnx_dir=export_dir)).name == "ort"
    with pytest.raises(K3ExportError, match="unknown runtime 'tvm'"):
        make_runner("tvm", Target())
    with pytest.raises(K3ExportError, match="runtime ort needs --onnx"):
        make_runner("ort", Target(model=tiny))
    with pytest.raises(K3ExportError, match="runtime torch needs a model"):
        make_runner("torch", Target())


@pytest.mark.skipif(tensorrt_status() is None, reason="TensorRT is usable here: the guard is not exercised")
def test_trt_unavailable_says_why(export_dir):
    with pytest.raises(RuntimeUnavailable, match="trt runner: TensorRT"):
        make_runner("trt", Target(onnx_dir=export_dir, engine="x.engine"))


@pytest.mark.skipif(triton_status("cpu") is None, reason="the Triton kernels can run here")
def test_triton_unavailable_says_why(tiny):
    with pytest.raises(RuntimeUnavailable, match="triton runner: "):
        TritonRunner(tiny)


def test_torch_runner_names_state_as_the_contract(tiny):
    runner = TorchRunner(tiny)
    assert runner.manifest == StateManifest.from_config(tiny.config, "float32", debug_outputs=True)
    ids = np.random.default_rng(1).integers(3, 512, (2, 5))
    out = runner.prefill(ids)
    specs = contract.state_specs(tiny.config)
    assert list(out.state) == [s.name for s in specs]
    for s in specs:
        t = out.state[s.name]
        assert tuple(t.shape) == s.concrete_shape(2, 5), s.name
        assert str(t.dtype) == f"torch.{s.resolved_dtype('float32')}"
    again = K3Cache.from_states(tiny.config, out.state).to_states()
    for name, t in out.state.items():
        assert np.array_equal(to_numpy(t), to_numpy(again[name])), name
    a = runner.prefill(ids[:, :2])
    b = runner.prefill(ids[:, 2:], a.state)
    np.testing.assert_allclose(to_numpy(b.logits), to_numpy(out.logits)[:, 2:], rtol=0, atol=1e-4)
    with pytest.raises(K3ExportError, match="step\\(\\) takes one token"):
        runner.step(ids, out.state)


def test_torch_runner_from_pretrained(tiny, tmp_path):
    from k3export.modeling import save_pretrained

    save_pretrained(tiny, tmp_path / "m")
    ids = np.array([[4, 5, 6]])
    r = TorchRunner.from_pretrained(tmp_path / "m")
    # not bit for bit: the session's model may hold its experts restacked by an earlier test (`ops.expert_stacks`),
    # which changes the order of the sums
    np.testing.assert_allclose(to_numpy(r.prefill(ids).logits), to_numpy(TorchRunner(tiny).prefill(ids).logits),
                               rtol=0, atol=1e-5)
    with pytest.raises(K3ExportError, match="not a model folder"):
        TorchRunner.from_pretrained(tmp_path / "nothing")


class _Session:
    def __init__(self, inputs, outputs):
        self.input_names, self.output_names = list(inputs), list(outputs)

    def run(self, feeds):
        raise AssertionError("never called")


def test_session_runner_checks_the_sessions_io(export_dir):
    exp = load_export(export_dir)
    ins, outs = exp.manifest.graph_io()
    SessionRunner(exp, _Session(ins, outs))
    with pytest.raises(ArtifactError, match="inputs do not match .*missing \\['attention_mask'\\]"):
        SessionRunner(exp, _Session([n for n in ins if n != "attention_mask"], outs))
    with pytest.raises(ArtifactError, match="outputs do not match .*unexpected \\['extra'\\]"):
        SessionRunner(exp, _Session(ins, [*outs, "extra"]))
    runner = SessionRunner(exp, _Session(ins, outs))
    state = runner.initial_state(1)
    state.pop("past_key_values.0.conv_state")
    with pytest.raises(ArtifactError, match="state 'past_key_values.0.conv_state' missing"):
        runner.prefill(np.array([[1, 2]]), state)


@pytest.mark.parametrize("runtime", ["ort", "openvino"])
def test_opening_an_export_parses_its_graph_once(export_dir, monkeypatch, runtime):
    """`load_export` parses model.onnx (weights not loaded) to check it; the runner and its session take that graph
    (`ExportFolder.graph`) instead of reading the file again. The runtime itself still reads the file it runs."""
    import onnx

    from k3export.runtime.openvino_runner import OpenVinoRunner
    from k3export.runtime.ort_runner import OrtRunner

    if runtime == "openvino":
        pytest.importorskip("openvino")
    parsed = []
    load = onnx.load
    monkeypatch.setattr(onnx, "load", lambda f, *a, **k: parsed.append(str(f)) or load(f, *a, **k))
    runner = (OrtRunner if runtime == "ort" else OpenVinoRunner)(export_dir)
    assert parsed.count(str(export_dir / "model.onnx")) == 1, parsed
    out = runner.forward(np.array([[1, 2, 3]], np.int64), runner.initial_state(1), np.ones((1, 3), np.int64))
    assert np.isfinite(out.logits).all()
