# Copyright 2026 the k3export authors. Apache-2.0.
"""``k3export build PIPELINE_DIR``: one TensorRT engine per stage of a pipeline export, resumable.

Each stage's engine is `STAGE_ENGINE` in its own folder, where `PipelineRunner` and the Ray runner find it. Every
stage is checked first (`converters.tensorrt.build.prepare_build`: the folder, the graph TensorRT will parse,
precision, profiles), so a bad stage 15 is refused before hours of GPU work on stages 0-14. A stage whose engine
was built the same way (its ``.json`` sidecar, `k3export.artifacts.EngineSidecar`, records the same graph,
precision, profiles, TensorRT and GPU as this build would) is kept, so a run that stopped resumes at the stage it
was building; every stage shares one timing cache when one is given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from k3export.artifacts import ArtifactError, EngineSidecar
from k3export.errors import ExportError

#: the engine file of a stage, in the stage's folder
STAGE_ENGINE = "model.engine"


def _built_the_same(engine: Path, sidecar: EngineSidecar) -> bool:
    """Whether `engine` is in place with a record of a build asked to do what `sidecar` records."""
    if not engine.is_file() or engine.is_symlink():
        return False
    try:
        return EngineSidecar.read_for(engine).same_build(sidecar)
    except ArtifactError:  # no record, or one of another version, or damaged: build it again
        return False


def build_stage_engines(pipeline_dir: str | os.PathLike[str], *, precision: str = "bf16", max_batch: int = 1,
                        max_seq: int = 256, max_context: int = 1024,
                        timing_cache: str | os.PathLike[str] | None = None, allow_no_plugins: bool = False,
                        prefer_aot: bool = True, progress: Callable[[str], None] | None = print) -> list[Path]:
    """Build (or keep, see the module docstring) the engine of every stage of `pipeline_dir`; returns their paths
    in stage order. The options are `build_engine`'s, the same for every stage."""
    from k3export.converters.tensorrt.build import _gpu_capability, build_engine, engine_sidecar, prepare_build
    from k3export.plugins import require_tensorrt

    from .export import load_pipeline

    report = progress or (lambda _msg: None)
    pipe = load_pipeline(pipeline_dir)
    plans = []
    for stage in pipe.stages:  # every stage refused or accepted before the first build
        try:
            plans.append(prepare_build(stage.root, precision, max_batch, max_seq, max_context, allow_no_plugins))
        except ExportError as exc:
            raise type(exc)(f"{stage.root}: {exc}") from None
    trt, _ = require_tensorrt()
    cc, gpu = _gpu_capability()
    engines = []
    for i, (stage, plan) in enumerate(zip(pipe.stages, plans)):
        engine = stage.root / STAGE_ENGINE
        head = f"stage {i + 1}/{len(plans)} ({stage.root.name})"
        if _built_the_same(engine, engine_sidecar(plan, trt.__version__, gpu, cc, prefer_aot)):
            report(f"{head}: {engine} kept (built the same way)")
        else:
            report(f"{head}: building {engine}")
            build_engine(stage.root, engine, precision=precision, max_batch=max_batch, max_seq=max_seq,
                         max_context=max_context, timing_cache=timing_cache, allow_no_plugins=allow_no_plugins,
                         prefer_aot=prefer_aot, progress=progress)
        engines.append(engine)
    return engines


__all__ = ["STAGE_ENGINE", "build_stage_engines"]
