"""`k3export build` (ONNX export -> TensorRT engine) and `k3export run` (prefill + decode on an engine).

`build` uses whichever TensorRT imports (datacenter TensorRT on its GPU, or TensorRT-RTX, which builds without a GPU
for a --target-cc) and says which; `run` needs an NVIDIA GPU. Without them they exit non-zero with one clear line."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from .common import console, user_errors


def register(app: typer.Typer) -> None:
    app.command("build")(build)
    app.command("run")(run)


def build(
    onnx_dir: Path = typer.Argument(..., help="ONNX export folder (model.onnx + state_manifest.json), or a "
                                              "pipeline export (pipeline.json: an engine in each stage's folder)."),
    engine_path: Path | None = typer.Argument(None, help="Where to write the TensorRT engine; for a pipeline, an "
                                                         "optional folder (each stage's engine in STAGE/model.engine "
                                                         "there; default: in each stage's folder)."),
    precision: str = typer.Option("bf16", "--precision", help="bf16 | fp16 | fp32 (must match the export's dtype)."),
    max_batch: int = typer.Option(1, "--max-batch", min=1, help="Largest batch the engine accepts."),
    max_seq: int = typer.Option(256, "--max-seq", min=1, help="Most new tokens in one prefill call."),
    max_context: int = typer.Option(1024, "--max-context", min=1, help="Most cached tokens (MLA latent length)."),
    timing_cache: Path = typer.Option(None, "--timing-cache", help="Timing cache file to reuse and update."),
    allow_no_plugins: bool = typer.Option(False, "--allow-no-plugins",
                                          help="Accept an export without k3 plugin nodes (standard ops only)."),
    jit: bool = typer.Option(False, "--jit", help="Prefer the JIT (Python) plugin implementations (debugging)."),
    target_cc: str = typer.Option(None, "--target-cc", help="Compute capability to build for, e.g. 8.6 (TensorRT-RTX; "
                                                            "default: the visible GPU's)."),
    opt_level: int = typer.Option(None, "--opt-level", min=0, max=5,
                                  help="TensorRT builder optimisation level: 0 builds fastest, 3 is TensorRT's default."),
    standard_ops: str = typer.Option("", "--standard-ops", help="k3 ops to build from their standard-op form instead "
                                                                "of their plugin, comma-separated (e.g. kda)."),
    verbose: bool = typer.Option(False, "--verbose", help="Show TensorRT's build log."),
) -> None:
    """Build a TensorRT engine with the k3 plugins (prefill and decode optimisation profiles).

    For a pipeline export, one engine per stage: every stage is checked first; one built the same way is kept."""
    with user_errors():
        from k3export.errors import ExportError
        from k3export.pipeline import is_pipeline

        options = dict(precision=precision, max_batch=max_batch, max_seq=max_seq, max_context=max_context,
                       timing_cache=timing_cache, allow_no_plugins=allow_no_plugins, prefer_aot=not jit,
                       progress=lambda m: console.print(m, highlight=False), target_cc=target_cc,
                       optimization_level=opt_level, verbose=verbose,
                       standard_ops=tuple(o.strip() for o in standard_ops.split(",") if o.strip()))
        if is_pipeline(onnx_dir):
            from k3export.pipeline.engines import build_stage_engines

            if engine_path is not None and (engine_path.is_file() or engine_path.suffix in (".engine", ".plan")):
                raise ExportError(f"{onnx_dir} is a pipeline export and {engine_path} names an engine file: give a "
                                  "folder for the stages' engines, or give no ENGINE_PATH (each stage's folder)")
            build_stage_engines(onnx_dir, engine_path, **options)
            return
        if engine_path is None:
            raise ExportError("missing ENGINE_PATH (usage: k3export build ONNX_DIR ENGINE_PATH)")
        from k3export.converters.tensorrt import build_engine

        build_engine(onnx_dir, engine_path, **options)


def run(
    engine: Path = typer.Argument(..., help="TensorRT engine built by `k3export build`, or a pipeline export "
                                            "folder (pipeline.json: its stages chained)."),
    onnx_dir: Path | None = typer.Option(None, "--onnx-dir", help="The ONNX export folder the engine came from "
                                                                  "(default: the engine's folder)."),
    prompt_len: int = typer.Option(16, "--prompt-len", min=1, max=1 << 20, help="Prompt tokens (random ids, fixed seed)."),
    steps: int = typer.Option(8, "--steps", min=0, max=1 << 20, help="Greedy decode steps after the prefill."),
    batch: int = typer.Option(1, "--batch", min=1, max=1 << 16, help="Sequences per call."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**63 - 1, help="Seed of the random prompt."),
    runtime: str = typer.Option("trt", "--runtime", help="A pipeline's stages on: trt (each stage's engine), ort, "
                                                         "ort-cuda."),
    ray: bool = typer.Option(False, "--ray", help="A pipeline's stages as Ray actors (RAY_ADDRESS, else local)."),
) -> None:
    """Prefill a random prompt, then decode greedily: the shared loop, feeding every input the manifest declares."""
    with user_errors():
        import numpy as np

        from k3export.runtime import greedy_decode
        from k3export.runtime.trt_runner import TrtRunner

        from k3export.pipeline import is_pipeline

        if is_pipeline(engine):
            from .pipeline import open_runner

            runner = open_runner(engine, ray=ray, address=os.environ.get("RAY_ADDRESS"), runtime=runtime)
            vocab = runner.config.vocab_size
        else:
            runner = TrtRunner(engine, onnx_dir)
            vocab = runner.export.config.vocab_size
        ids = np.random.default_rng(seed).integers(0, vocab, size=(batch, prompt_len), dtype=np.int64)
        try:
            result = greedy_decode(runner, ids, steps)
        finally:
            runner.close()
        console.print(f"prefill {prompt_len} tokens x {batch}: {result.prefill_seconds * 1e3:.1f} ms; "
                      f"{steps} decode steps: {result.decode_seconds * 1e3:.1f} ms", highlight=False)
        console.print(f"greedy tokens: {result.tokens.tolist()}", highlight=False)
