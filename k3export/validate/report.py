"""Validation report: `ValidationReport` (``validation.json``, `k3export.artifacts`), a rich table, and a PNG plot
of error vs decode step.

`to_report` turns a `ValidationResult` into the report; ``report.write(folder, name)`` and
``ValidationReport.read(folder, name)`` are the only writer and reader of the file (`k3export.hub` reads it to
decide whether an export may be published). Metric values are rounded to 4 significant digits.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
from pathlib import Path
from typing import Any

from k3export.artifacts import (
    QualityEntry, RunEntry, ScenarioEntry, StepRow, SummaryRow, ToleranceEntry, ValidationReport, write_bytes_atomic,
)

from .compare import KINDS
from .core import RunResult, ValidationResult
from .text_quality import QualityRun


def _r(v: Any) -> Any:
    """4 significant digits for a finite float; anything else as it is."""
    return float(f"{v:.4g}") if isinstance(v, float) and math.isfinite(v) else v


def _worst(vals: list[Any], fn: Any) -> float | None:
    nums = [v for v in vals if isinstance(v, (int, float)) and not math.isnan(v)]
    return _r(float(fn(nums))) if nums else None


def summarise(run: RunResult) -> list[SummaryRow]:
    """One row per tensor of a run: the worst value of every metric over the steps."""
    rows: dict[str, list] = {}
    for r in run.records:
        rows.setdefault(r.tensor, []).append(r)
    greedy = _r(sum(run.greedy) / len(run.greedy)) if run.greedy else None
    out = []
    for tensor, recs in rows.items():
        ms = [r.metrics for r in recs]
        logits = tensor == "logits"
        out.append(SummaryRow(
            run.runtime, run.scenario, tensor, recs[0].kind, recs[0].layer,
            max_abs=_worst([m.max_abs for m in ms], max), max_rel=_worst([m.max_rel for m in ms], max),
            rms_rel=_worst([m.rms_rel for m in ms], max), cosine=_worst([m.cosine for m in ms], min),
            top1_agreement=_worst([m.top1 for m in ms], min) if logits else None,
            topk_agreement=_worst([m.topk for m in ms], min) if logits else None,
            greedy_agreement=greedy if logits else None, passed=all(m.passed for m in ms)))
    return out


def _step_row(r: Any) -> StepRow:
    m = r.metrics
    return StepRow(r.runtime, r.scenario, r.step, r.position, r.tensor, r.kind, r.layer, _r(m.max_abs),
                   _r(m.max_rel), _r(m.rms_rel), _r(m.cosine), _r(m.ref_max), m.finite, _r(m.top1), _r(m.topk),
                   m.top1_unexcused, m.passed, m.reason)


def quality_entry(run: QualityRun) -> QualityEntry:
    """The report's entry of one runtime's quality figures (4 significant digits) and verdict."""
    f = run.figures
    figures = {k: None for k in ("ppl", "ppl_reference", "ln_ppl_ratio", "kld_mean", "kld_stderr", "kld_p99",
                                 "kld_max", "top1_agree", "delta_p_rms")}
    if f is not None:
        figures = {k: _r(float(getattr(f, k))) for k in figures}
    return QualityEntry(tokens=0 if f is None else f.tokens, **figures,
                        kld_by_position=[] if f is None else [_r(v) for v in f.kld_by_position],
                        max_kld=run.limits.max_kld, min_top1=run.limits.min_top1, passed=run.passed,
                        reason="; ".join(run.reasons), error=run.error)


def to_report(result: ValidationResult, model: dict[str, Any] | None = None,
              artifacts: dict[str, str] | None = None) -> ValidationReport:
    """The report of `result`; `model` describes what was validated (scalars), `artifacts` maps each validated
    file (relative to the folder the report is written into) to its sha256."""
    from k3export import __version__

    scenarios = [
        ScenarioEntry(sc.name, sc.batch, sc.prompt_len, sc.steps, sc.chunks, sc.prompts.tolist(), [
            RunEntry(r.runtime, r.passed, r.steps_run, round(r.seconds, 3),
                     _r(sum(r.greedy) / len(r.greedy)) if r.greedy else None, r.error, r.localisation)
            for r in result.runs if r.scenario == sc.name],
            None if sc.images is None else [[int(v) for v in row] for row in sc.images.grid_thws])
        for sc in result.scenarios]
    tols = result.tolerances
    return ValidationReport(
        passed=result.passed,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        tool_version=__version__,
        reference=result.reference,
        runtimes=list(result.runtimes),
        skipped=dict(result.skipped),
        runtime_descriptions=dict(result.runtime_descriptions),
        model=dict(model or {}),
        artifacts=dict(artifacts or {}),
        tolerances={k: ToleranceEntry(**vars(tols.for_kind(k))) for k in KINDS},
        tolerance_overrides={k: dict(v) for k, v in tols.overrides.items()},
        scenarios=scenarios,
        summary=[row for run in result.runs for row in summarise(run)],
        steps=[_step_row(r) for run in result.runs for r in run.records],
        localisation=result.localisation,
        reference_dtype=result.reference_dtype,
        runtime_dtypes=dict(result.runtime_dtypes),
        runtime_tolerances={rt: {k: ToleranceEntry(**vars(t.for_kind(k))) for k in KINDS}
                            for rt, t in result.runtime_tolerances.items()},
        yardsticks=dict(result.yardsticks),
        quality={rt: quality_entry(q) for rt, q in result.quality.items()},
    )


def write_report(report: ValidationReport, path: str | os.PathLike[str]) -> Path:
    """Write `report` at `path` (atomically, never through a link)."""
    p = Path(path)
    return report.write(p.parent, p.name)


def read_report(path: str | os.PathLike[str]) -> ValidationReport:
    p = Path(path)
    return ValidationReport.read(p.parent, p.name)


# ---------------------------------------------------------------------------------------------- table
def reference_label(report: ValidationReport) -> str:
    """``torch (float32)``, or the bare name for a report written before the reference dtype was recorded."""
    return f"{report.reference} ({report.reference_dtype})" if report.reference_dtype else report.reference


def _e(v: Any) -> str:
    return "-" if v is None else f"{v:.2e}"


def render_table(report: ValidationReport, console: Any = None) -> None:
    """A rich table: one row per (runtime, scenario, tensor kind), worst over layers and steps."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"k3export validation vs {reference_label(report)}", show_lines=False)
    for col in ("runtime", "scenario", "tensor", "max abs", "rms rel", "cosine", "top-1", "greedy", "status"):
        table.add_column(col, justify="left" if col in ("runtime", "scenario", "tensor", "status") else "right")
    groups: dict[tuple, list[SummaryRow]] = {}
    for row in report.summary:
        groups.setdefault((row.runtime, row.scenario, row.kind), []).append(row)

    def worst(rows: list[SummaryRow], key: str, fn: Any) -> Any:
        vals = [getattr(r, key) for r in rows if getattr(r, key) is not None]
        return fn(vals) if vals else None

    for (rt, sc, kind), rows in groups.items():
        ok = all(r.passed for r in rows)
        label = kind if len(rows) == 1 else f"{kind} (x{len(rows)})"
        cos = worst(rows, "cosine", min)
        top1, greedy = rows[0].top1_agreement, rows[0].greedy_agreement
        table.add_row(rt, sc, label, _e(worst(rows, "max_abs", max)), _e(worst(rows, "rms_rel", max)),
                      "-" if cos is None else f"{cos:.6f}", "-" if top1 is None else f"{top1:.3f}",
                      "-" if greedy is None else f"{greedy:.3f}", "[green]pass[/]" if ok else "[bold red]FAIL[/]")
    errors = [(res, sc.name) for sc in report.scenarios for res in sc.results if res.error]
    for res, sc in errors:
        table.add_row(res.runtime, sc, "(run)", "-", "-", "-", "-", "-", "[bold red]ERROR[/]")
    if console.is_terminal:
        console.print(table)
    else:  # a pipe or file gets 80 columns by default: too narrow for the numbers
        saved = console.width
        console.width = max(saved, 132)
        try:
            console.print(table)
        finally:
            console.width = saved
    for rt in report.runtimes:  # what ran: e.g. the EP, its adapter and where the nodes ran (ort-webgpu)
        console.print(f"[dim]{rt}:[/] {report.runtime_descriptions.get(rt, rt)}", highlight=False)
    for rt, why in report.skipped.items():
        console.print(f"[yellow]skipped[/] {rt}: {why}", highlight=False)
    for res, sc in errors:
        console.print(f"[red]{res.runtime}/{sc}:[/] {res.error}", highlight=False)
    for kind, metrics in report.tolerance_overrides.items():
        console.print(f"[yellow]tolerance override[/] {kind}: "
                      + ", ".join(f"{k}={v:g}" for k, v in metrics.items()), highlight=False)
    if report.quality:
        render_quality(report, console)
    verdict = "[bold green]PASSED[/]" if report.passed else "[bold red]FAILED[/]"
    console.print(f"{verdict} ({len(report.runtimes)} runtime(s), {len(report.scenarios)} scenario(s))")
    if report.localisation:
        console.print(report.localisation, highlight=False, markup=False)


