"""`k3export validate` (cross-runtime validation of an export) and `k3export quickstart` (tiny end-to-end demo:
make, export, validate, generate)."""

from __future__ import annotations

import io
import time
from pathlib import Path

import typer

from .common import KernelsOption, console, err_console, user_errors


def _progress(msg: str) -> None:
    err_console.print(f"[dim]{msg}[/]", highlight=False)


def _finish(run, quiet: bool = False) -> None:
    from k3export.validate.api import raise_on_failure
    from k3export.validate.report import render_table

    if not quiet:
        render_table(run.report, console)
    for p in run.report_paths:
        console.print(f"report: {p}", highlight=False)
    if run.plot_path is not None:
        console.print(f"plot: {run.plot_path}", highlight=False)
    raise_on_failure(run)


def _triton_interpreter_on_cpu(device: str) -> None:
    """On CPU the Triton kernels need TRITON_INTERPRET=1 before triton is imported: set it when still possible."""
    import os
    import sys

    if device == "cpu" and "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


def _set_threads(n: int) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _refuse_pipeline_as_onnx(onnx: Path | None) -> None:
    """A pipeline folder given as --onnx: say so, instead of the export loader's "runtime_config.json is missing"."""
    from k3export.errors import K3ExportError
    from k3export.pipeline.export import PipelineFile

    if onnx is not None and (onnx / PipelineFile.FILE).is_file():
        raise K3ExportError(f"--onnx {onnx}: a pipeline export ({PipelineFile.FILE} and stage folders), not one ONNX "
                            f"export; pass it as --pipeline {onnx}")


