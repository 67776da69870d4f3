"""``export --state-window W``: the decoder also returns each constant-size state after each of a call's last W
positions, so a call's last n tokens are taken back with no second call (`StepOutput.rolled_back`). Every rolled-back
state and its logits are checked against the PyTorch model run once over the shorter sequence."""

import json

import numpy as np
import pytest

from k3export.artifacts import ArtifactError, StateManifest
from k3export.errors import K3ExportError
from k3export.runtime import Decoding, Target, TorchRunner, make_runner, to_numpy
from k3export.runtime.speculate import PromptLookup, speculative_decode

W = 3
IDS = np.array([[5, 9, 17, 33, 65, 129, 257, 300, 12, 40, 41, 7]])
PAST = 4  # tokens before the call that is taken back


@pytest.fixture(scope="module")
def window_dirs(tiny, tmp_path_factory):
    from k3export.converters.onnx import export_onnx
    from k3export.pipeline import export_pipeline

    root = tmp_path_factory.mktemp("window")
    export_onnx(tiny, root / "functions", dtype="fp32", state_window=W)
    export_onnx(tiny, root / "inlined", dtype="fp32", state_window=W, form="inlined")
    export_onnx(tiny, root / "standard", dtype="fp32", state_window=W, form="standard")
    export_onnx(tiny, root / "ort", dtype="fp32", state_window=W, form="ort")
    export_pipeline(tiny, root / "pipeline", stage_plan=[range(0, 3), range(3, 6)], state_window=W)
    return root


def _runner(runtime, root):
    if runtime == "pipeline":
        from k3export.pipeline.runner import PipelineRunner

        return PipelineRunner(root / "pipeline")
    if runtime == "openvino":
        pytest.importorskip("openvino")
        return make_runner(runtime, Target(onnx_dir=root / "inlined"))
    if runtime == "ort-standard":  # KDA as LinearAttention-27, its convs as CausalConvWithState-27
        return make_runner("ort", Target(onnx_dir=root / "standard"))
    if runtime == "ort-ortform":  # the ort form: a windowed call's KDA is the k3 kda op's body (GatedDeltaNet gives
        return make_runner("ort", Target(onnx_dir=root / "ort"))  # no state per position)
    if runtime == "openvino-k3-ext":  # the functions form, each If as its general branch (`ov_ext.general_branches`)
        pytest.importorskip("openvino")
        from k3export.runtime import ov_ext
        from k3export.runtime.openvino_runner import OpenVinoRunner

        if ov_ext.library() is None:
            pytest.skip("the OpenVINO k3 extension cannot be built here")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(ov_ext.ENV_SWITCH, "1")
            runner = OpenVinoRunner(root / "functions")
        assert runner.k3_ext
        return runner
    return make_runner(runtime, Target(onnx_dir=root / "functions"))


def _close(got, want, what):
    # fp32 along two summation orders (a windowed call against PyTorch's one run, whose order moves with its thread
    # count): logits of size ~1 differ by up to ~3e-5; a state one token off moves them by ~5
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=5e-5, rtol=1e-4, err_msg=what)


@pytest.mark.parametrize("runtime", ["ort", "ort-standard", "ort-ortform", "openvino", "openvino-k3-ext", "onnx-reference",
                                     "pipeline"])
def test_rolled_back_state_equals_a_fresh_run_of_the_shorter_sequence(tiny, window_dirs, runtime):
    r, torch_runner = _runner(runtime, window_dirs), TorchRunner(tiny)
    prefix = r.prefill(IDS[:, :PAST])
    # fewer, more and as many as W
    for T in ((2, 5) if runtime in ("onnx-reference", "ort-standard", "ort-ortform") else (1, 2, 4, 8)):
        out = r.prefill(IDS[:, PAST:PAST + T], prefix)
        assert set(out.window) == {s.name for s in r.manifest.states if s.past_axis is None}
        assert out.can_roll_back == min(W, T - 1)
        if T == 1:  # every slot lies before the call: the state it was given (the one-token shortcut's window)
            for name, slots in out.window.items():
                for slot in to_numpy(slots):
                    _close(slot, prefix.state[name], f"{runtime} T=1 {name}")
        for n in range(out.can_roll_back + 1):
            back = out.rolled_back(n)
            fresh = torch_runner.prefill(IDS[:, :PAST + T - n])
            assert back.tokens.tolist() == IDS[:, :PAST + T - n].tolist() and back.mask.shape == (1, PAST + T - n)
            _close(back.logits[:, -1], fresh.logits[:, -1], f"{runtime} T={T} n={n} logits")
            for name in fresh.state:
                _close(back.state[name], fresh.state[name], f"{runtime} T={T} n={n} {name}")
            # decoding goes on from the rolled-back state as from the fresh one
            _close(r.prefill(IDS[:, -1:], back).logits, torch_runner.prefill(IDS[:, -1:], fresh).logits,
                   f"{runtime} T={T} n={n} next step")


