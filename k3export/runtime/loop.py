"""The one way to run an artifact: the attention-mask builder, a decoding that carries state and mask, and the
greedy-decode loop (prefill + N steps) every command and bench uses.

    ids, mask = left_pad([[5, 6, 7], [8, 9]], pad_id=0)     # [[5, 6, 7], [0, 8, 9]], [[1, 1, 1], [0, 1, 1]]
    result = greedy_decode(runner, ids, steps=8, attention_mask=mask)
    result.tokens  [B, steps + 1]: the argmax after the prefill, then after every decode step

Mask semantics are PyTorch's (and the exported graph's): ``attention_mask`` int64 [batch, past + new] spans every
token fed so far; 0 marks a (left) pad token. A decode step appends one column of ones.

Images (an image + text model or export): `Images` holds one prompt's packed images as `K3Processor` returns them;
``greedy_decode(runner, ids, steps, images=Images(pixel_values, grid_thws))`` hands them to the prefill, whose
placeholder tokens they replace, and decodes by token ids. The hook is one keyword: a runner that takes images
(``takes_images`` true: `TorchRunner` of a `K3ForConditionalGeneration`, a `SessionRunner`, `GenaiRunner` or pipeline
runner of an export with image graphs) accepts ``forward(..., images=Images)``; `with_images` wraps it so that the
next `Decoding.feed` passes them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from k3export.errors import K3ExportError

from .base import Decoding, Runner, RunnerWrapper, StepOutput, Tensor, to_numpy


@dataclass(frozen=True)
class Images:
    """One prompt's images, packed (NaViT): ``pixel_values`` [patches, C, p, p] (or [patches, C * p * p]) and
    ``grid_thws`` int64 [images, 3] (frames, rows, columns in patches), in prompt order (`K3Processor`'s output)."""

    pixel_values: Tensor
    grid_thws: Tensor


class _PrefillImages(RunnerWrapper):
    """`inner` with `images` handed to its next forward (the prefill); every later call is the inner runner's."""

    def __init__(self, inner: Runner, images: Images) -> None:
        super().__init__(inner)
        self.pending: Images | None = images

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray) -> StepOutput:
        images, self.pending = self.pending, None
        if images is None:
            return self.inner.forward(input_ids, state, attention_mask)
        return self.inner.forward(input_ids, state, attention_mask, images=images)  # type: ignore[call-arg]


def with_images(runner: Runner, images: Images | None) -> Runner:
    """`runner` whose next call (the prefill) gets `images`; `runner` itself without images. A runner that cannot
    take images is refused in one line."""
    if images is None:
        return runner
    if not getattr(runner, "takes_images", False):
        raise K3ExportError(f"runtime {runner.name} cannot take images: it runs a text-only model or export (an image "
                            "needs a checkpoint with a vision tower, or an export of one)")
    return _PrefillImages(runner, images)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of different lengths -> (ids [B, P], attention_mask [B, P]) left-padded to the longest, P."""
    if not rows or any(len(r) == 0 for r in rows):
        raise K3ExportError("every prompt needs at least one token")
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def next_tokens(out: StepOutput) -> np.ndarray:
    """Greedy choice after a call: argmax of the last position's logits, int64 [B]."""
    return to_numpy(out.logits[:, -1], np.float32).argmax(-1).astype(np.int64)


@dataclass
class GreedyResult:
    tokens: np.ndarray  # int64 [B, steps + 1]
    prefill_seconds: float
    decode_seconds: float
    last: StepOutput


def greedy_decode(runner: Runner, input_ids: Tensor, steps: int, attention_mask: Tensor | None = None,
                  images: Images | None = None) -> GreedyResult:
    """Prefill `input_ids` (left-padded rows: pass their mask; with `images`, spliced over its placeholder
    tokens), then `steps` greedy decode steps."""
    if steps < 0:
        raise K3ExportError(f"steps must be >= 0, got {steps}")
    d = Decoding(with_images(runner, images))
    t0 = time.perf_counter()
    out = d.feed(input_ids, attention_mask)
    tokens = [next_tokens(out)]
    t1 = time.perf_counter()
    for _ in range(steps):
        out = d.feed(tokens[-1][:, None])
        tokens.append(next_tokens(out))
    return GreedyResult(np.stack(tokens, axis=1), t1 - t0, time.perf_counter() - t1, out)


__all__ = ["Decoding", "GreedyResult", "Images", "greedy_decode", "left_pad", "next_tokens", "with_images"]
