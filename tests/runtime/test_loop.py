"""The one decode loop: the attention-mask builder, `Decoding` and `greedy_decode`, checked against PyTorch's own
``generate`` and against unpadded single-prompt runs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from k3export.errors import K3ExportError
from k3export.runtime import Decoding, OrtRunner, TorchRunner, greedy_decode, left_pad, to_numpy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8, 9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 8, 9]] and mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == np.int64
    with pytest.raises(K3ExportError, match="at least one token"):
        left_pad([[1], []])


def test_greedy_decode_equals_transformers_generate(tiny):
    ids = torch.tensor([PROMPTS[0]])
    expected = tiny.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    result = greedy_decode(TorchRunner(tiny), ids.numpy(), steps=5)
    assert result.tokens.shape == (1, 6) and result.tokens[0].tolist() == expected


@pytest.mark.parametrize("runtime", ["torch", "ort", "openvino", "onnx-reference"])
def test_left_padded_batch_equals_each_prompt_alone(tiny, make, runtime):
    runner = make(runtime)
    ids, mask = left_pad(PROMPTS, pad_id=tiny.config.pad_token_id)
    batch = greedy_decode(runner, ids, steps=4, attention_mask=mask)
    reference = TorchRunner(tiny)
    for row, prompt in enumerate(PROMPTS):
        alone = greedy_decode(reference, np.array([prompt]), steps=4)
        assert batch.tokens[row].tolist() == alone.tokens[0].tolist(), (runtime, row)
        np.testing.assert_allclose(to_numpy(batch.last.logits)[row], to_numpy(alone.last.logits)[0], atol=1e-4)


@pytest.mark.parametrize("runtime", ["ort", "openvino", "onnx-reference"])
def test_export_through_the_loop_matches_torch(tiny, make, runtime):
    ids = np.array(PROMPTS[:1] * 2)
    a = greedy_decode(TorchRunner(tiny), ids, steps=6)
    b = greedy_decode(make(runtime), ids, steps=6)
    assert a.tokens.tolist() == b.tokens.tolist()
    np.testing.assert_allclose(to_numpy(b.last.logits), to_numpy(a.last.logits), atol=1e-4)
    for name, ref in a.last.state.items():
        np.testing.assert_allclose(to_numpy(b.last.state[name]), to_numpy(ref), atol=1e-4, err_msg=name)


def test_decoding_carries_mask_and_state_across_chunks(tiny):
    runner = TorchRunner(tiny)
    ids, mask = left_pad(PROMPTS[1:], pad_id=0)
    one = Decoding(runner)
    whole = one.feed(ids, mask)
    two = Decoding(runner)
    two.feed(ids[:, :2], mask[:, :2])
    rest = two.feed(ids[:, 2:], mask[:, 2:])
    assert two.mask.tolist() == one.mask.tolist() == mask.tolist()
    np.testing.assert_allclose(to_numpy(rest.logits), to_numpy(whole.logits)[:, 2:], atol=1e-4)
    step = two.feed(np.array([[3], [4]]))
    assert two.mask.shape == (2, ids.shape[1] + 1) and two.mask[:, -1].tolist() == [1, 1]
    assert step.logits.shape[:2] == (2, 1)
    with pytest.raises(K3ExportError, match="attention_mask of the new tokens"):
        two.feed(np.array([[3], [4]]), np.ones((2, 2)))
    with pytest.raises(K3ExportError, match="does not match the carried state's batch"):
        two.feed(np.array([[3]]))


def test_ort_runner_sets_the_session_options_the_export_recommends(export_dir, tmp_path):
    import shutil

    from k3export.artifacts import ORT_SESSION_OPTIONS, RuntimeConfig

    assert RuntimeConfig.read(export_dir).session_options == ORT_SESSION_OPTIONS == {"enable_mem_pattern": False}
    opts = OrtRunner(export_dir).ort.session.get_session_options()
    assert opts.enable_mem_pattern is False  # onnxruntime's default is True
    edited = Path(shutil.copytree(export_dir, tmp_path / "edited"))
    rc = json.loads((edited / RuntimeConfig.FILE).read_text())
    rc["session_options"] = {"enable_mem_patern": False}  # misspelt: named, not ignored
    (edited / RuntimeConfig.FILE).write_text(json.dumps(rc))
    with pytest.raises(K3ExportError, match="SessionOptions has no 'enable_mem_patern'"):
        OrtRunner(edited)


@pytest.mark.parametrize("runtime", ["torch", "ort", "openvino", "onnx-reference"])
def test_logits_to_keep_returns_the_last_positions_only(tiny, make, runtime):
    """What generation sets: the last position's logits (PyTorch's own full run as the reference), the same state."""
    ids = np.array(PROMPTS[:1] * 2)
    full = greedy_decode(TorchRunner(tiny), ids, steps=0).last
    runner = make(runtime)
    runner.logits_to_keep = 1
    last = runner.prefill(ids)
    assert tuple(last.logits.shape) == (2, 1, tiny.config.vocab_size)
    np.testing.assert_allclose(to_numpy(last.logits), to_numpy(full.logits)[:, -1:], atol=1e-4)
    for name, ref in full.state.items():
        np.testing.assert_allclose(to_numpy(last.state[name]), to_numpy(ref), atol=1e-4, err_msg=name)
