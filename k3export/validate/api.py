"""One call from folders to a verdict: build the runners, run the scenarios, write the report (the CLI's body)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3export.errors import K3ExportError, ValidationFailed
from k3export.runtime.base import Runner, RuntimeUnavailable
from k3export.runtime.manifest import ManifestError

from .compare import Tolerances
from .core import ValidationResult, validate
from .report import plot, to_json, write_json
from .scenarios import load_prompts, make_scenarios

RUNTIMES = ("torch", "triton", "ort", "ort-cuda", "trt")
REPORT_FILE = "validation.json"


@dataclass
class ValidationRun:
    result: ValidationResult
    report: dict[str, Any]
    report_paths: list[Path]
    plot_path: Path | None


def parse_runtimes(spec: str | list[str]) -> list[str]:
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    unknown = [s for s in items if s not in RUNTIMES]
    if unknown:
        raise K3ExportError(f"unknown runtime(s) {unknown}; choose from {', '.join(RUNTIMES)}")
    if not items:
        raise K3ExportError("no runtime to validate")
    return list(dict.fromkeys(items))


def build_runners(model: Any, runtimes: list[str], *, onnx_dir: str | os.PathLike[str] | None = None,
                  engine: str | os.PathLike[str] | None = None, device: str = "cpu",
                  triton_steps: int | None = None, strict: bool = False) -> tuple[Runner, list[Runner], dict[str, str]]:
    """Reference (`TorchRunner`) + the requested runners. A runtime that cannot run here is skipped with its
    reason, unless `strict` (then `RuntimeUnavailable` propagates). Missing artifacts are errors."""
    from k3export.runtime.ort_runner import OrtRunner
    from k3export.runtime.torch_runner import TorchRunner, TritonRunner
    from k3export.runtime.trt_runner import TrtRunner

    reference = TorchRunner(model, device=device)
    runners: list[Runner] = []
    skipped: dict[str, str] = {}
    for rt in runtimes:
        try:
            if rt == "torch":
                runners.append(TorchRunner(model, device=device))
            elif rt == "triton":
                steps = triton_steps if triton_steps is not None else (8 if device == "cpu" else None)
                runners.append(TritonRunner(model, device=device, max_steps=steps))
            elif rt in ("ort", "ort-cuda"):
                if onnx_dir is None:
                    raise K3ExportError(f"runtime {rt} needs --onnx ONNX_DIR")
                providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if rt == "ort-cuda" else None
                r = OrtRunner(onnx_dir, providers=providers, name=rt)
                r.manifest.check_compatible(reference.manifest, f"ONNX export {onnx_dir}")
                runners.append(r)
            elif rt == "trt":
                from k3export.runtime.trt_runner import tensorrt_status

                why = tensorrt_status()
                if why is not None:
                    raise RuntimeUnavailable(f"trt runner: {why}")
                if engine is None:
                    raise K3ExportError("runtime trt needs --engine ENGINE")
                r = TrtRunner(engine, onnx_dir)
                r.manifest.check_compatible(reference.manifest, f"engine {engine}")
                runners.append(r)
        except RuntimeUnavailable as exc:
            if strict:
                raise
            skipped[rt] = str(exc)
    return reference, runners, skipped


def run_validation(model: Any, *, runtimes: list[str], onnx_dir: str | os.PathLike[str] | None = None,
                   engine: str | os.PathLike[str] | None = None, prompt_len: int = 16, steps: int = 32,
                   batch: int = 2, seed: int = 0, prompts_file: str | os.PathLike[str] | None = None,
                   tolerances: list[str] | None = None, report_path: str | os.PathLike[str] | None = None,
                   plot_path: str | os.PathLike[str] | None = None, device: str = "cpu",
                   triton_steps: int | None = None, strict: bool = False, progress: Any = None,
                   model_info: dict[str, Any] | None = None) -> ValidationRun:
    """Validate and write reports; never raises for a mismatch (check ``.result.passed``; the CLI turns a
    failure into `ValidationFailed`). `model` is a `K3ForCausalLM` or a model folder."""
    from k3export.runtime.torch_runner import load_model

    if not hasattr(model, "config"):
        model = load_model(model, device=device)
    reference, runners, skipped = build_runners(model, runtimes, onnx_dir=onnx_dir, engine=engine, device=device,
                                                triton_steps=triton_steps, strict=strict)
    if not runners:
        raise K3ExportError("no requested runtime can run here: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    prompts = load_prompts(prompts_file, model.config.vocab_size) if prompts_file else None
    scenarios = make_scenarios(model.config.vocab_size, prompt_len=prompt_len, steps=steps, batch=batch, seed=seed,
                               prompts=prompts)
    tols = Tolerances.parse(tolerances, reference.manifest.dtype)
    result = validate(reference, runners, scenarios, tols, skipped=skipped, progress=progress)
    info = dict(model_info or {})
    info.setdefault("dtype", reference.manifest.dtype)
    if onnx_dir is not None:
        info.setdefault("onnx_dir", str(onnx_dir))
    if engine is not None:
        info.setdefault("engine", str(engine))
    report = to_json(result, model=info)
    paths = []
    if report_path is not None:
        paths.append(write_json(report, report_path))
    if onnx_dir is not None and any(r.name.startswith("ort") for r in runners):
        target = Path(onnx_dir) / REPORT_FILE
        if not paths or target.resolve() != paths[0].resolve():
            paths.append(write_json(report, target))
    plotted = plot(report, plot_path) if plot_path is not None else None
    for r in runners:
        r.close()
    return ValidationRun(result, report, paths, plotted)


def raise_on_failure(run: ValidationRun) -> None:
    """`ValidationFailed` with the localisation line when the run did not pass (fail closed)."""
    if not run.result.passed:
        where = run.result.localisation or "see the report"
        raise ValidationFailed(f"validation failed: {where}")


__all__ = ["REPORT_FILE", "RUNTIMES", "ManifestError", "ValidationRun", "build_runners", "parse_runtimes",
           "raise_on_failure", "run_validation"]