def validate_cmd(
    model_dir: Path = typer.Argument(..., help="PyTorch model folder (the reference; config.json + safetensors)."),
    onnx: Path | None = typer.Option(None, "--onnx", help="ONNX export folder (model.onnx + state_manifest.json)."),
    engine: Path | None = typer.Option(None, "--engine", help="TensorRT engine file or folder (needs TensorRT)."),
    pipeline: Path | None = typer.Option(None, "--pipeline", help="Pipeline export folder (pipeline.json), for the "
                                                                  "runtimes pipeline and ray."),
    runtimes: str | None = typer.Option(
        None, "--runtimes",
        help="Comma list of torch, torch-bf16, torch-fp16, triton, ort, ort-cuda, ort-webgpu, genai, openvino, "
             "openvino-stateless, openvino-decode-graph, onnx-reference, trt, pipeline, ray (ort-webgpu: the "
             "Python with onnxruntime-webgpu in K3EXPORT_WEBGPU_PYTHON). "
             "Default: torch,triton + ort with --onnx + trt with --engine + pipeline with --pipeline."),
    prompt_len: int = typer.Option(16, "--prompt-len", min=1, help="Prefill length P."),
    steps: int = typer.Option(32, "--steps", min=0, help="Decode steps D after the prefill (greedy feedback)."),
    batch: int = typer.Option(2, "--batch", min=1, help="Batch of the 'batch' scenario (1 disables it)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random prompts and chunk split points."),
    prompts: Path | None = typer.Option(None, "--prompts", help="JSON file: a list of lists of token ids."),
    tol: list[str] = typer.Option([], "--tol", help="Override a tolerance: KIND=VALUE (rms_rel) or KIND.METRIC=VALUE; "
                                                    "kinds logits, hidden, conv_state, recurrent_state, latent, *."),
    report: Path | None = typer.Option(None, "--report", help="Write the JSON report here (also validation.json "
                                                              "in the ONNX folder when ort runs)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of error vs decode step."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (reference, triton)."),
    kernels: KernelsOption = None,
    triton_steps: int | None = typer.Option(
        None, "--triton-steps", min=0,
        help="Most decode steps for triton (default 8 on CPU: the interpreter is slow)."),
    strict: bool = typer.Option(False, "--strict", help="Fail when a requested runtime cannot run here."),
    force: bool = typer.Option(False, "--force", help="Accept --tol overrides that make a comparison meaningless "
                                                      "(the report and the model card then say so)."),
    threads: int = typer.Option(0, "--threads", min=0, help="torch intra-op threads (0: torch's default). "
                                                            "1 is fastest for tiny models on few cores."),
    reference_dtype: str = typer.Option(
        "fp32", "--reference-dtype",
        help="What the PyTorch reference computes in: fp32 (default, a bf16 checkpoint upcast), fp64, or checkpoint "
             "(its stored dtype). Each runtime is judged with the tolerances of its own dtype; torch-bf16 runs "
             "PyTorch in bf16 as a runtime under test."),
    state: bool = typer.Option(False, "--state", help="Also the state scenarios: prefix_reuse, multi_turn, fork, "
                               "rollback (a kept, forked or rolled-back state against a fresh recompute)."),
    quality: Path | None = typer.Option(
        None, "--quality", metavar="TEXT_FILE",
        help="Also score each runtime's next-token distribution against the reference's over this UTF-8 text "
             "(tokenized with the model's tokenizer): perplexity, mean KL divergence, top-1 agreement "
             "(docs/quality.md)."),
    quality_context: int = typer.Option(512, "--quality-context", min=4, help="Window length of --quality; the "
                                        "second half of each window is scored, as llama-perplexity does."),
    max_kld: float | None = typer.Option(None, "--max-kld", help="Largest mean KL divergence a runtime may show "
                                         "with --quality (default by its dtype and quantization)."),
    min_top1: float | None = typer.Option(None, "--min-top1", help="Smallest top-1 agreement with --quality "
                                          "(default by the runtime's dtype and quantization)."),
) -> None:
    """Compare every runtime with the PyTorch reference over prefill + decode; non-zero exit on any mismatch."""
    _triton_interpreter_on_cpu(device)  # before anything imports triton
    from k3export.validate.api import parse_runtimes, run_validation

    _set_threads(threads)
    with user_errors():
        _refuse_pipeline_as_onnx(onnx)
        default = ["torch", "triton"] + (["ort"] if onnx else []) + (["trt"] if engine else []) + (
            ["pipeline"] if pipeline else [])
        spec = runtimes if runtimes is not None else ",".join(default)  # "" is refused, not the default
        run = run_validation(
            model_dir, runtimes=parse_runtimes(spec), onnx_dir=onnx, engine=engine, prompt_len=prompt_len,
            steps=steps, batch=batch, seed=seed, prompts_file=prompts, tolerances=tol, report_path=report,
            plot_path=plot, device=device, triton_steps=triton_steps, strict=strict, progress=_progress,
            model_info={"model_dir": Path(model_dir).name}, pipeline_dir=pipeline, force=force,
            reference_dtype=reference_dtype,
            state_scenarios=state, quality_text=quality, quality_context=quality_context, max_kld=max_kld,
            min_top1=min_top1, kernels=kernels)
        _finish(run)


QUICKSTART_PROMPT = "Hello"
QUICKSTART_IMAGE_PROMPT = "What is in this picture?"


def quickstart(
    out_dir: Path = typer.Argument(Path("k3export-quickstart"), help="Folder for the model, export and report."),
    seed: int = typer.Option(0, "--seed", help="Seed of the tiny model's weights and prompts."),
    prompt_len: int = typer.Option(8, "--prompt-len", min=1),
    steps: int = typer.Option(16, "--steps", min=0),
    triton_steps: int = typer.Option(2, "--triton-steps", min=0,
                                     help="Decode steps for the (slow, interpreted) Triton run."),
) -> None:
    """Tiny K3 -> ONNX export -> validate torch vs triton vs ort -> report -> a line of generated text; then a tiny
    image + text K3 -> its export (vision, embedding, decoder) -> text about a picture (under a minute on 2 CPU
    cores)."""
    _triton_interpreter_on_cpu("cpu")  # before anything imports triton
    from k3export.checkpoint_io import write_tiny_checkpoint, write_tiny_vision_checkpoint
    from k3export.converters.onnx import export_onnx
    from k3export.validate.api import run_validation

    from .generate import generate_text

    _set_threads(1)  # a tiny model: hundreds of small ops per step, one thread avoids oversubscription
    with user_errors():
        t0 = time.perf_counter()
        model_dir, onnx_dir = out_dir / "model", out_dir / "onnx"
        # our own output folders: a rerun replaces them, a folder k3export did not write is refused
        write_tiny_checkpoint(model_dir, seed=seed, overwrite=True)
        _progress(f"tiny K3 saved to {model_dir}")
        export_onnx(model_dir, onnx_dir, dtype="fp32", overwrite=True, debug_outputs=True)
        _progress(f"ONNX export in {onnx_dir}")
        run = run_validation(
            model_dir, runtimes=["torch", "triton", "ort"], onnx_dir=onnx_dir, prompt_len=prompt_len, steps=steps,
            batch=2, seed=seed, report_path=out_dir / "report.json", plot_path=out_dir / "plot.png",
            triton_steps=triton_steps, progress=_progress,
            model_info={"model_dir": model_dir.name, "tiny_model_seed": seed})
        _finish(run)
        # text in, text out through the export (random weights: the words mean nothing)
        text = "".join(generate_text(onnx_dir, QUICKSTART_PROMPT, runtime="ort", max_new_tokens=steps or 1))
        console.print(f"generate (ONNX Runtime, greedy): {QUICKSTART_PROMPT!r} -> {text!r}", highlight=False,
                      soft_wrap=True, markup=False)
        # image in, text out: the tiny model with a vision tower, exported with its image graphs
        vl_dir, vl_onnx, picture = out_dir / "vision-model", out_dir / "vision-onnx", out_dir / "picture.png"
        write_tiny_vision_checkpoint(vl_dir, seed=seed, overwrite=True)
        export_onnx(vl_dir, vl_onnx, dtype="fp32", overwrite=True)
        _progress(f"tiny image + text K3 saved to {vl_dir}, exported to {vl_onnx}")
        _write_picture(picture, seed)
        text = "".join(generate_text(vl_onnx, QUICKSTART_IMAGE_PROMPT, runtime="ort", max_new_tokens=steps or 1,
                                     images=[picture]))
        console.print(f"generate (ONNX Runtime, greedy, {picture.name}): {QUICKSTART_IMAGE_PROMPT!r} -> {text!r}",
                      highlight=False, soft_wrap=True, markup=False)
        console.print(f"quickstart finished in {time.perf_counter() - t0:.1f} s", highlight=False)


def _write_picture(path: Path, seed: int) -> None:
    """A seeded 40 x 28 picture (a colour gradient with a square), written whole or not at all."""
    import numpy as np
    from PIL import Image

    from k3export.safety import write_bytes_atomic

    y, x = np.mgrid[0:28, 0:40]
    rgb = np.stack([x * 6, y * 9, np.full_like(x, 40 * (seed % 6))], axis=-1).astype(np.uint8)
    rgb[8:20, 12:24] = 255
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    write_bytes_atomic(path.parent, path.name, buf.getvalue())


def register(app: typer.Typer) -> None:
    app.command("quickstart")(quickstart)
    app.command("validate")(validate_cmd)
