# Copyright 2026 the k3export authors. Apache-2.0.
"""A pipeline export: N ordinary export folders over contiguous layer ranges, plus ``pipeline.json``.

::

    OUT/pipeline.json      the stages in order
    OUT/tokenizer.json ... the source checkpoint's tokenizer, as a whole export holds it (when it has one)
    OUT/stage-00/          an ordinary export folder (`export_onnx(..., layers=...)`: model.onnx, data shards,
    OUT/stage-01/ ...      state_manifest.json, runtime_config.json) holding layers [start, stop), plus stage.json

Stage 0 takes ``input_ids`` and owns the embedding; the last stage owns the final norm and ``lm_head`` and returns
``logits``; every other cut passes the contract's boundary tensors (`contract.boundary_specs`: the hidden state
and, with Attention Residuals, the completed block summaries) as ``stage_out.*`` -> ``stage_in.*``. Every stage
takes ``attention_mask`` and carries only its own layers' states, each declared in its manifest, so each stage
builds into its own engine (``k3export build OUT/stage-03 ...``).

An image + text model (a vision tower: `export_onnx`'s ``vision``) puts its image graphs with stage 0: stage 0's
folder is an image + text export of layers [0, k) (``vision.onnx``, ``embedding.onnx``, the processor files, its
decoder part on ``inputs_embeds``, all recorded in its own ``runtime_config.json`` ``graphs`` and manifest, their one
home); later stages are as for a text model. `load_pipeline` refuses image graphs in any other stage, and
``stage.json`` records the image graphs' sha256 beside the decoder's. ``vision=False`` exports every stage text-only.

``pipeline.json`` (`PipelineFile`)::

    {"format": "k3export.pipeline", "format_version": 1,
     "export_id": "3f2a...",                 # shared with every stage's stage.json
     "stages": [{"folder": "stage-00", "layers": [0, 6], "weight_bytes": 123}, ...]}

``stage.json`` (`StageFile`): ``export_id``, ``stage`` (its index), ``num_stages``, ``layers`` [start, stop).
The model config, dtype and graph I/O are each stage's own export files. `load_pipeline` checks every stage with
`load_export` and refuses, with one line, a stage folder whose export id, index or layers disagree with
``pipeline.json`` (stage folders of different exports mixed), a stage graph (decoder or image graph) changed since it
was written (its sha256 against ``stage.json``'s), image graphs outside stage 0, stages built from different configs
or dtypes, a folder name that leaves the export, and ranges that leave out or repeat a layer.

A pipeline streamed from a checkpoint folder is built in ``.OUT.partial`` (`k3export.safety`) and resumes after a
kill: ``.k3export-resume/pipeline.json`` there records its key (stage ranges, options, the source files' identity)
and export id; a finished stage (complete, with its ``stage.json``) is kept, the stage being written resumes from
its finished data shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from k3export.artifacts import ArtifactError, Document, ExportFolder, ResumeRecord, load_export
from k3export.artifacts.codec import fail
from k3export.files import file_sha256

from .plan import DEFAULT_CONTEXT, PipelineError, StagePlan, check_ranges, layer_costs, plan_stages, read_stage_plan


def stage_folder(index: int, n: int) -> str:
    return f"stage-{index:0{max(2, len(str(n - 1)))}d}"


# ---------------------------------------------------------------------------------------------- the two files
@dataclass(frozen=True)
class StageEntry:
    folder: str
    layers: tuple[int, int]
    weight_bytes: int


@dataclass
class PipelineFile(Document):
    FILE = "pipeline.json"
    FORMAT = "k3export.pipeline"

    export_id: str
    stages: list[StageEntry]

    def check(self, file: Any) -> None:
        for n, s in enumerate(self.stages):
            pure = PurePosixPath(s.folder)
            if not s.folder or pure.is_absolute() or len(pure.parts) != 1 or s.folder in (".", ".."):
                raise fail(file, f"stages[{n}].folder", f"{s.folder!r} is not a folder name inside the export")
        check_ranges([range(*s.layers) for s in self.stages], self.stages[-1].layers[1] if self.stages else 0,
                     str(file))


@dataclass
class StageFile(Document):
    FILE = "stage.json"
    FORMAT = "k3export.pipeline_stage"

    export_id: str
    stage: int
    num_stages: int
    layers: tuple[int, int]
    #: sha256 of the stage's graph and data shards when it was written (the shards' computed while writing): an
    #: interrupted run keeps the stage only if its files still have them
    sha256: dict[str, str] = field(default_factory=dict)


@dataclass
class Pipeline:
    """A loaded, checked pipeline export (`load_pipeline`): the stages in order, each a checked `ExportFolder`."""

    root: Path
    file: PipelineFile
    stages: list[ExportFolder]

    @property
    def config(self) -> Any:
        return self.stages[0].config

    @property
    def dtype(self) -> str:
        return self.stages[0].dtype

    @property
    def export_id(self) -> str:
        return self.file.export_id

    @property
    def ranges(self) -> list[range]:
        return [range(*s.layers) for s in self.file.stages]

    @property
    def has_vision(self) -> bool:
        """Whether stage 0 holds the image graphs (its decoder part then takes ``inputs_embeds``)."""
        return self.stages[0].has_vision


def is_pipeline(path: str | os.PathLike[str]) -> bool:
    return os.path.lexists(Path(path) / PipelineFile.FILE)


def load_pipeline(path: str | os.PathLike[str]) -> Pipeline:
    """Read and check a pipeline export (see the module docstring); every refusal is one line."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise PipelineError(f"{root}: no such pipeline export folder")
    if not is_pipeline(root):
        raise PipelineError(f"{root} is not a pipeline export: {PipelineFile.FILE} is missing")
    try:
        pf = PipelineFile.read(root)
        where = root / PipelineFile.FILE
        if not pf.stages:
            raise fail(where, "stages", "no stages")
        stages: list[ExportFolder] = []
        for n, entry in enumerate(pf.stages):
            folder = root / entry.folder
            if not folder.is_dir() or folder.resolve().parent != root.resolve():
                raise fail(where, f"stages[{n}].folder", f"{entry.folder!r} is not a stage folder of the export")
            marker = StageFile.read(folder)
            sfile = folder / StageFile.FILE
            if marker.export_id != pf.export_id:
                raise PipelineError(f"{sfile}: a stage folder of another export (export_id {marker.export_id[:12]}, "
                                    f"{PipelineFile.FILE} has {pf.export_id[:12]}); export the pipeline again")
            if (marker.stage, marker.num_stages, marker.layers) != (n, len(pf.stages), entry.layers):
                raise PipelineError(f"{sfile}: is stage {marker.stage} of {marker.num_stages} (layers "
                                    f"{list(marker.layers)}), {PipelineFile.FILE} lists it as stage {n} of "
                                    f"{len(pf.stages)} (layers {list(entry.layers)})")
            export = load_export(folder)
            if n and export.has_vision:
                raise PipelineError(f"{folder / export.runtime.FILE}: stage {n} lists image graphs (graphs); only "
                                    f"stage 0 of a pipeline carries them")
            for graph in _graph_files(export):  # the graphs: small to hash
                recorded = marker.sha256.get(graph)
                if recorded is not None and file_sha256(folder / graph) != recorded:
                    raise PipelineError(f"{folder / graph}: changed since the pipeline was written (its sha256 is "
                                        f"not the one {sfile} records); export the pipeline again")
            if export.manifest.layers != entry.layers:
                raise PipelineError(f"{folder / export.manifest.FILE}: holds layers {list(export.manifest.layers)}, "
                                    f"{PipelineFile.FILE} lists {list(entry.layers)}")
            if stages and (export.config.to_dict() != stages[0].config.to_dict() or export.dtype != stages[0].dtype):
                raise PipelineError(f"{folder}: built from another model config or dtype than {pf.stages[0].folder}")
            stages.append(export)
        L = stages[0].config.num_hidden_layers
        check_ranges([range(*e.layers) for e in pf.stages], L, str(where))
    except ArtifactError as exc:
        raise PipelineError(str(exc)) from None
    return Pipeline(root, pf, stages)


