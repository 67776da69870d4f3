"""`GenaiRunner` takes images as `OrtRunner` does: through the shared decode loop (`greedy_decode`,
`Decoding(with_images(...))`) onnxruntime-genai gives PyTorch's `K3ForConditionalGeneration` greedy tokens and
logits (prefill + 8 decode steps) for a prompt with two images of different sizes; the bad prompts it would run
silently are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from k3export.errors import K3ExportError
from k3export.runtime import greedy_decode
from k3export.runtime.loop import Images

pytest.importorskip("onnxruntime_genai")

from k3export.runtime.genai_runner import GenaiRunner  # noqa: E402

from test_vision_export_e2e import STEPS, export, inputs, model  # noqa: E402,F401  (fixtures)
from vision_helpers import MEDIA_PAD_ID, torch_reference, worst_against_reference  # noqa: E402

#: fp32 logits, genai against PyTorch: measured 1.3e-5 on this model; a wrong splice or state moves them by > 1e-2
ATOL = 1e-4


def _images(inputs) -> Images:
    return Images(inputs["pixel_values"].numpy(), inputs["grid_thws"].numpy())


def test_genai_runner_matches_pytorch_prefill_and_decode(model, export, inputs):
    want_logits, want_tokens = torch_reference(model, inputs, STEPS)
    runner = GenaiRunner(export)
    assert runner.takes_images and "vision.onnx" in runner.describe()
    worst = worst_against_reference(runner, inputs, want_logits, want_tokens, STEPS)
    assert worst < ATOL, worst
    print(f"max |genai - PyTorch| logits over prefill + {STEPS} steps: {worst:.2e}")
    # the images matter: the same prompt without them decodes to other logits
    plain = greedy_decode(GenaiRunner(export), inputs["input_ids"].numpy(), 0)
    assert not np.allclose(np.asarray(plain.last.logits)[:, -1], want_logits[0], atol=1e-3)


def test_greedy_decode_with_images(model, export, inputs):
    got = greedy_decode(GenaiRunner(export), inputs["input_ids"].numpy(), STEPS, images=_images(inputs)).tokens
    assert got.tolist() == [torch_reference(model, inputs, STEPS)[1]]


def test_genai_runner_refusals(export, inputs):
    ids = inputs["input_ids"].numpy()
    fewer = np.delete(ids, np.flatnonzero(ids[0] == MEDIA_PAD_ID)[0], axis=1)  # one placeholder fewer than tokens
    with pytest.raises(K3ExportError, match="placeholder tokens") as info:
        greedy_decode(GenaiRunner(export), fewer, 0, images=_images(inputs))
    assert "\n" not in str(info.value)
    bad = Images(inputs["pixel_values"].numpy()[:-4], inputs["grid_thws"].numpy())  # the grid covers more patches
    with pytest.raises(ValueError, match="grid_thws covers .* patches but pixel_values has"):
        greedy_decode(GenaiRunner(export), ids, 0, images=bad)
    with pytest.raises(K3ExportError, match="batch 1"):
        greedy_decode(GenaiRunner(export), np.concatenate([ids, ids]), 0, images=_images(inputs))