def render_quality(report: ValidationReport, console: Any) -> None:
    """The quality figures (``validate --quality``): one row per runtime, llama-perplexity's columns."""
    from rich.table import Table

    text = report.model.get("quality_text")
    table = Table(title=f"next-token quality vs {reference_label(report)}" + (f" over {text}" if text else ""))
    cols = ("runtime", "tokens", "PPL", "PPL ref", "ln(PPL/ref)", "mean KLD", "KLD p99", "KLD max", "top-1",
            "RMS dp", "status")
    for col in cols:
        table.add_column(col, justify="left" if col in ("runtime", "status") else "right")

    def g(v: Any, fmt: str) -> str:
        return "-" if v is None else (f"{v:{fmt}}" if isinstance(v, (int, float)) else str(v))

    for rt, q in report.quality.items():
        kld = "-" if q.kld_mean is None else f"{g(q.kld_mean, '.3e')} +- {g(q.kld_stderr, '.1e')}"
        status = "[green]pass[/]" if q.passed else f"[bold red]FAIL[/] {q.reason}"
        table.add_row(rt, str(q.tokens), g(q.ppl, ".4f"), g(q.ppl_reference, ".4f"), g(q.ln_ppl_ratio, ".2e"), kld,
                      g(q.kld_p99, ".2e"), g(q.kld_max, ".2e"), g(q.top1_agree, ".4f"), g(q.delta_p_rms, ".2e"),
                      status)
    saved = console.width
    console.width = max(saved, 160) if not console.is_terminal else saved
    try:
        console.print(table)
    finally:
        console.width = saved
    for rt, q in report.quality.items():
        console.print(f"[dim]{rt}: limits mean KLD <= {q.max_kld:g}, top-1 >= {q.min_top1:g}[/]", highlight=False)


