"""Comparator: error metrics of one tensor against the reference, and the tolerances that judge them.

Metrics (all computed in float64):
    max_abs        max |x - r|
    max_rel        max |x - r| / max(|r|, floor), floor = 1e-3 * max|r| (so near-zero entries do not explode)
    rms_rel        ||x - r||_2 / ||r||_2                      (the main criterion, scale free)
    cosine         <x, r> / (||x|| ||r||)
    top1, topk     (logits) fraction of positions whose argmax / top-k set agree with the reference's
    top1_unexcused positions whose argmax differs although the reference prefers its own choice by more
                   than TIE_FACTOR * tol.rms_rel * rms(reference row): a flip that noise within tolerance
                   could not cause (a flip inside that margin is a near tie and is excused)

A tensor passes when rms_rel <= tol.rms_rel, max_abs <= tol.max_abs_rel * max|r| + tol.atol, every value is
finite, and (logits) every top-1 disagreement is an excused near tie.

Default tolerances, by tensor dtype of the runtime under test:
    float32:  rms_rel 1e-3, max_abs_rel 1e-2. Measured on the tiny model (prefill 16 + 32 decode steps):
              torch vs ONNX Runtime CPU and vs the Triton kernels: logits and states 1e-6..5e-6 rms_rel;
              torch chunked prefill vs one-shot 3.5e-6 (reordered fp32 sums of the chunked KDA form). An
              earlier, more chaotic random init of the tiny model amplified the same fp32 noise to 6.6e-5.
              bench/drift.py: fp32 state error stays flat (~2e-6) up to 4096 tokens. 1e-3 leaves >10x
              headroom over the worst seen, while one perturbed weight, a flipped decay sign, a dropped
              router bias or a transposed state gives >= 1e-2 at the layer concerned.
    float16:  rms_rel 1e-2, max_abs_rel 5e-2 (unit roundoff 4.9e-4; a few roundings per layer).
    bfloat16: rms_rel 3e-2, max_abs_rel 1e-1 (unit roundoff 3.9e-3: one rounding alone is ~2e-3 rms;
              the peer tolerance for KDA states is 5e-3 per op, and errors add over layers).
The recurrent state is stored in fp32 in every dtype but is written from model-dtype activations, so its
tolerance follows the model dtype. A runtime is judged with the tolerances of its own compute dtype against a
reference that is at least as precise (`judging_dtype`: the coarser of the two), as Polygraphy compares a
reduced-precision engine with an fp32 framework run: a bf16 export gets bf16 tolerances against the fp32
reference, an fp32 export fp32 tolerances. Override per kind: ``{"logits": 1e-3}`` (rms_rel) or
``{"latent.max_abs_rel": 0.01}``; the CLI spells it ``--tol logits=1e-3``.
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from k3export.artifacts.validation import MEANINGFUL_MAX, meaningless
from k3export.errors import K3ExportError

KINDS = ("logits", "hidden", "conv_state", "recurrent_state", "latent")
TOP_K = 5
TIE_FACTOR = 8.0  # elementwise errors reach a few times the RMS error; two entries are involved in a flip


@dataclass(frozen=True)
class Tolerance:
    rms_rel: float
    max_abs_rel: float
    atol: float = 1e-6


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rms_rel=1e-3, max_abs_rel=1e-2, atol=1e-6),
    "float64": Tolerance(rms_rel=1e-9, max_abs_rel=1e-8, atol=1e-12),
    "float16": Tolerance(rms_rel=1e-2, max_abs_rel=5e-2, atol=1e-4),
    "bfloat16": Tolerance(rms_rel=3e-2, max_abs_rel=1e-1, atol=1e-3),
}


@dataclass
class Tolerances:
    """Tolerance per tensor kind for one model dtype, with user overrides."""

    dtype: str = "float32"
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)
    #: the defaults in place of `DEFAULT_TOLERANCES[dtype]`: a runtime's own (`for_runtime`)
    base: Tolerance | None = None

    def for_kind(self, kind: str) -> Tolerance:
        if self.dtype not in DEFAULT_TOLERANCES:
            raise K3ExportError(f"no default tolerances for dtype {self.dtype!r}")
        tol = self.base if self.base is not None else DEFAULT_TOLERANCES[self.dtype]
        for key in ("*", kind):
            if key in self.overrides:
                tol = replace(tol, **self.overrides[key])
        return tol

    def at(self, dtype: str) -> Tolerances:
        """The same overrides for a runtime that computes in `dtype` (a canonical name)."""
        return replace(self, dtype=dtype, base=None)

    def for_runtime(self, own: dict[str, dict[str, float]]) -> Tolerances:
        """These tolerances with a runtime's own defaults for their dtype (``Runner.tolerances``: arithmetic
        coarser than validate's default for the dtype assumes), when it declares them; the overrides on top."""
        spec = own.get(self.dtype)
        return replace(self, base=Tolerance(**spec)) if spec else self

    def to_dict(self) -> dict[str, Any]:
        return {k: asdict(self.for_kind(k)) for k in KINDS}

    @classmethod
    def parse(cls, specs: list[str] | dict[str, float] | None, dtype: str = "float32",
              force: bool = False) -> Tolerances:
        """From ``["logits=1e-3", "latent.max_abs_rel=0.01", "*=1e-3"]`` or a dict of the same keys. An override
        that makes the comparison meaningless (`meaningless`) is refused unless `force`."""
        items = list(specs.items()) if isinstance(specs, dict) else [_split(s) for s in (specs or [])]
        overrides: dict[str, dict[str, float]] = {}
        for key, value in items:
            kind, _, metric = str(key).partition(".")
            metric = metric or "rms_rel"
            if kind != "*" and kind not in KINDS:
                raise K3ExportError(
                    f"--tol {key}: unknown tensor kind {kind!r} (expected one of {', '.join(KINDS)} or *)")
            if metric not in ("rms_rel", "max_abs_rel", "atol"):
                raise K3ExportError(f"--tol {key}: unknown metric {metric!r} (rms_rel, max_abs_rel, atol)")
            try:
                v = float(value)
            except ValueError:
                raise K3ExportError(f"--tol {key}={value}: not a number") from None
            if math.isnan(v) or v < 0:
                raise K3ExportError(f"--tol {key}={value}: must be a number >= 0")
            if meaningless(v) and not force:
                raise K3ExportError(f"--tol {key}={value}: a tolerance above {MEANINGFUL_MAX:g} (or not finite) passes "
                                    "any output, so the comparison would mean nothing; pass --force to record it anyway")
            overrides.setdefault(kind, {})[metric] = v
        return cls(dtype=dtype, overrides=overrides)


