"""How much of the reference's next-token distribution a runtime keeps: llama-perplexity's ``--kl-divergence``
figures, from logits.

    figures = quality_figures(logits, reference_logits, targets)   # [n, vocab], [n, vocab], [n] next tokens
    figures.kld_mean, figures.top1_agree, figures.ppl, ...

Every figure is computed in float64 from the log-softmax of each row:
    ppl, ppl_reference  exp(mean negative log-likelihood of the target token), the runtime's and the reference's
    ln_ppl_ratio        ln(ppl / ppl_reference) = the difference of the two mean NLLs
    kld_*               KL(reference || runtime) = sum_v p_ref(v) (log p_ref(v) - log p(v)) per position: its mean,
                        the standard error of that mean, its 99th percentile and maximum
    top1_agree          fraction of positions where both argmaxes are the same token
    delta_p_rms         RMS over positions of p(target) - p_ref(target)
    kld_by_position     mean KLD at each scored position of a window (over windows; `ScoredTokens.position`)

A long text is scored window by window (`score_tokens` per window, `summarise` over them), so no more than one
window's logits are held at a time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass
class ScoredTokens:
    """Per-position scores of one batch of scored positions (float64 arrays of length n)."""

    kld: np.ndarray
    nll: np.ndarray
    nll_reference: np.ndarray
    top1: np.ndarray  # bool
    delta_p: np.ndarray
    position: np.ndarray  # int: each row's index among the scored positions of its window


@dataclass
class QualityFigures:
    tokens: int
    ppl: float
    ppl_reference: float
    ln_ppl_ratio: float
    kld_mean: float
    kld_stderr: float
    kld_p99: float
    kld_max: float
    top1_agree: float
    delta_p_rms: float
    kld_by_position: list[float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def score_tokens(logits: Any, reference: Any, targets: Any, position: Any = None) -> ScoredTokens:
    """Scores of `logits` [n, vocab] against `reference` [n, vocab] where the next token is `targets` [n];
    `position` [n]: each row's place in its window (default 0..n-1)."""
    lq, lp = _log_softmax(logits), _log_softmax(reference)
    if lq.shape != lp.shape or lq.ndim != 2:
        raise ValueError(f"logits {list(lq.shape)} and reference {list(lp.shape)} must both be [n, vocab]")
    t = np.asarray(targets, dtype=np.int64).reshape(-1)
    if t.shape[0] != lq.shape[0]:
        raise ValueError(f"{t.shape[0]} targets for {lq.shape[0]} rows of logits")
    rows = np.arange(len(t))
    with np.errstate(invalid="ignore"):  # a non-finite runtime row gives a non-finite KLD, reported as such
        kld = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    nll, nll_ref = -lq[rows, t], -lp[rows, t]
    return ScoredTokens(kld=kld, nll=nll, nll_reference=nll_ref, top1=lq.argmax(-1) == lp.argmax(-1),
                        delta_p=np.exp(-nll) - np.exp(-nll_ref),
                        position=np.arange(len(t)) if position is None else np.asarray(position, np.int64))


def summarise(parts: list[ScoredTokens]) -> QualityFigures:
    """The figures over every scored position of `parts` (at least one)."""
    cat = {f: np.concatenate([getattr(p, f) for p in parts]) for f in ScoredTokens.__dataclass_fields__}
    n = len(cat["kld"])
    if n == 0:
        raise ValueError("no scored position")
    kld = cat["kld"]
    nll, nll_ref = float(cat["nll"].mean()), float(cat["nll_reference"].mean())
    by_pos = np.bincount(cat["position"], weights=np.nan_to_num(kld, nan=np.inf)) / np.maximum(
        np.bincount(cat["position"]), 1)
    stderr = float(kld.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return QualityFigures(
        tokens=n, ppl=math.exp(nll) if nll < 700 else math.inf, ppl_reference=math.exp(nll_ref),
        ln_ppl_ratio=nll - nll_ref, kld_mean=float(kld.mean()), kld_stderr=stderr,
        kld_p99=float(np.percentile(kld, 99)), kld_max=float(kld.max()), top1_agree=float(cat["top1"].mean()),
        delta_p_rms=float(np.sqrt(np.mean(cat["delta_p"] ** 2))), kld_by_position=[float(v) for v in by_pos])


def quality_figures(logits: Any, reference: Any, targets: Any) -> QualityFigures:
    """Logits in, figures out: `score_tokens` then `summarise` over one set of rows."""
    return summarise([score_tokens(logits, reference, targets)])


__all__ = ["QualityFigures", "ScoredTokens", "quality_figures", "score_tokens", "summarise"]