# ---------------------------------------------------------------------------------------------- export
@dataclass
class PipelineExportResult:
    out_dir: Path
    export_id: str
    plan: StagePlan
    weight_bytes: list[int]
    num_nodes: list[int]
    weights_materialized: bool
    seconds: float


def _pipeline_key(folder: Path, ranges: list[range], options: dict[str, Any]) -> str:
    """A hash of what a pipeline export writes: the stage ranges, the export options and the identity of every
    checkpoint file (`source_identity`, as a single export's resume key)."""
    from k3export import __version__
    from k3export.converters.onnx.export import source_identity

    payload = {"version": __version__, "ranges": [[r.start, r.stop] for r in ranges], "options": options,
               "sources": source_identity(folder)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _prepare_resume(work: Path, key: str, restart: bool) -> str:
    """The export id of the pipeline being built in resumable partial folder `work`: the interrupted run's when it
    had the same key (its finished stage folders are kept), a new one otherwise (`shards.resume_record`)."""
    from k3export.converters.onnx.shards import resume_record, write_resume_record

    record = resume_record(work, "pipeline.json", key, restart, "pipeline export", PipelineError)
    export_id = record.export_id if record is not None and record.export_id else uuid.uuid4().hex
    write_resume_record(work, "pipeline.json", ResumeRecord(key, export_id))
    return export_id


def _finished_stage(folder: Path, export_id: str, index: int, n: int, layers: range) -> ExportFolder | None:
    """Stage folder `folder` of an interrupted run when it is complete, is that stage (its stage.json written
    after the export was renamed into place) and its graph and data shards still have the sha256 stage.json
    recorded; else None, the folder removed (a stage changed since, or without its stage.json, is exported again)."""
    from k3export.safety import COMPLETE, read_marker

    if not folder.is_dir() or folder.is_symlink():
        return None
    try:
        marker = StageFile.read(folder) if (folder / StageFile.FILE).is_file() else None
        if marker is not None and (marker.export_id, marker.stage, marker.num_stages, marker.layers) == \
                (export_id, index, n, (layers.start, layers.stop)) and \
                (read_marker(folder) or {}).get("state") == COMPLETE:
            kept = load_export(folder)
            files = [kept.runtime.model_file, *kept.runtime.data_files,
                     *(f for g in kept.runtime.graphs for f in (g.model_file, *g.data_files))]
            if all(marker.sha256.get(f) == file_sha256(folder / f) for f in files):
                return kept
    except ArtifactError:
        pass
    shutil.rmtree(folder)  # inside our own partial folder: written by the interrupted run
    return None


def export_pipeline(model_or_dir: Any, out_dir: str | os.PathLike[str], *, stages: int | None = None,
                    stage_plan: str | os.PathLike[str] | list[range] | None = None, dtype: Any = "fp32",
                    opset: int | None = 27, weights: bool = True, overwrite: bool = False,
                    max_shard_bytes: int | None = None, attention_mask: bool = True, debug_outputs: bool = False,
                    context: int = DEFAULT_CONTEXT, experts: str | None = None, allow_nonfinite: bool = False,
                    vision: bool | None = None, progress: Callable[[str], None] | None = None,
                    bytes_progress: Callable[[int, int], None] | None = None,
                    state_window: int = 0) -> PipelineExportResult:
    """Export `model_or_dir` (what `export_onnx` takes) as `stages` stages balanced by bytes (weights + the state
    of one sequence of `context` tokens), or along `stage_plan` (a plan file or a list of layer ranges), into
    `out_dir` (see the module docstring). Each stage is `export_onnx(..., layers=range)`; the whole folder is
    built beside `out_dir` and renamed into place when every stage is written (`k3export.safety`). `experts` and
    `allow_nonfinite` are `export_onnx`'s: a checkpoint keeping MXFP4 experts gives MXFP4 stages by default, each
    streamed from the checkpoint and balanced by the bytes it will hold. `vision`: the image graphs of a model with
    a vision tower go with stage 0 (default: yes for such a model; ``False``: every stage text-only). `progress`
    gets a line per stage written, `bytes_progress` (weight bytes written, planned in all) follows the weights
    through the stages. `state_window`: each stage returns its states' window (`export_onnx`).

    A pipeline streamed from a checkpoint folder resumes: it is built in ``.OUT.partial``, kept when a run fails or
    is killed; the next run with the same source, stages and options keeps every finished stage, resumes the
    stage it was writing from its finished data shards (`export_onnx`) and writes the rest. Another source or
    plan is refused unless ``overwrite``, which starts over."""
    from k3export.converters.onnx.export import export_dtype, export_onnx, resolve_model, resolve_vision
    from k3export.converters.onnx.mxfp4 import choose_experts, keeps_mxfp4
    from k3export.converters.onnx.shards import DEFAULT_MAX_SHARD_BYTES, RESUME_DIR
    from k3export.errors import ConfigError
    from k3export.safety import PIPELINE, output_folder

    t0 = time.perf_counter()
    if stages is None and stage_plan is None:
        raise PipelineError("give a number of stages (--stages N) or a stage plan (--stage-plan FILE)")
    act = export_dtype(dtype)
    config, _, folder, config_json = resolve_model(model_or_dir, weights=False)
    if folder is not None:  # a Hub id is read from its local snapshot, like a folder
        model_or_dir = folder
    fmt = choose_experts(experts, keeps_mxfp4(None, config_json=config_json), weights)
    vl = None
    if vision is not False:
        try:
            vl = resolve_vision(model_or_dir, config_json)
        except ConfigError:  # not MoonViT-V2's tower: export_onnx warns and exports the text model alone
            if vision:
                raise
        if vision and vl is None:
            raise PipelineError("vision=True, but the model has no vision tower (no vision_config): an image + text "
                                "pipeline needs one")
        vision = vl is not None
    costs = layer_costs(config, act.name, mxfp4_experts=fmt == "mxfp4",
                        vision_config=vl.vision_config if vision else None)
    if stage_plan is None:
        plan = plan_stages(config, stages, context=context, costs=costs)  # type: ignore[arg-type]
    else:
        L = config.num_hidden_layers
        ranges = (read_stage_plan(stage_plan, L) if isinstance(stage_plan, (str, os.PathLike))
                  else check_ranges(list(stage_plan), L))
        if stages is not None and stages != len(ranges):
            raise PipelineError(f"--stages {stages} disagrees with the stage plan's {len(ranges)} stages")
        plan = StagePlan([costs.stage(i, r.start, r.stop) for i, r in enumerate(ranges)], costs)

    sources = [model_or_dir] if isinstance(model_or_dir, (str, os.PathLike)) else []
    options = dict(dtype=act.name, opset=27 if opset is None else opset, max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
                   attention_mask=attention_mask, debug_outputs=debug_outputs, experts=fmt,
                   allow_nonfinite=allow_nonfinite, vision=vision, state_window=state_window)
    n = len(plan)
    wbytes, nodes = [], []
    # each stage streams its own layers' tensors from a checkpoint folder (a 1.45 TB release is never decoded into
    # memory), and such a pipeline resumes
    resumable = weights and folder is not None
    with output_folder(out_dir, PIPELINE, overwrite=overwrite, sources=sources, resumable=resumable) as work:
        export_id = (_prepare_resume(work, _pipeline_key(folder, plan.ranges, options), overwrite) if resumable
                     else uuid.uuid4().hex)
        entries = []
        planned = sum(s.weight_bytes for s in plan.stages)
        materialized = weights
        for i, layers in enumerate(plan.ranges):
            name = stage_folder(i, n)
            done = sum(wbytes)
            kept = _finished_stage(work / name, export_id, i, n, layers) if resumable else None
            if kept is not None:
                weight_bytes, num_nodes = kept.runtime.weight_bytes, len(_graph(kept.model_path).node)
                line = "kept from the interrupted run"
            else:
                res = export_onnx(model_or_dir, work / name, **{**options, "vision": vision and i == 0},
                                  weights=weights, layers=layers,
                                  progress=None if bytes_progress is None else
                                  lambda d, _, done=done: bytes_progress(done + d, planned))
                # the graphs are small to hash; the decoder's data shards were hashed while written (resumable);
                # the image graphs' data shards (a small part of stage 0) are hashed here when it is resumable
                images = [(g["model_file"], g["data_files"]) for g in res.runtime_config.get("graphs", [])]
                digests = {**res.data_sha256, res.model_path.name: file_sha256(res.model_path),
                           **{f: file_sha256(work / name / f) for m, data in images
                              for f in (m, *(data if resumable else []))}}
                StageFile(export_id, i, n, (layers.start, layers.stop), digests).write(work / name)
                weight_bytes, num_nodes, materialized = res.weight_bytes, res.num_nodes, res.weights_materialized
                line = f"{res.seconds:.1f} s"
            entries.append(StageEntry(name, (layers.start, layers.stop), weight_bytes))
            wbytes.append(weight_bytes)
            nodes.append(num_nodes)
            if bytes_progress is not None:
                bytes_progress(sum(wbytes), planned)
            if progress is not None:
                progress(f"stage {i + 1}/{n}: layers {layers.start}-{layers.stop - 1}, {num_nodes} nodes, {line}")
        if folder is not None:  # beside pipeline.json, as in a whole export: `generate PIPELINE` tokenizes with it
            from k3export.tokenizer import write_export_tokenizer

            write_export_tokenizer(folder, work, vocab_size=config.vocab_size)
        PipelineFile(export_id, entries).write(work)
        shutil.rmtree(work / RESUME_DIR, ignore_errors=True)
    return PipelineExportResult(Path(out_dir).expanduser().absolute(), export_id, plan, wbytes, nodes, materialized,
                                time.perf_counter() - t0)


def _graph_files(export: ExportFolder) -> list[str]:
    """The graph files of a stage folder: its decoder part, then its image graphs (stage 0 of an image model)."""
    return [export.runtime.model_file, *(g.model_file for g in export.runtime.graphs)]


def _graph(path: Path) -> Any:
    import onnx

    return onnx.load(str(path), load_external_data=False).graph


__all__ = ["Pipeline", "PipelineExportResult", "PipelineFile", "StageEntry", "StageFile", "export_pipeline",
           "is_pipeline", "load_pipeline", "stage_folder"]