def judging_dtype(reference: str, runtime: str) -> str:
    """The dtype whose tolerances judge a runtime computing in `runtime` against a reference computing in
    `reference`: the less precise of the two (the reference's own rounding bounds what it can tell apart)."""
    for name in (reference, runtime):
        if name not in DEFAULT_TOLERANCES:
            raise K3ExportError(f"no default tolerances for dtype {name!r}")
    return max(reference, runtime, key=lambda name: DEFAULT_TOLERANCES[name].rms_rel)


def _split(spec: str) -> tuple[str, str]:
    if "=" not in spec:
        raise K3ExportError(f"--tol {spec!r}: expected KIND=VALUE, e.g. logits=1e-3 or latent.max_abs_rel=1e-2")
    k, v = spec.split("=", 1)
    return k.strip(), v.strip()


@dataclass
class Metrics:
    max_abs: float
    max_rel: float
    rms_rel: float
    cosine: float
    ref_max: float
    finite: bool
    top1: float | None = None
    topk: float | None = None
    top1_unexcused: int | None = None
    passed: bool = True
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: _clean(v) for k, v in asdict(self).items()}


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not np.isfinite(v):
        return None if np.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def compare(out: np.ndarray, ref: np.ndarray, kind: str, tol: Tolerance) -> Metrics:
    """Metrics of `out` against `ref` (same shape) and the pass/fail verdict for `tol`."""
    x = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if x.shape != r.shape:
        return Metrics(np.inf, np.inf, np.inf, 0.0, float(np.abs(r).max(initial=0.0)), False, passed=False,
                       reason=f"shape {list(x.shape)} != reference {list(r.shape)}")
    finite = bool(np.isfinite(x).all())
    ref_max = float(np.abs(r).max(initial=0.0))
    if x.size == 0:
        return Metrics(0.0, 0.0, 0.0, 1.0, 0.0, True)
    with np.errstate(all="ignore"):
        d = np.abs(x - r)
        max_abs = float(np.nanmax(d)) if finite else np.inf
        floor = max(1e-3 * ref_max, 1e-30)
        max_rel = float(np.max(d / np.maximum(np.abs(r), floor))) if finite else np.inf
        rn = float(np.linalg.norm(r))
        en = float(np.linalg.norm(x - r)) if finite else np.inf
        rms_rel = en / rn if rn > 0 else (0.0 if en == 0 else np.inf)
        xn = float(np.linalg.norm(x)) if finite else np.inf
        if rn > 0 and 0 < xn < np.inf:
            cosine = float(np.sum(x * r) / (xn * rn))
        else:
            cosine = 1.0 if (rn == 0 and xn == 0) else 0.0
    m = Metrics(max_abs, max_rel, rms_rel, cosine, ref_max, finite)
    reasons = []
    if not finite:
        reasons.append("non-finite values")
    if rms_rel > tol.rms_rel:
        reasons.append(f"rms_rel {rms_rel:.2e} > {tol.rms_rel:.1e}")
    if max_abs > tol.max_abs_rel * ref_max + tol.atol:
        reasons.append(f"max_abs {max_abs:.2e} > {tol.max_abs_rel:.1e}*{ref_max:.2e}+{tol.atol:.0e}")
    if kind == "logits" and finite:
        m.top1, m.topk, m.top1_unexcused = _topk_agreement(x, r, TIE_FACTOR * tol.rms_rel)
        if m.top1_unexcused:
            reasons.append(f"{m.top1_unexcused} top-1 disagreement(s) that are not near ties")
    m.passed = not reasons
    m.reason = "; ".join(reasons)
    return m


def _topk_agreement(x: np.ndarray, r: np.ndarray, tie_rel: float, k: int = TOP_K) -> tuple[float, float, int]:
    xs, rs = x.reshape(-1, x.shape[-1]), r.reshape(-1, r.shape[-1])
    tie = tie_rel * np.sqrt(np.mean(rs * rs, axis=-1))
    k = min(k, xs.shape[-1])
    a1, b1 = xs.argmax(-1), rs.argmax(-1)
    agree = a1 == b1
    rows = np.arange(len(rs))
    gap = rs[rows, b1] - rs[rows, a1]  # >= 0: how much the reference prefers its own choice
    unexcused = int(np.sum(~agree & (gap > tie)))
    xk = np.argpartition(-xs, k - 1, axis=-1)[:, :k]
    rk = np.argpartition(-rs, k - 1, axis=-1)[:, :k]
    overlap = np.mean([len(set(a) & set(b)) / k for a, b in zip(xk.tolist(), rk.tolist())])
    return float(agree.mean()), float(overlap), unexcused
