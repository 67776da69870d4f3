"""``validate --quality TEXT_FILE``: each runtime's next-token distribution against the reference's over a text
(`quality.quality_figures` per runtime), judged by a largest mean KLD and a smallest top-1 agreement.

The text is tokenized with the model's tokenizer and cut into windows of ``context`` tokens, as llama-perplexity
does: each window runs from a fresh state in one call, and its second half is scored (the logits at positions
``context // 2`` .. ``context - 2`` predict the next token), so every scored token has at least half a window of
context. Windows that do not fill ``context`` are left out.

The limits (`QualityLimits`) default by what the runtime computes in and how its export stores the dense weights
(`DEFAULT_LIMITS`); a figure that is not finite fails (fail closed).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3export.errors import K3ExportError
from k3export.runtime.base import Decoding, Runner, to_numpy

from .quality import QualityFigures, ScoredTokens, score_tokens, summarise

DEFAULT_CONTEXT = 512
#: the largest text read (whole, then tokenized)
MAX_TEXT_BYTES = 64 << 20


@dataclass(frozen=True)
class QualityLimits:
    max_kld: float  # the largest mean KL divergence accepted
    min_top1: float  # the smallest top-1 agreement accepted


#: the limits of a runtime by (its compute dtype, its export's dense-weight quantization or None). fp32: rounding
#: alone (an fp32 export measures ~1e-10 mean KLD, top-1 1.0 on the tiny model); bf16 / fp16 and int8 / int4: the
#: field's figures for those forms (llama.cpp reports ~1e-3 mean KLD and ~98% top-1 for Q8_0 on 7B models, ~0.03
#: and ~90% for Q4_0), with headroom for models whose distributions are flatter or sharper
DEFAULT_LIMITS: dict[tuple[str, str | None], QualityLimits] = {
    ("float64", None): QualityLimits(1e-8, 0.999),
    ("float32", None): QualityLimits(1e-4, 0.99),
    ("float16", None): QualityLimits(2e-3, 0.95),
    ("bfloat16", None): QualityLimits(1e-2, 0.9),
    ("float32", "int8"): QualityLimits(5e-3, 0.95),
    ("float32", "int4"): QualityLimits(5e-2, 0.85),
}


def limits_for(dtype: str, quantization: str | None = None, max_kld: float | None = None,
               min_top1: float | None = None) -> QualityLimits:
    """`DEFAULT_LIMITS` of (`dtype`, `quantization`) with the user's `max_kld` / `min_top1` in their place."""
    base = DEFAULT_LIMITS.get((dtype, quantization)) or DEFAULT_LIMITS.get((dtype, None))
    if base is None:
        raise K3ExportError(f"no default quality limits for dtype {dtype!r}: pass --max-kld and --min-top1")
    return QualityLimits(base.max_kld if max_kld is None else max_kld, base.min_top1 if min_top1 is None else min_top1)


def check_limits(max_kld: float | None, min_top1: float | None, context: int) -> None:
    """One line for a limit or window length that cannot judge anything."""
    if max_kld is not None and not (math.isfinite(max_kld) and max_kld >= 0):
        raise K3ExportError(f"--max-kld {max_kld}: must be a finite number >= 0")
    if min_top1 is not None and not 0 <= min_top1 <= 1:
        raise K3ExportError(f"--min-top1 {min_top1}: must be a fraction in [0, 1]")
    if context < 4:
        raise K3ExportError(f"--quality-context {context}: a window needs at least 4 tokens (its second half is "
                            "scored)")


@dataclass
class QualityRun:
    """One runtime's figures over the text and their verdict."""

    runtime: str
    limits: QualityLimits
    figures: QualityFigures | None = None
    error: str | None = None  # the runtime raised: a failure
    seconds: float = 0.0

    @property
    def reasons(self) -> list[str]:
        if self.error is not None:
            return [self.error]
        f = self.figures
        assert f is not None
        out = []
        if not f.kld_mean <= self.limits.max_kld:  # NaN fails
            out.append(f"mean KLD {f.kld_mean:.3e} > {self.limits.max_kld:.1e}")
        if not f.top1_agree >= self.limits.min_top1:
            out.append(f"top-1 agreement {f.top1_agree:.4f} < {self.limits.min_top1:g}")
        return out

    @property
    def passed(self) -> bool:
        return not self.reasons


