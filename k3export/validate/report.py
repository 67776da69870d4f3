"""Validation report: JSON (schema below), a rich table, and a PNG plot of error vs decode step.

JSON schema, version 1 (``validation.json``; `k3export.hub` reads it to decide whether an export may be
published, so these keys are stable)::

    {
      "schema_version": 1,
      "passed": bool,                         # every runtime, scenario, step and tensor within tolerance
      "created": str,                         # ISO-8601 UTC
      "tool_version": str,                    # k3export.__version__
      "reference": "torch",
      "runtimes": [str],                      # runtimes compared with the reference (that ran)
      "skipped": {runtime: reason},           # asked for but not runnable here
      "runtime_descriptions": {runtime: str},
      "model": {...} | null,                  # free-form: model dir, dtype, export dir
      "tolerances": {kind: {"rms_rel", "max_abs_rel", "atol"}},
      "scenarios": [{"name": str, "batch": int, "prompt_len": int, "steps": int, "chunks": [int] | null,
                     "prompts": [[int]], "results": [{"runtime", "passed", "steps_run", "seconds",
                     "greedy_agreement", "error", "localisation"}]}],
      "summary": [{"runtime", "scenario", "tensor", "kind", "layer", "max_abs", "max_rel", "rms_rel", "cosine",
                   "top1_agreement", "topk_agreement", "greedy_agreement", "passed"}],
                                              # one row per (runtime, scenario, tensor): worst over steps;
                                              # top1/topk/greedy only on the logits row, else null
      "steps": [{"runtime", "scenario", "step", "position", "tensor", "kind", "layer", "max_abs", "max_rel",
                 "rms_rel", "cosine", "ref_max", "finite", "top1", "topk", "top1_unexcused", "passed",
                 "reason"}],                  # every compared tensor at every step (step 0 = prefill)
      "localisation": str | null              # first divergence, one line per failing (runtime/scenario)
    }

Non-finite floats are written as null (NaN) or the strings "inf"/"-inf", so the file is strict JSON.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import Any

from .core import RunResult, ValidationResult

SCHEMA_VERSION = 1
REQUIRED_KEYS = ("schema_version", "passed", "created", "tool_version", "reference", "runtimes", "scenarios",
                 "summary", "steps", "localisation")
SUMMARY_KEYS = ("runtime", "scenario", "tensor", "max_abs", "rms_rel", "cosine", "top1_agreement",
                "greedy_agreement", "passed")


def _worst(vals: list[Any], fn: Any) -> Any:
    nums = [v for v in vals if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))]
    return fn(nums) if nums else None


def _json_float(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return float(f"{v:.4g}")
    return v


def summarise(run: RunResult) -> list[dict[str, Any]]:
    rows: dict[str, list] = {}
    for r in run.records:
        rows.setdefault(r.tensor, []).append(r)
    greedy = (sum(run.greedy) / len(run.greedy)) if run.greedy else None
    out = []
    for tensor, recs in rows.items():
        ms = [r.metrics for r in recs]
        is_logits = tensor == "logits"
        out.append({
            "runtime": run.runtime, "scenario": run.scenario, "tensor": tensor, "kind": recs[0].kind,
            "layer": recs[0].layer,
            "max_abs": _json_float(_worst([m.max_abs for m in ms], max)),
            "max_rel": _json_float(_worst([m.max_rel for m in ms], max)),
            "rms_rel": _json_float(_worst([m.rms_rel for m in ms], max)),
            "cosine": _json_float(_worst([m.cosine for m in ms], min)),
            "top1_agreement": _json_float(_worst([m.top1 for m in ms], min)) if is_logits else None,
            "topk_agreement": _json_float(_worst([m.topk for m in ms], min)) if is_logits else None,
            "greedy_agreement": _json_float(greedy) if is_logits else None,
            "passed": all(m.passed for m in ms),
        })
    return out


def to_json(result: ValidationResult, model: dict[str, Any] | None = None) -> dict[str, Any]:
    from k3export import __version__

    scenarios = []
    for sc in result.scenarios:
        entry = sc.to_dict()
        entry["results"] = [
            {"runtime": r.runtime, "passed": r.passed, "steps_run": r.steps_run, "seconds": round(r.seconds, 3),
             "greedy_agreement": _json_float(sum(r.greedy) / len(r.greedy)) if r.greedy else None,
             "error": r.error, "localisation": r.localisation}
            for r in result.runs if r.scenario == sc.name]
        scenarios.append(entry)
    return {
        "schema_version": SCHEMA_VERSION,
        "passed": result.passed,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tool_version": __version__,
        "reference": result.reference,
        "runtimes": list(result.runtimes),
        "skipped": dict(result.skipped),
        "runtime_descriptions": dict(result.runtime_descriptions),
        "model": model,
        "tolerances": result.tolerances.to_dict(),
        "scenarios": scenarios,
        "summary": [row for run in result.runs for row in summarise(run)],
        "steps": [r.to_dict() for run in result.runs for r in run.records],
        "localisation": result.localisation,
    }


def check_schema(report: dict[str, Any]) -> None:
    """Raise ValueError when `report` does not follow schema version 1 (used by tests and readers)."""
    missing = [k for k in REQUIRED_KEYS if k not in report]
    if missing:
        raise ValueError(f"validation report lacks keys {missing}")
    if report["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"validation report schema_version {report['schema_version']!r} != {SCHEMA_VERSION}")
    if not isinstance(report["passed"], bool):
        raise ValueError("validation report 'passed' must be a bool")
    for row in report["summary"]:
        lacking = [k for k in SUMMARY_KEYS if k not in row]
        if lacking:
            raise ValueError(f"summary row lacks {lacking}")
    if not all(isinstance(s, dict) and "name" in s for s in report["scenarios"]):
        raise ValueError("every scenario needs a 'name'")
    if report["localisation"] is not None and not isinstance(report["localisation"], str):
        raise ValueError("'localisation' must be a string or null")


def write_json(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, separators=(",", ":"), allow_nan=False) + "\n", encoding="utf-8")
    return p


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    report = json.loads(Path(path).read_text(encoding="utf-8"))
    check_schema(report)
    return report


# ---------------------------------------------------------------------------------------------- table
def _e(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:.2e}"


def render_table(report: dict[str, Any], console: Any = None) -> None:
    """A rich table: one row per (runtime, scenario, tensor kind), worst over layers and steps."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"k3export validation vs {report['reference']}", show_lines=False)
    for col in ("runtime", "scenario", "tensor", "max abs", "rms rel", "cosine", "top-1", "greedy", "status"):
        table.add_column(col, justify="left" if col in ("runtime", "scenario", "tensor", "status") else "right")
    groups: dict[tuple, list[dict]] = {}
    for row in report["summary"]:
        groups.setdefault((row["runtime"], row["scenario"], row.get("kind", row["tensor"])), []).append(row)

    def worst(rows: list[dict], key: str, fn: Any) -> Any:
        vals = [r[key] for r in rows if r[key] is not None]
        if any(v == "inf" for v in vals):
            return "inf"
        vals = [v for v in vals if not isinstance(v, str)]
        return fn(vals) if vals else None

    for (rt, sc, kind), rows in groups.items():
        ok = all(r["passed"] for r in rows)
        label = kind if len(rows) == 1 else f"{kind} (x{len(rows)})"
        cos = worst(rows, "cosine", min)
        table.add_row(rt, sc, label, _e(worst(rows, "max_abs", max)), _e(worst(rows, "rms_rel", max)),
                      "-" if cos is None else (cos if isinstance(cos, str) else f"{cos:.6f}"),
                      "-" if rows[0]["top1_agreement"] is None else f"{rows[0]['top1_agreement']:.3f}",
                      "-" if rows[0]["greedy_agreement"] is None else f"{rows[0]['greedy_agreement']:.3f}",
                      "[green]pass[/]" if ok else "[bold red]FAIL[/]")
    for sc in report["scenarios"]:
        for res in sc.get("results", []):
            if res.get("error"):
                table.add_row(res["runtime"], sc["name"], "(run)", "-", "-", "-", "-", "-", "[bold red]ERROR[/]")
    if console.is_terminal:
        console.print(table)
    else:  # a pipe or file gets 80 columns by default: too narrow for the numbers
        saved = console.width
        console.width = max(saved, 132)
        try:
            console.print(table)
        finally:
            console.width = saved
    for rt, why in report.get("skipped", {}).items():
        console.print(f"[yellow]skipped[/] {rt}: {why}", highlight=False)
    for sc in report["scenarios"]:
        for res in sc.get("results", []):
            if res.get("error"):
                console.print(f"[red]{res['runtime']}/{sc['name']}:[/] {res['error']}", highlight=False)
    verdict = "[bold green]PASSED[/]" if report["passed"] else "[bold red]FAILED[/]"
    console.print(f"{verdict} ({len(report['runtimes'])} runtime(s), {len(report['scenarios'])} scenario(s))")
    if report["localisation"]:
        console.print(report["localisation"], highlight=False, markup=False)


