"""Validation scenarios: what token sequences every runtime is driven through.

    decode           prefill of P tokens, then D decode steps with greedy feedback (batch 1)
    chunked_prefill  the same P tokens fed in chunks split at seeded arbitrary points (a 1-token chunk
                     included), compared with the reference's ONE-SHOT prefill, then min(D, 8) decode
                     steps (the decode loop itself is covered by `decode`)
    batch            B > 1 different prompts of length P, then D decode steps
    image            (an image + text model and export) two seeded random images of different sizes spliced
                     into a P-token prompt at their placeholders, prefilled whole, then min(D, 8) decode steps
    prefix_reuse, multi_turn, fork, rollback
                     a saved, resumed, forked or rolled-back state, each checked against a fresh recompute over
                     the whole sequence (`state_scenarios`)

Greedy feedback: the token fed at every decode step is the reference's argmax, fed to every runtime, so
all runs stay aligned however the runtimes' own argmaxes differ; greedy agreement is measured apart.
Inputs are seeded (numpy default_rng) or read from a JSON file of token-id lists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3export.errors import K3ExportError
from k3export.files import read_json


@dataclass
class Scenario:
    name: str
    prompts: np.ndarray  # int64 [B, P]
    steps: int  # decode steps after the prefill
    chunks: list[int] | None = None  # chunk lengths of the prefill (sum = P); None = one shot
    images: Any = None  # `k3export.runtime.loop.Images` spliced over the prompt's placeholders; None = text only
    plan: Any = None  # a state scenario's `state_scenarios.StatePlan` (driven by `run_state_scenario`); None: above

    @property
    def batch(self) -> int:
        return int(self.prompts.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.prompts.shape[1])

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "batch": self.batch, "prompt_len": self.prompt_len, "steps": self.steps,
                "chunks": self.chunks, "prompts": self.prompts.tolist()}


def load_prompts(path: str | os.PathLike[str], vocab_size: int) -> list[list[int]]:
    """A JSON list of lists of token ids, checked against the vocabulary."""
    p = Path(path)
    data = read_json(p, K3ExportError)
    if not isinstance(data, list) or not data or not all(isinstance(r, list) and r for r in data):
        raise K3ExportError(f"{p}: expected a JSON list of non-empty lists of token ids")
    for n, row in enumerate(data):
        bad = [t for t in row if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise K3ExportError(f"{p}: prompt {n} has token ids outside [0, {vocab_size}): {bad[:5]}")
    return data


def random_prompts(batch: int, length: int, vocab_size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    low = 3 if vocab_size > 16 else 0  # keep clear of pad/bos/eos in real vocabularies
    return rng.integers(low, vocab_size, size=(batch, length), dtype=np.int64)


def chunk_lengths(length: int, seed: int, pieces: int = 4) -> list[int]:
    """Seeded split of `length` tokens into up to `pieces` chunks, one of them a single token when possible."""
    if length < 2:
        return [length]
    rng = np.random.default_rng(seed + 7919)
    cuts = {1} if length > 2 else set()
    cuts |= set(rng.choice(np.arange(1, length), size=min(pieces - 1, length - 1), replace=False).tolist())
    points = sorted(cuts)[: pieces - 1]
    bounds = [0, *points, length]
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


def make_scenarios(vocab_size: int, *, prompt_len: int = 16, steps: int = 32, batch: int = 2, seed: int = 0,
                   prompts: list[list[int]] | None = None, chunked_steps: int | None = None,
                   which: tuple[str, ...] = ("decode", "chunked_prefill", "batch")) -> list[Scenario]:
    """The standard scenarios; `prompts` (from a file) replaces the seeded ids."""
    if prompt_len < 1 or steps < 0 or batch < 1:
        raise K3ExportError(f"need prompt_len >= 1, steps >= 0, batch >= 1 (got {prompt_len}, {steps}, {batch})")
    if prompts:
        first = np.asarray([prompts[0]], dtype=np.int64)
        rows = prompts[:batch] if len(prompts) >= batch else prompts
        common = min(len(r) for r in rows)
        many = np.asarray([r[:common] for r in rows], dtype=np.int64)
    else:
        many = random_prompts(max(batch, 1), prompt_len, vocab_size, seed)
        first = many[:1]
    out = []
    if "decode" in which:
        out.append(Scenario("decode", first, steps))
    if "chunked_prefill" in which and first.shape[1] >= 2:
        cs = min(steps, 8) if chunked_steps is None else chunked_steps
        out.append(Scenario("chunked_prefill", first, cs, chunk_lengths(first.shape[1], seed)))
    if "batch" in which and many.shape[0] > 1:
        if not prompts:  # different prompts from the decode one
            many = random_prompts(batch, prompt_len, vocab_size, seed + 1)
        out.append(Scenario("batch", many, steps))
    return out


#: the (width, height) in pixels of the image scenario's two images: different sizes and aspect ratios
IMAGE_SIZES = ((40, 24), (18, 34))


def image_scenario(processor_dir: str | os.PathLike[str], placeholder_id: int, vocab_size: int, *,
                   prompt_len: int = 16, steps: int = 8, seed: int = 0) -> Scenario:
    """The ``image`` scenario: text, image, text, image, text, with each image's placeholder expanded to its merged
    tokens, the images prepared by the export's own processor (``preprocessor_config.json`` in `processor_dir`)."""
    from PIL import Image

    from k3export.modeling.image_processing_k3 import K3ImageProcessor
    from k3export.runtime.loop import Images

    rng = np.random.default_rng(seed + 104729)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in IMAGE_SIZES]
    feats = K3ImageProcessor.from_pretrained(str(processor_dir)).preprocess(pictures, return_tensors="np")
    text = [t for t in random_prompts(1, max(prompt_len, 3), vocab_size, seed + 2)[0].tolist() if t != placeholder_id]
    third = max(1, len(text) // 3)
    ids = (text[:third] + [placeholder_id] * feats["num_tokens"][0] + text[third:2 * third]
           + [placeholder_id] * feats["num_tokens"][1] + text[2 * third:])
    return Scenario("image", np.asarray([ids], dtype=np.int64), steps,
                    images=Images(feats["pixel_values"], feats["grid_thws"]))
