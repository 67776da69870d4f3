"""One call from folders to a verdict: build the runners, run the scenarios, write the report (the CLI's body)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3export.artifacts import ArtifactError, ValidationReport, load_export
from k3export.errors import K3ExportError, ValidationFailed
from k3export.pipeline import PIPELINE_RUNNERS
from k3export.safety import check_report_path
from k3export.runtime import RUNNERS, Runner, RuntimeUnavailable, Target

from .compare import Tolerances
from .core import ValidationResult, validate
from .report import plot, to_report, write_report
from .scenarios import image_scenario, load_prompts, make_scenarios
from .text_quality import (DEFAULT_CONTEXT, check_limits, limits_for, read_text_tokens, run_quality,
                           runtime_quantization, windows)

REPORT_FILE = ValidationReport.FILE
#: what the PyTorch reference computes in: fp32 or fp64 whatever the checkpoint stores (a bf16 reference rounds
#: every product to 8 bits and cannot tell an exact export from a broken one), or the checkpoint's own dtype
REFERENCE_DTYPES = ("fp32", "fp64", "checkpoint")
#: the runtimes that honour MatMulNBits' accuracy_level 4 (projection inputs rounded to int8 per block): ONNX
#: Runtime's (OpenVINO reads the node with fp32 inputs and matches the stored weights' product to fp32 rounding)
ROUNDS_ACTIVATIONS = ("ort", "genai")


def runners() -> dict[str, Any]:
    """What validate runs: every runtime of the registry (`k3export.runtime.RUNNERS`) and the pipeline runners."""
    return {**RUNNERS, **PIPELINE_RUNNERS}


RUNTIMES = tuple(runners())


def make_runner(runtime: str, target: Target) -> Runner:
    """The runner of `runtime` (`runners`) for `target`; `RuntimeUnavailable` when it cannot run here."""
    factories = runners()
    if runtime not in factories:
        raise K3ExportError(f"unknown runtime {runtime!r}; choose from {', '.join(factories)}")
    return factories[runtime](target)


@dataclass
class ValidationRun:
    result: ValidationResult
    report: ValidationReport
    report_paths: list[Path]
    plot_path: Path | None


def parse_runtimes(spec: str | list[str]) -> list[str]:
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    known = runners()
    unknown = [s for s in items if s not in known]
    if unknown:
        raise K3ExportError(f"unknown runtime(s) {unknown}; choose from {', '.join(known)}")
    if not items:
        raise K3ExportError("no runtime to validate")
    return list(dict.fromkeys(items))


def check_same_states(reference: Runner, runner: Runner) -> None:
    """`ArtifactError` naming the first state of `runner` whose name or shape differs from the reference model's
    (an export of another model)."""
    mine, theirs = runner.manifest.by_name(), reference.manifest.by_name()
    for name, s in theirs.items():
        if name not in mine or mine[name].shape != s.shape:
            got = "missing" if name not in mine else f"shape {list(mine[name].shape)}"
            raise ArtifactError(f"{runner.describe()}: state {name!r} is {got}; the reference model has shape "
                                f"{list(s.shape)} (an export of another model?)")
    extra = [n for n in mine if n not in theirs]
    if extra:
        raise ArtifactError(f"{runner.describe()}: state {extra[0]!r} is not a state of the reference model")


def build_runners(model: Any, runtimes: list[str], *, onnx_dir: str | os.PathLike[str] | None = None,
                  engine: str | os.PathLike[str] | None = None, device: str = "cpu",
                  triton_steps: int | None = None, strict: bool = False,
                  pipeline_dir: str | os.PathLike[str] | None = None,
                  kernels: bool | None = None) -> tuple[Runner, list[Runner], dict[str, str]]:
    """Reference (torch) + the requested runners (`runners`). A runtime that cannot run here is
    skipped with its reason, unless `strict` (then `RuntimeUnavailable` propagates). Missing or malformed
    artifacts are errors. `kernels`: `Target.kernels`."""
    target = Target(model=model, onnx_dir=onnx_dir, engine=engine, device=device, triton_steps=triton_steps,
                    pipeline_dir=pipeline_dir, kernels=kernels)
    reference = make_runner("torch", target)
    runners: list[Runner] = []
    skipped: dict[str, str] = {}
    for rt in runtimes:
        try:
            r = make_runner(rt, target)
        except RuntimeUnavailable as exc:
            if strict:
                raise
            skipped[rt] = str(exc)
            continue
        check_same_states(reference, r)
        runners.append(r)
    return reference, runners, skipped


def _check_reference_dtype(reference_dtype: str) -> None:
    if reference_dtype not in REFERENCE_DTYPES:
        raise K3ExportError(f"--reference-dtype {reference_dtype!r}: choose one of {', '.join(REFERENCE_DTYPES)}")


def reference_model(model: Any, reference_dtype: str = "fp32", *, images: bool = False, device: str = "cpu") -> Any:
    """The reference `K3ForCausalLM` (or `K3ForConditionalGeneration` with `images`) in `reference_dtype`
    (`REFERENCE_DTYPES`): a model folder loaded in that dtype (a bf16 checkpoint upcast as it is read), or a model
    object as it is when it already computes in it, else a copy cast to it."""
    from k3export.runtime.torch_runner import cast_model, load_model, load_vision_model

    _check_reference_dtype(reference_dtype)
    dtype = None if reference_dtype == "checkpoint" else reference_dtype
    if not hasattr(model, "config"):
        return (load_vision_model if images else load_model)(model, dtype=dtype, device=device)
    return model if dtype is None else cast_model(model, dtype)


def run_validation(model: Any, *, runtimes: list[str], onnx_dir: str | os.PathLike[str] | None = None,
                   engine: str | os.PathLike[str] | None = None, prompt_len: int = 16, steps: int = 32,
                   batch: int = 2, seed: int = 0, prompts_file: str | os.PathLike[str] | None = None,
                   tolerances: list[str] | None = None, report_path: str | os.PathLike[str] | None = None,
                   plot_path: str | os.PathLike[str] | None = None, device: str = "cpu",
                   triton_steps: int | None = None, strict: bool = False, progress: Any = None,
                   model_info: dict[str, Any] | None = None,
                   pipeline_dir: str | os.PathLike[str] | None = None, force: bool = False,
                   reference_dtype: str = "fp32", state_scenarios: bool = False,
                   quality_text: str | os.PathLike[str] | None = None, quality_context: int = DEFAULT_CONTEXT,
                   max_kld: float | None = None, min_top1: float | None = None,
                   kernels: bool | None = None) -> ValidationRun:
    """Validate and write reports; never raises for a mismatch (check ``.result.passed``; the CLI turns a
    failure into `ValidationFailed`). `model` is a `K3ForCausalLM` or a model folder; the reference computes in
    `reference_dtype` (`reference_model`), each runtime is judged with the tolerances of its own dtype. An export
    folder that `load_export` refuses is an error, never a report. `state_scenarios`: also prefix_reuse,
    multi_turn, fork and rollback (`state_scenarios.state_scenarios`). `quality_text`: also each runtime's
    next-token distribution against the reference's over that text, in windows of `quality_context` tokens
    (`text_quality.run_quality`), judged by `max_kld` / `min_top1` (default: `text_quality.DEFAULT_LIMITS` of the
    runtime's dtype and quantization). `kernels`: k3export's native kernels on or off in the runners of exports
    (`Target.kernels`; None: the environment's default)."""
    _check_reference_dtype(reference_dtype)  # before any work
    if quality_text is not None:
        check_limits(max_kld, min_top1, quality_context)
    if report_path is not None:  # before the work: a path that may not be written fails in a second
        report_path = check_report_path(report_path, ValidationReport.FORMAT)
    if plot_path is not None:
        plot_path = check_report_path(plot_path, None)
    export = load_export(onnx_dir) if onnx_dir is not None else None
    # an image + text export, or a pipeline whose stage 0 holds the image graphs (their processor and placeholder)
    image_export = export
    if image_export is None and pipeline_dir is not None:
        from k3export.pipeline import load_pipeline

        image_export = load_pipeline(pipeline_dir).stages[0]
    images = image_export is not None and bool(image_export.runtime.graphs)
    model_folder = None if hasattr(model, "config") else model
    model = reference_model(model, reference_dtype, images=images, device=device)
    quantized = export.runtime.quantize if export is not None else None
    compared = model  # an export with quantized projections: compared with the model holding the same weights
    if quantized is not None:
        if images:
            raise K3ExportError(f"{onnx_dir}: a quantized image + text export cannot be validated yet (its "
                                "reference would need the vision model's quantized copy)")
        from k3export.converters.onnx.quantize import QUANTIZE, fake_quantized

        compared = fake_quantized(model, QUANTIZE[quantized], export.runtime.quantize_block_size)
    reference, runners, skipped = build_runners(compared, runtimes, onnx_dir=onnx_dir, engine=engine, device=device,
                                                triton_steps=triton_steps, strict=strict, pipeline_dir=pipeline_dir,
                                                kernels=kernels)
    # int8-rounded projection inputs (accuracy_level 4) follow no elementwise bound a tolerance could state (on the
    # tiny model they move the logits by rms_rel 0.1-0.3 from the same weights with fp32 inputs): such a runtime is
    # judged by its next-token quality alone, which then must be asked for
    by_quality = [r for r in runners if quantized is not None and export.runtime.quantize_accuracy_level == 4
                  and r.name.startswith(ROUNDS_ACTIVATIONS) and getattr(r, "export", None) is not None]
    if by_quality and quality_text is None:
        raise K3ExportError(f"{onnx_dir}: its projections round their inputs to int8 on {by_quality[0].name} (export "
                            "--quantize-activations, the default), which is judged by its next-token quality: add "
                            "--quality TEXT_FILE (or export with --no-quantize-activations to compare tensors)")
    if not runners:
        raise K3ExportError("no requested runtime can run here: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    text = getattr(model.config, "text_config", model.config)  # an image + text model's text config
    quality_windows = None
    if quality_text is not None:  # read and cut before the scenarios run: a bad file fails early
        if reference.manifest.dtype not in ("float32", "float64"):
            raise K3ExportError(f"--quality needs a reference that computes in fp32 or wider, not "
                                f"{reference.manifest.dtype} (--reference-dtype fp32)")
        tokenizer_folders = [model_folder, onnx_dir, pipeline_dir]
        ids = read_text_tokens(quality_text, tokenizer_folders, text.vocab_size)
        quality_windows = windows(ids, quality_context, f"--quality {quality_text}")
    prompts = load_prompts(prompts_file, text.vocab_size) if prompts_file else None
    scenarios = make_scenarios(text.vocab_size, prompt_len=prompt_len, steps=steps, batch=batch, seed=seed,
                               prompts=prompts)
    if images and getattr(reference, "takes_images", False):
        scenarios.append(image_scenario(image_export.root, image_export.runtime.media_placeholder_token_id,
                                        text.vocab_size,
                                        prompt_len=prompt_len, steps=min(steps, 8), seed=seed))
    if state_scenarios:
        from .state_scenarios import state_scenarios as make_state_scenarios

        scenarios += make_state_scenarios(text.vocab_size, prompt_len=prompt_len, seed=seed)
    tols = Tolerances.parse(tolerances, reference.manifest.dtype, force=force)
    elementwise = [r for r in runners if r not in by_quality]
    result = validate(reference, elementwise, scenarios, tols, skipped=skipped, progress=progress)
    for r in by_quality:  # in the report beside the others, judged by the quality verdict below
        result.runtimes.append(r.name)
        result.runtime_descriptions[r.name] = r.describe() + " (judged by --quality: int8 projection inputs)"
        result.runtime_dtypes[r.name] = r.manifest.dtype
    info = dict(model_info or {})
    if quantized is not None:
        info["reference_weights"] = (f"{quantized} blocks of {export.runtime.quantize_block_size}, as the export "
                                     "stores them (the quality figures: against the unquantized model)")
        info["quantize_accuracy_level"] = export.runtime.quantize_accuracy_level
    if quality_windows is not None:
        limits = {r.name: limits_for(r.manifest.dtype, runtime_quantization(r), max_kld, min_top1) for r in runners}
        # the quality is the distance from the model itself (fp32 or wider), quantized weights included
        unquantized = reference if compared is model else make_runner("torch", Target(model=model, device=device))
        result.quality = run_quality(unquantized, runners, quality_windows, limits, progress=progress)
        info.update(quality_text=Path(quality_text).name, quality_context=quality_context,
                    quality_windows=len(quality_windows))
    info.setdefault("dtype", reference.manifest.dtype)
    if onnx_dir is not None:  # names, not local paths: the report is published with the artifact
        info.setdefault("onnx_dir", Path(onnx_dir).name)
    if engine is not None:
        info.setdefault("engine", Path(engine).name)
    report = to_report(result, model=info, artifacts=export.file_digests() if export is not None else None)
    paths = []
    if report_path is not None:
        paths.append(write_report(report, report_path))
    if export is not None and any(r.name.startswith("ort") for r in runners):
        target = export.root / REPORT_FILE
        if not paths or target.resolve() != paths[0].resolve():
            paths.append(report.write(export.root))
    plotted = plot(report, plot_path) if plot_path is not None else None
    for r in runners:
        r.close()
    return ValidationRun(result, report, paths, plotted)


def raise_on_failure(run: ValidationRun) -> None:
    """`ValidationFailed` with the localisation line when the run did not pass (fail closed)."""
    if not run.result.passed:
        where = run.result.localisation or "see the report"
        raise ValidationFailed(f"validation failed: {where}")


__all__ = ["REFERENCE_DTYPES", "REPORT_FILE", "RUNTIMES", "ValidationRun", "build_runners", "check_same_states", "make_runner",
           "parse_runtimes", "raise_on_failure", "reference_model", "run_validation", "runners"]
