"""The one way to run an artifact: the attention-mask builder, a decoding that carries state and mask, and the
greedy-decode loop (prefill + N steps) every command and bench uses.

    ids, mask = left_pad([[5, 6, 7], [8, 9]], pad_id=0)     # [[5, 6, 7], [0, 8, 9]], [[1, 1, 1], [0, 1, 1]]
    result = greedy_decode(runner, ids, steps=8, attention_mask=mask)
    result.tokens  [B, steps + 1]: the argmax after the prefill, then after every decode step

Mask semantics are PyTorch's (and the exported graph's): ``attention_mask`` int64 [batch, past + new] spans every
token fed so far; 0 marks a (left) pad token. A decode step appends one column of ones.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from k3export.errors import K3ExportError

from .base import Decoding, Runner, StepOutput, Tensor, to_numpy


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


def greedy_decode(runner: Runner, input_ids: Tensor, steps: int, attention_mask: Tensor | None = None) -> GreedyResult:
    """Prefill `input_ids` (left-padded rows: pass their mask), then `steps` greedy decode steps."""
    if steps < 0:
        raise K3ExportError(f"steps must be >= 0, got {steps}")
    d = Decoding(runner)
    t0 = time.perf_counter()
    out = d.feed(input_ids, attention_mask)
    tokens = [next_tokens(out)]
    t1 = time.perf_counter()
    for _ in range(steps):
        out = d.feed(tokens[-1][:, None])
        tokens.append(next_tokens(out))
    return GreedyResult(np.stack(tokens, axis=1), t1 - t0, time.perf_counter() - t1, out)


__all__ = ["Decoding", "GreedyResult", "greedy_decode", "left_pad", "next_tokens"]