# ---------------------------------------------------------------------------------------------- plot
def plot(report: ValidationReport, path: str | os.PathLike[str]) -> Path:
    """PNG: rms_rel (worst over layers) vs step, one panel per runtime, one line per (scenario, kind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runtimes = list(report.runtimes) or ["(none)"]
    panels = len(runtimes) + bool(report.quality)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    if report.quality:
        _quality_panel(axes[0][-1], report)
    styles = {"decode": "-", "chunked_prefill": ":", "batch": "--"}  # colour = tensor kind, style = scenario
    for ax, rt in zip(axes[0], runtimes):
        series: dict[tuple[str, str], dict[int, float]] = {}
        for rec in report.steps:
            if rec.runtime != rt:
                continue
            d = series.setdefault((rec.scenario, rec.kind), {})
            d[rec.step] = max(d.get(rec.step, 0.0), rec.rms_rel)
        colors = {"logits": "C3", "hidden": "C1", "conv_state": "C0", "recurrent_state": "C4", "latent": "C2"}
        for (sc, kind), pts in sorted(series.items()):
            xs = sorted(pts)
            ys = [max(pts[x], 1e-12) if math.isfinite(pts[x]) else 1e3 for x in xs]
            ax.plot(xs, ys, styles.get(sc, "-."), color=colors.get(kind, "k"), marker="." if len(xs) < 3 else None,
                    linewidth=1.2)
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=c, label=k) for k, c in colors.items()
                   if any(kk == k for _, kk in series)]
        handles += [Line2D([], [], color="grey", linestyle=st, label=sc) for sc, st in styles.items()
                    if any(ss == sc for ss, _ in series)]
        judged = report.tolerances_of(rt)
        tol = judged["logits"].rms_rel if "logits" in judged else None
        if tol:
            ax.axhline(tol, color="red", linewidth=0.8, linestyle="-.")
            handles.append(Line2D([], [], color="red", linestyle="-.", label="logits tolerance"))
        ax.set_yscale("log")
        ax.set_xlabel("step (0 = prefill)")
        ax.set_ylabel("rms_rel vs reference (worst layer)")
        ax.set_title(f"{rt} vs {report.reference}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(handles=handles, fontsize=7)
    fig.suptitle("PASSED" if report.passed else "FAILED")
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    plt.close(fig)
    p = Path(path)
    return write_bytes_atomic(p.parent, p.name, buf.getvalue())


def _quality_panel(ax: Any, report: ValidationReport) -> None:
    """Mean KLD at each scored position of a ``--quality`` window, one line per runtime, its limit dashed."""
    for n, (rt, q) in enumerate(report.quality.items()):
        ys = [max(v, 1e-16) if isinstance(v, float) and math.isfinite(v) else 1e3 for v in q.kld_by_position]
        if ys:
            ax.plot(range(len(ys)), ys, color=f"C{n}", linewidth=1.0, label=f"{rt} (mean {q.kld_mean:.2e})"
                    if isinstance(q.kld_mean, float) else rt)
        ax.axhline(max(q.max_kld, 1e-16), color=f"C{n}", linewidth=0.8, linestyle="--")
    ax.set_yscale("log")
    ax.set_xlabel("scored position in the window (second half)")
    ax.set_ylabel("KL(reference || runtime), mean over windows")
    ax.set_title(f"next-token KLD vs {report.reference}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
