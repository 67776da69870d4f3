"""Keeping, forking and resuming a state on every runtime: one implementation (`Runner.prefill` / `fork`,
`Decoding`), each continuation equal to a fresh recompute over the whole sequence, the input state never changed."""

import numpy as np
import pytest

from k3export.artifacts import State
from k3export.errors import K3ExportError
from k3export.runtime import to_numpy

EXPORT_RUNTIMES = ("ort", "openvino", "onnx-reference")  # the runtimes of the `make` fixture that run an export

PREFIX = np.array([[5, 9, 17, 33, 65, 129, 257]])
A, B = np.array([[7, 8, 9]]), np.array([[300, 301]])


def _snapshot(out):
    return {k: to_numpy(v).copy() for k, v in out.state.items()}


@pytest.mark.parametrize("runtime", ["torch", *EXPORT_RUNTIMES])
def test_fork_resume_equal_recompute_and_input_state_untouched(make, runtime, tmp_path):
    r = make(runtime)
    prefix = r.prefill(PREFIX)
    before = _snapshot(prefix)
    a = r.prefill(A, prefix)
    b = r.prefill(B, r.fork(prefix))
    loaded = r.prefill(A, State.load(prefix.save(tmp_path / "p.k3state"), r))
    for name, v in prefix.state.items():  # the runner wrote nothing into the state it was given
        assert np.array_equal(to_numpy(v), before[name]), f"{runtime} changed its input state {name} in place"
    for cont, ids in ((a, A), (b, B), (loaded, A)):
        fresh = r.prefill(np.concatenate([PREFIX, ids], axis=1))
        np.testing.assert_allclose(to_numpy(cont.logits), to_numpy(fresh.logits)[:, -ids.shape[1]:], atol=1e-4)
        for name in fresh.state:
            np.testing.assert_allclose(to_numpy(cont.state[name]), to_numpy(fresh.state[name]), atol=1e-4,
                                       err_msg=name)
        assert cont.tokens.tolist() == np.concatenate([PREFIX, ids], axis=1).tolist()


def test_state_of_one_runtime_resumes_on_another_of_the_same_export(make, tmp_path):
    path = make("ort").prefill(PREFIX).save(tmp_path / "p.k3state")
    ref = make("onnx-reference")
    out = ref.prefill(A, State.load(path, ref))
    fresh = ref.prefill(np.concatenate([PREFIX, A], axis=1))
    np.testing.assert_allclose(to_numpy(out.logits), to_numpy(fresh.logits)[:, -3:], atol=1e-4)
    with pytest.raises(K3ExportError, match="field 'export_sha256': the state belongs to another export"):
        make("torch").prefill(A, State.load(path, ref))  # a checkpoint is not its export: states do not cross


def test_pipeline_runner_keeps_and_resumes_state(tiny, tmp_path):
    from k3export.converters.onnx import export_onnx
    from k3export.pipeline import export_pipeline
    from k3export.pipeline.runner import PipelineRunner
    from k3export.runtime import Target, make_runner

    export_pipeline(tiny, tmp_path / "p", stage_plan=[range(0, 3), range(3, 6)])
    r = PipelineRunner(tmp_path / "p")
    prefix = r.prefill(PREFIX)
    before = _snapshot(prefix)
    out = r.prefill(A, State.load(prefix.save(tmp_path / "s.k3state"), r))
    fork = r.prefill(A, r.fork(prefix))
    assert all(np.array_equal(to_numpy(prefix.state[k]), v) for k, v in before.items())
    fresh = r.prefill(np.concatenate([PREFIX, A], axis=1))
    for cont in (out, fork):
        np.testing.assert_allclose(to_numpy(cont.logits), to_numpy(fresh.logits)[:, -3:], atol=1e-4)
    export_onnx(tiny, tmp_path / "single", dtype="fp32")
    with pytest.raises(K3ExportError, match="belongs to another export"):
        make_runner("ort", Target(onnx_dir=tmp_path / "single")).prefill(A, State.load(tmp_path / "s.k3state", r))


def test_genai_cannot_resume_a_given_state_and_says_so(export_dir, tmp_path):
    from k3export.runtime.genai_runner import genai_status

    if genai_status() is not None:
        pytest.skip(genai_status())
    from k3export.converters.onnx import export_onnx
    from k3export.modeling import tiny_model
    from k3export.runtime.genai_runner import GenaiRunner

    export_onnx(tiny_model(0), tmp_path / "g", dtype="fp32", genai=True)
    r = GenaiRunner(tmp_path / "g")
    prefix = r.prefill(PREFIX)
    with pytest.raises(K3ExportError, match="onnxruntime-genai starts from its own zero state|genai carries its own"):
        r.prefill(A, r.fork(prefix))