def test_the_k3_ops_library_runs_the_window_and_its_one_token_branch(tiny, window_dirs, monkeypatch):
    from k3export.runtime.ort_ops import library

    if library() is None:
        pytest.skip("the k3 ORT ops library cannot be built here")
    monkeypatch.setenv("K3EXPORT_ORT_OPS", "1")
    r, torch_runner = _runner("ort", window_dirs), TorchRunner(tiny)
    assert r.ort.k3_ops
    out = r.prefill(IDS[:, PAST:PAST + 4], r.prefill(IDS[:, :PAST]))
    back = r.prefill(IDS[:, -1:], out.rolled_back(2))  # a one-token call after a rollback
    fresh = torch_runner.prefill(np.concatenate([IDS[:, :PAST + 2], IDS[:, -1:]], axis=1))
    for name in fresh.state:
        _close(back.state[name], fresh.state[name], name)


def test_left_padded_batch_rolls_back_each_row(tiny, window_dirs):
    ort, torch_runner = _runner("ort", window_dirs), TorchRunner(tiny)
    ids = np.array([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    new = np.array([[31, 32, 33, 34], [41, 42, 43, 44]])
    d = Decoding(ort)
    d.feed(ids, mask)
    out = d.feed(new)
    for n in range(1, W + 1):
        back = out.rolled_back(n)
        ref = Decoding(torch_runner)
        ref.feed(ids, mask)
        fresh = ref.feed(new[:, :4 - n])
        for name in fresh.state:
            _close(back.state[name], fresh.state[name], f"n={n} {name}")


def test_speculation_with_a_window_is_greedy_in_one_call_per_round(tiny, window_dirs):
    ort = _runner("ort", window_dirs)
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9]  # prompt lookup proposes, the tiny model often disagrees
    plain, out = [], ort.prefill(np.array([prompt]))
    for _ in range(12):
        plain.append(int(to_numpy(out.logits[0, -1]).argmax()))
        out = ort.prefill(np.array([[plain[-1]]]), out)
    res = speculative_decode(ort, prompt, 12, set(), PromptLookup(k=W))
    assert res.tokens == plain
    assert res.accepted < res.proposed, "every draft accepted: no rollback was exercised"
    assert res.calls == len(res.rounds), "a rejected draft cost a second call despite the state window"


def test_wider_draft_than_the_window_falls_back_to_feeding_again(tiny, window_dirs):
    from k3export.runtime.speculate import verify

    ort = _runner("ort", window_dirs)
    prefix = ort.prefill(IDS[:, :PAST])
    a, _, kept, calls = verify(ort, prefix, 1, [2, 3, 4, 5, 6])  # 5 draft tokens, W = 3
    if 5 - a > W:
        assert calls == 2
    fresh = TorchRunner(tiny).prefill(np.concatenate([IDS[:, :PAST], [[1, 2, 3, 4, 5, 6][:a + 1]]], axis=1))
    for name in fresh.state:
        _close(kept.state[name], fresh.state[name], name)


def test_manifest_records_the_window_and_old_manifests_read(tiny, window_dirs, tmp_path):
    data = json.loads((window_dirs / "functions" / StateManifest.FILE).read_text())
    assert data["state_window"] == W
    windows = [o for o in data["outputs"] if o["name"].startswith("present_window.")]
    assert {"name": "present_window.0.recurrent_state", "dtype": "float32", "shape": [W, "batch", 4, 16, 16]} \
        in windows and not any(".key" in o["name"] for o in windows)
    plain = StateManifest.from_config(tiny.config, "float32")
    assert "state_window" not in plain.to_json()
    assert StateManifest.from_json(plain.to_json()).state_window == 0
    bad = dict(data, state_window=W + 1)
    with pytest.raises(ArtifactError, match="outputs"):
        StateManifest.from_json(bad).check_config(tiny.config)
    with pytest.raises(ArtifactError, match="state_window"):
        StateManifest.from_json(dict(data, state_window=-1))


def test_bad_window_requests_are_refused_in_one_line(tiny, window_dirs, tmp_path):
    from k3export.converters.onnx import export_onnx

    with pytest.raises(K3ExportError, match="state_window=65: expected an int in"):
        export_onnx(tiny, tmp_path / "a", state_window=65)
    with pytest.raises(K3ExportError, match="genai's config cannot name the state window"):
        export_onnx(tiny, tmp_path / "b", state_window=2, genai=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    out = _runner("ort", window_dirs).prefill(IDS[:, :3])
    with pytest.raises(K3ExportError, match="cannot take back 3 tokens: this call fed 3"):
        out.rolled_back(3)
    plain = TorchRunner(tiny).prefill(IDS[:, :3])
    with pytest.raises(K3ExportError, match="state window holds 0"):
        plain.rolled_back(1)