def read_text_tokens(text_file: str | os.PathLike[str], tokenizer_folders: list[Any], vocab_size: int) -> np.ndarray:
    """The text of `text_file` (UTF-8) as token ids int64 [n], tokenized by the first of `tokenizer_folders` that
    has a tokenizer (`k3export.tokenizer.load_tokenizer`), no special tokens added."""
    from k3export.tokenizer import has_tokenizer, load_tokenizer

    path = Path(text_file)
    if not path.is_file():
        raise K3ExportError(f"--quality {path}: not a file")
    if path.stat().st_size > MAX_TEXT_BYTES:
        raise K3ExportError(f"--quality {path}: larger than {MAX_TEXT_BYTES >> 20} MiB")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise K3ExportError(f"--quality {path}: not UTF-8 text (byte {exc.start})") from None
    folder = next((Path(f) for f in tokenizer_folders if f is not None and Path(f).is_dir() and has_tokenizer(f)),
                  None)
    if folder is None:
        raise K3ExportError(f"--quality {path}: neither the model folder nor the export has a tokenizer to read "
                            "the text with")
    ids = np.asarray(load_tokenizer(folder, vocab_size)(text, add_special_tokens=False)["input_ids"], np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise K3ExportError(f"--quality {path}: the tokenizer of {folder} gives ids outside [0, {vocab_size})")
    return ids


def windows(ids: np.ndarray, context: int, what: str = "the text") -> np.ndarray:
    """`ids` cut into whole windows of `context` tokens, int64 [n_windows, context] (the tail is dropped)."""
    n = len(ids) // context
    if n == 0:
        raise K3ExportError(f"{what} is {len(ids)} tokens, shorter than one --quality-context window of {context}")
    return np.asarray(ids[:n * context], np.int64).reshape(n, context)


def run_quality(reference: Runner, runners: list[Runner], windows: np.ndarray,
                limits: dict[str, QualityLimits], progress: Any = None) -> dict[str, QualityRun]:
    """Every runner's figures over `windows` [n, context] against `reference` (each window from a fresh state,
    its second half scored); `limits` by runner name. A runner that raises fails with its error."""
    context = windows.shape[1]
    first = context // 2
    runs = {r.name: QualityRun(r.name, limits[r.name]) for r in runners}
    parts: dict[str, list[ScoredTokens]] = {r.name: [] for r in runners}
    position = np.arange(context - 1 - first)
    for w, ids in enumerate(windows):
        if progress:
            progress(f"quality: window {w + 1}/{len(windows)} ({context} tokens)")
        ref = to_numpy(Decoding(reference).feed(ids[None]).logits)[0, first:-1]
        targets = ids[first + 1:]
        for r in runners:
            run = runs[r.name]
            if run.error is not None:
                continue
            t0 = time.perf_counter()
            try:
                out = to_numpy(Decoding(r).feed(ids[None]).logits)
                if out.shape[1] != context:
                    raise K3ExportError(f"returned logits of {out.shape[1]} positions for a window of {context}")
                parts[r.name].append(score_tokens(out[0, first:-1], ref, targets, position))
            except Exception as exc:  # noqa: BLE001 - any runtime failure is a quality failure
                run.error = f"{type(exc).__name__} in quality window {w}: {exc}"
            run.seconds += time.perf_counter() - t0
    for name, run in runs.items():
        if run.error is None:
            run.figures = summarise(parts[name])
    return runs


def runtime_quantization(runner: Runner) -> str | None:
    """How the export a runner runs stores its dense weights (``int8``, ``int4``), None when not quantized or not
    an export."""
    runtime = getattr(getattr(runner, "export", None), "runtime", None)
    return getattr(runtime, "quantize", None)


__all__ = ["DEFAULT_CONTEXT", "DEFAULT_LIMITS", "QualityLimits", "QualityRun", "check_limits", "limits_for",
           "read_text_tokens", "run_quality", "runtime_quantization", "windows"]
