# Copyright 2026 the k3export authors. Apache-2.0.
"""``k3export build PIPELINE_DIR``: one TensorRT engine per stage of a pipeline export, resumable.

Each stage's engine is `STAGE_ENGINE` in its own folder, where `PipelineRunner` and the Ray runner find it (or,
given an engine folder, in a folder of the stage's name there: `stage_engine`). Every
stage is checked first (`converters.tensorrt.build.prepare_build`: the folder, the graph TensorRT will parse,
precision, profiles; then `planned_sidecar`: the target and precision against the installed TensorRT), so a bad
stage 15 is refused before hours of work on stages 0-14. A stage whose engine was built the same way (its ``.json``
sidecar, `k3export.artifacts.EngineSidecar`, records the same graph, precision, profiles, TensorRT, GPU, target,
optimisation level and standard ops as this build would) is kept, so a run that stopped resumes at the stage it
was building; every stage shares one timing cache when one is given. The options are `build_engine`'s, so with
TensorRT-RTX a pipeline builds with no GPU for a `target_cc`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

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


def stage_engine(stage_root: Path, engine_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a stage's engine is written: `STAGE_ENGINE` in the stage's folder, or in ``engine_dir/<stage folder
    name>`` when an engine folder is given."""
    return (stage_root if engine_dir is None else Path(engine_dir) / stage_root.name) / STAGE_ENGINE


def build_stage_engines(pipeline_dir: str | os.PathLike[str], engine_dir: str | os.PathLike[str] | None = None, *,
                        precision: str = "bf16", max_batch: int = 1,
                        max_seq: int = 256, max_context: int = 1024,
                        timing_cache: str | os.PathLike[str] | None = None, allow_no_plugins: bool = False,
                        prefer_aot: bool = True, progress: Callable[[str], None] | None = print,
                        target_cc: str | tuple[int, int] | None = None, optimization_level: int | None = None,
                        standard_ops: Sequence[str] = (), verbose: bool = False) -> list[Path]:
    """Build (or keep, see the module docstring) the engine of every stage of `pipeline_dir`; returns their paths
    in stage order (`stage_engine`). The options are `build_engine`'s, the same for every stage; each of `standard_ops` is built
    from its standard-op form in the stages that have it (an op no stage has is refused)."""
    from k3export.converters.tensorrt.build import build_engine, planned_sidecar, prepare_build

    from .export import load_pipeline

    report = progress or (lambda _msg: None)
    pipe = load_pipeline(pipeline_dir)
    wanted = sorted(set(standard_ops))
    stage_ops: list[list[str]] = []
    plans = []
    for stage in pipe.stages:  # every stage refused or accepted before the first build
        try:
            plan = prepare_build(stage.root, precision, max_batch, max_seq, max_context, allow_no_plugins)
            ops = [op for op in wanted if op in {n.op for n in plan["k3_nodes"]}]
            if ops:
                plan = prepare_build(stage.root, precision, max_batch, max_seq, max_context, allow_no_plugins, ops)
        except ExportError as exc:
            raise type(exc)(f"{stage.root}: {exc}") from None
        stage_ops.append(ops)
        plans.append(plan)
    missing = [op for op in wanted if not any(op in ops for ops in stage_ops)]
    if missing:
        raise ExportError(f"{pipe.root}: no stage has a k3::{missing[0]} node to build from its standard-op form")
    # the target and precision against the installed TensorRT (one line naming the alternatives), before any build
    planned = [planned_sidecar(plan, prefer_aot, target_cc, optimization_level) for plan in plans]
    engines = []
    for i, (stage, ops, sidecar) in enumerate(zip(pipe.stages, stage_ops, planned)):
        engine = stage_engine(stage.root, engine_dir)
        head = f"stage {i + 1}/{len(plans)} ({stage.root.name})"
        if _built_the_same(engine, sidecar):
            report(f"{head}: {engine} kept (built the same way)")
        else:
            report(f"{head}: building {engine}")
            engine.parent.mkdir(parents=True, exist_ok=True)  # ENGINE_DIR/stage-NN, made as its turn comes
            build_engine(stage.root, engine, precision=precision, max_batch=max_batch, max_seq=max_seq,
                         max_context=max_context, timing_cache=timing_cache, allow_no_plugins=allow_no_plugins,
                         prefer_aot=prefer_aot, progress=progress, verbose=verbose, target_cc=target_cc,
                         optimization_level=optimization_level, standard_ops=ops)
        engines.append(engine)
    return engines


__all__ = ["STAGE_ENGINE", "build_stage_engines", "stage_engine"]