# ---------------------------------------------------------------------------------------------- plot
def plot(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """PNG: rms_rel (worst over layers) vs step, one panel per runtime, one line per (scenario, kind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runtimes = list(report["runtimes"]) or ["(none)"]
    fig, axes = plt.subplots(1, len(runtimes), figsize=(5.5 * len(runtimes), 4), squeeze=False)
    styles = {"decode": "-", "chunked_prefill": ":", "batch": "--"}  # colour = tensor kind, style = scenario
    for ax, rt in zip(axes[0], runtimes):
        series: dict[tuple[str, str], dict[int, float]] = {}
        for rec in report["steps"]:
            if rec["runtime"] != rt:
                continue
            v = rec["rms_rel"]
            v = float("inf") if v == "inf" else (float("nan") if v is None else float(v))
            d = series.setdefault((rec["scenario"], rec["kind"]), {})
            d[rec["step"]] = max(d.get(rec["step"], 0.0), v)
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
        tol = report.get("tolerances", {}).get("logits", {}).get("rms_rel")
        if tol:
            ax.axhline(tol, color="red", linewidth=0.8, linestyle="-.")
            handles.append(Line2D([], [], color="red", linestyle="-.", label="logits tolerance"))
        ax.set_yscale("log")
        ax.set_xlabel("step (0 = prefill)")
        ax.set_ylabel("rms_rel vs reference (worst layer)")
        ax.set_title(f"{rt} vs {report['reference']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(handles=handles, fontsize=7)
    fig.suptitle("PASSED" if report["passed"] else "FAILED")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p
