"""`k3export run` is the shared decode loop over the TensorRT runner. TensorRT is absent here, so the engine is
served by an ONNX Runtime session behind the same session interface (`TrtSession`'s): the loop, the feeds (every
input the manifest declares, the attention mask included) and the CLI are the real ones. Also: the TensorRT
optimisation profiles take each dimension's role from the manifest's contract dimensions."""

import ast
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from k3export.runtime import OrtSession, greedy_decode
from k3export.runtime import trt_runner


def _cli(*args):
    from k3export_cli.main import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    return res


@pytest.fixture(scope="module")
def default_export(tmp_path_factory):
    """`k3export tiny` then a default `k3export export` (attention_mask input on)."""
    root = tmp_path_factory.mktemp("run")
    assert _cli("tiny", root / "model", "--seed", "3").exit_code == 0
    res = _cli("export", root / "model", root / "onnx")
    assert res.exit_code == 0, res.output
    return root


class OrtBackedSession(OrtSession):
    """What `TrtSession(engine_path, export)` is to the runner, served by ONNX Runtime; records every feed."""

    calls: list = []

    def __init__(self, engine_path, export):
        super().__init__(export.model_path)
        OrtBackedSession.calls = []

    def run(self, feeds):
        OrtBackedSession.calls.append({k: np.shape(v) for k, v in feeds.items()})
        return super().run(feeds)


def test_run_drives_a_default_export_through_the_shared_loop(default_export, monkeypatch):
    from k3export.artifacts import load_export
    from k3export.runtime import TorchRunner, load_model

    root = default_export
    assert "attention_mask" in load_export(root / "onnx").manifest.input_names
    engine = root / "tiny.engine"
    engine.write_bytes(b"served by onnxruntime in this test")
    monkeypatch.setattr(trt_runner, "TrtSession", OrtBackedSession)
    monkeypatch.setattr(trt_runner, "tensorrt_status", lambda: None)
    res = _cli("run", engine, "--onnx-dir", root / "onnx", "--prompt-len", 5, "--steps", 3, "--batch", 2,
               "--seed", 7)
    assert res.exit_code == 0, res.output
    tokens = ast.literal_eval(re.search(r"greedy tokens: (\[.*\])", " ".join(res.output.split())).group(1))

    # the PyTorch reference, fed the same prompt
    model = load_model(root / "model")
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, size=(2, 5), dtype=np.int64)
    assert tokens == greedy_decode(TorchRunner(model), ids, steps=3).tokens.tolist()

    calls = OrtBackedSession.calls
    assert len(calls) == 4  # prefill + 3 steps
    manifest = load_export(root / "onnx").manifest
    for n, feeds in enumerate(calls):
        assert set(feeds) == set(manifest.graph_io()[0])
        new = 5 if n == 0 else 1
        past = 0 if n == 0 else 5 + n - 1
        assert feeds["input_ids"] == (2, new) and feeds["attention_mask"] == (2, past + new)
        assert feeds["past_key_values.2.key"] == (2, 1, past, 20)


def test_run_without_tensorrt_is_one_line(default_export):
    if trt_runner.tensorrt_status() is None:
        pytest.skip("TensorRT is usable here")
    engine = default_export / "none.engine"
    engine.write_bytes(b"x")
    res = _cli("run", engine, "--onnx-dir", default_export / "onnx")
    assert res.exit_code == 2 and "trt runner: TensorRT" in res.output


def test_run_names_a_missing_engine_before_tensorrt(tmp_path):
    res = _cli("run", tmp_path / "nonexistent.engine")
    assert res.exit_code == 2 and "nonexistent.engine: no such engine file" in res.output
    assert "TensorRT" not in res.output.replace("k3export build", "")


def test_profiles_take_roles_from_the_contract_dims(default_export):
    from k3export.converters.tensorrt import ProfileError, checks, dim_roles, prepare_build

    plan = prepare_build(default_export / "onnx", "fp32", max_batch=2, max_seq=16, max_context=32)
    manifest = plan["export"].manifest
    roles = dim_roles(manifest)
    assert roles["input_ids"] == ["batch", "seq"] and roles["attention_mask"] == ["batch", "total"]
    assert roles["past_key_values.2.key"] == ["batch", "static", "past", "static"]
    assert roles["past_key_values.0.recurrent_state"] == ["batch", "static", "static", "static"]
    prefill, decode = plan["profiles"]
    assert prefill.shapes["input_ids"] == ((1, 1), (2, 8), (2, 16))
    assert decode.shapes["input_ids"] == ((1, 1), (2, 1), (2, 1))
    assert prefill.shapes["attention_mask"] == ((1, 1), (2, 8), (2, 48))
    assert decode.shapes["past_key_values.2.key"] == ((1, 1, 0, 20), (2, 1, 16, 20), (2, 1, 32, 20))
    assert set(prefill.shapes) == set(manifest.graph_io()[0])
    assert {v.name for v in plan["model"].graph.input} == set(manifest.graph_io()[0])  # logits_to_keep: a constant
    feeds = {n: lo for n, (lo, _, _) in decode.shapes.items()}
    checks.check_feed_shapes(feeds, decode, roles)
    with pytest.raises(ProfileError, match="axis 2 is 33.*--max-context"):
        checks.check_feed_shapes({**feeds, "past_key_values.2.key": (1, 1, 33, 20)}, decode, roles)
    with pytest.raises(ProfileError, match="max_seq=0"):
        prepare_build(default_export / "onnx", "fp32", max_seq=0)
