"""``validation.json``: the verdict of a cross-runtime validation (``k3export validate``), read by ``push``::

    {"format": "k3export.validation_report", "format_version": 1,
     "passed": bool, "created": ISO-8601 UTC, "tool_version": str, "reference": "torch",
     "reference_dtype": "float32",                     # what the reference computed in (null: written before
                                                       # this field, the checkpoint's own dtype, see model.dtype)
     "runtime_dtypes": {runtime: dtype},               # what each runtime under test computes in
     "runtime_tolerances": {runtime: {kind: {"rms_rel", "max_abs_rel", "atol"}}},  # what judged it, at least
     "yardsticks": {runtime: str},                     # a runtime narrower than the reference: the reference
                                                       # model in its dtype, whose error (x2) widened them
     "runtimes": [str], "skipped": {runtime: why}, "runtime_descriptions": {runtime: str},
     "model": {str: scalar},                           # model dir, dtype, export dir, ...
     "artifacts": {relative file: sha256},             # every file of the export folder that was validated
     "tolerances": {kind: {"rms_rel", "max_abs_rel", "atol"}},   # at the reference's dtype
     "tolerance_overrides": {kind: {metric: value}},
     "scenarios": [{"name", "batch", "prompt_len", "steps", "chunks", "prompts",
                    "results": [{"runtime", "passed", "steps_run", "seconds", "greedy_agreement", "error",
                                 "localisation"}]}],
     "summary": [{"runtime", "scenario", "tensor", "kind", "layer", "max_abs", "max_rel", "rms_rel", "cosine",
                  "top1_agreement", "topk_agreement", "greedy_agreement", "passed"}],   # worst over steps
     "steps": [{"runtime", "scenario", "step", "position", "tensor", "kind", "layer", "max_abs", "max_rel",
                "rms_rel", "cosine", "ref_max", "finite", "top1", "topk", "top1_unexcused", "passed", "reason"}],
     "localisation": str | null,
     "quality": {runtime: {"tokens", "ppl", "ppl_reference", "ln_ppl_ratio", "kld_mean", "kld_stderr", "kld_p99",
                           "kld_max", "top1_agree", "delta_p_rms", "kld_by_position": [float],
                           "max_kld", "min_top1", "passed", "reason", "error"}}}
                                                       # validate --quality: the runtime's next-token
                                                       # distribution against the reference's over a text
                                                       # (k3export.validate.quality); model.quality_text names it

Metrics are numbers, null where they do not apply (top-1 of a state), or "inf" / "-inf" / "nan".
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

from k3export.safety import check_relative

from .codec import ArtifactError, Document, Metric, Scalar, check_sha256, fail


#: above this, a relative tolerance (or an absolute one on O(1) values) accepts outputs unrelated to the reference
MEANINGFUL_MAX = 1.0


def meaningless(value: float) -> bool:
    """Whether a tolerance value passes any output (not finite, or above `MEANINGFUL_MAX`)."""
    return not math.isfinite(value) or value > MEANINGFUL_MAX


@dataclass
class RunEntry:
    runtime: str
    passed: bool
    steps_run: int
    seconds: float
    greedy_agreement: Metric | None
    error: str | None
    localisation: str | None


@dataclass
class ScenarioEntry:
    name: str
    batch: int
    prompt_len: int
    steps: int
    chunks: list[int] | None
    prompts: list[list[int]]
    results: list[RunEntry]
    image_grids: list[list[int]] | None = None  # the image scenario's (frames, rows, columns) per image


@dataclass
class SummaryRow:
    """One (runtime, scenario, tensor): the worst value of each metric over the steps."""

    runtime: str
    scenario: str
    tensor: str
    kind: str
    layer: int | None
    max_abs: Metric | None
    max_rel: Metric | None
    rms_rel: Metric | None
    cosine: Metric | None
    top1_agreement: Metric | None
    topk_agreement: Metric | None
    greedy_agreement: Metric | None
    passed: bool


@dataclass
class StepRow:
    """One compared tensor at one step (0 = prefill)."""

    runtime: str
    scenario: str
    step: int
    position: int
    tensor: str
    kind: str
    layer: int | None
    max_abs: Metric
    max_rel: Metric
    rms_rel: Metric
    cosine: Metric
    ref_max: Metric
    finite: bool
    top1: Metric | None
    topk: Metric | None
    top1_unexcused: int | None
    passed: bool
    reason: str


@dataclass
class QualityEntry:
    """One runtime's figures over a text (``validate --quality``, `k3export.validate.quality`) and their verdict;
    the figures are null when the runtime failed to run (`error`)."""

    tokens: int
    ppl: Metric | None
    ppl_reference: Metric | None
    ln_ppl_ratio: Metric | None
    kld_mean: Metric | None
    kld_stderr: Metric | None
    kld_p99: Metric | None
    kld_max: Metric | None
    top1_agree: Metric | None
    delta_p_rms: Metric | None
    kld_by_position: list[Metric]
    max_kld: float
    min_top1: float
    passed: bool
    reason: str
    error: str | None


@dataclass
class ToleranceEntry:
    rms_rel: float
    max_abs_rel: float
    atol: float


@dataclass
class ValidationReport(Document):
    FILE = "validation.json"
    FORMAT = "k3export.validation_report"

    passed: bool
    created: str
    tool_version: str
    reference: str
    runtimes: list[str]
    skipped: dict[str, str]
    runtime_descriptions: dict[str, str]
    model: dict[str, Scalar]
    artifacts: dict[str, str]
    tolerances: dict[str, ToleranceEntry]
    tolerance_overrides: dict[str, dict[str, float]]
    scenarios: list[ScenarioEntry]
    summary: list[SummaryRow]
    steps: list[StepRow]
    localisation: str | None
    # reports written before these fields read with their defaults
    reference_dtype: str | None = None
    runtime_dtypes: dict[str, str] = field(default_factory=dict)
    runtime_tolerances: dict[str, dict[str, ToleranceEntry]] = field(default_factory=dict)
    yardsticks: dict[str, str] = field(default_factory=dict)
    quality: dict[str, QualityEntry] = field(default_factory=dict)

    def check(self, file: Any) -> None:
        for name, digest in self.artifacts.items():
            check_relative(name, error=ArtifactError, file=file, field=f"artifacts.{name}")
            check_sha256(digest, file, f"artifacts.{name}")
        for n, row in enumerate(self.summary):
            if row.runtime not in self.runtimes:
                raise fail(file, f"summary[{n}].runtime", f"{row.runtime!r} is not in runtimes {self.runtimes}")
        for rt in self.quality:
            if rt not in self.runtimes:
                raise fail(file, f"quality.{rt}", f"is not in runtimes {self.runtimes}")
        if self.passed and (not self.runtimes or any(not r.passed for r in self.summary)):
            raise fail(file, "passed", "is true but " + ("no runtime ran" if not self.runtimes
                                                          else "a summary row failed"))
        if self.passed and any(not q.passed for q in self.quality.values()):
            raise fail(file, "passed", "is true but a quality verdict failed")

    def tolerances_of(self, runtime: str) -> dict[str, ToleranceEntry]:
        """The tolerances `runtime` was judged with (a report written before per-runtime tolerances: the one set
        that judged every runtime)."""
        return self.runtime_tolerances.get(runtime, self.tolerances)

    @property
    def scenario_names(self) -> list[str]:
        return [s.name for s in self.scenarios]


__all__ = ["QualityEntry", "RunEntry", "ScenarioEntry", "StepRow", "SummaryRow", "ToleranceEntry", "ValidationReport"]
