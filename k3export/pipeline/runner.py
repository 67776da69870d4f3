# Copyright 2026 the k3export authors. Apache-2.0.
"""The in-process pipeline runner: a pipeline export's stages chained in one process, one session per stage.

`PipelineRunner` is a `Runner` like any other (``prefill`` / ``step`` / ``forward(ids, state, mask)``, state by
the full model's manifest names), so the decode loop, ``validate`` and ``run`` drive it unchanged::

    runner = PipelineRunner("out/")                      # ONNX Runtime on CPU; runtime="ort-cuda" or "trt"
    result = greedy_decode(runner, ids, steps=8, attention_mask=mask)

A pipeline of an image + text model (stage 0 holds ``vision.onnx`` and ``embedding.onnx``, its decoder part on
``inputs_embeds``) takes images as `OrtRunner` does: ``takes_images``, ``forward(..., images=Images)`` at the prefill
(`k3export.runtime.loop.with_images`, ``greedy_decode(..., images=)``); the image graphs run under ONNX Runtime in
this process (on CUDA for a GPU stage runtime), and every call feeds stage 0 the embedding graph's ``inputs_embeds``.

`run_stage` is the one execution path of a stage (this runner and every Ray actor use it): it feeds the stage's
manifest inputs (``input_ids`` or the ``stage_in.*`` boundary tensors, ``attention_mask``, its layers' states)
and returns what the next stage takes (``stage_out.*`` renamed ``stage_in.*``, or ``logits``) and its new states.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from k3export.artifacts import ExportFolder, StateManifest
from k3export.errors import K3ExportError
from k3export.modeling.contract import ATTENTION_MASK, INPUT_IDS, INPUTS_EMBEDS, LOGITS, STAGE_INPUT, STAGE_OUTPUT
from k3export.runtime.base import Runner, StepOutput, Tensor
from k3export.runtime.images import ImageGraphs
from k3export.runtime.session import keep_feed

from .export import Pipeline, load_pipeline
from .plan import PipelineError

_OUT, _IN = STAGE_OUTPUT.format(kind=""), STAGE_INPUT.format(kind="")
RUNTIMES = ("ort", "ort-cuda", "trt")


def make_session(export: ExportFolder, runtime: str = "ort", threads: int | None = None) -> Any:
    """The session of one stage: ONNX Runtime (CPU or CUDA EP) on its ``model.onnx``, or TensorRT on the one
    engine in its folder (``k3export build PIPELINE_DIR`` writes each, `engines.STAGE_ENGINE`)."""
    if runtime not in RUNTIMES:
        raise PipelineError(f"unknown stage runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if runtime == "trt":
        from k3export.runtime.trt_runner import TrtSession, find_engine

        return TrtSession(find_engine(export.root), export)
    from k3export.runtime.ort_session import CUDA_PROVIDERS, OrtSession

    export.require_weights()
    providers = CUDA_PROVIDERS if runtime == "ort-cuda" else None
    return OrtSession(export.model_path, providers, threads, export.runtime.session_options)


def image_graphs(export: ExportFolder, runtime: str = "ort", threads: int | None = None) -> ImageGraphs:
    """Stage 0's image graphs under ONNX Runtime (on the CUDA provider for a GPU stage runtime)."""
    from k3export.runtime.ort_session import CUDA_PROVIDERS, ort_graph_opener

    export.require_weights()
    providers = CUDA_PROVIDERS if runtime in ("ort-cuda", "trt") else None
    return ImageGraphs(export, ort_graph_opener(providers, threads, export.runtime.session_options))


def run_stage(manifest: StateManifest, session: Any, x: dict[str, Tensor], attention_mask: Any,
              state: dict[str, Tensor], logits_to_keep: int = 0) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One call of one stage: (what the next stage takes, or ``logits`` (the last `logits_to_keep` positions when
    > 0 and the last stage's graph takes it) and debug outputs; the new states)."""
    feeds: dict[str, Any] = {}
    for t in manifest.inputs:
        if t.name == ATTENTION_MASK:
            feeds[t.name] = attention_mask
        elif t.name in x:
            feeds[t.name] = x[t.name]
        else:
            raise PipelineError(f"stage of layers {list(manifest.layers)} needs input {t.name!r}, which the stage "
                                f"before it does not give (given: {sorted(x)})")
    for s in manifest.states:
        feeds[s.name] = state[s.name]
    out = session.run({**feeds, **keep_feed(session, logits_to_keep)})
    passed = {(_IN + t.name[len(_OUT):] if t.name.startswith(_OUT) else t.name): out[t.name] for t in manifest.outputs}
    return passed, {s.name: out[s.present] for s in manifest.states}


def full_manifest(pipeline: Pipeline) -> StateManifest:
    """The manifest of the whole model the pipeline computes (every state, ids in, logits out)."""
    first, last = pipeline.stages[0].manifest, pipeline.stages[-1].manifest
    return StateManifest.from_config(pipeline.config, pipeline.dtype,
                                     attention_mask=ATTENTION_MASK in first.input_names,
                                     debug_outputs=bool(last.hidden_outputs), state_window=first.state_window)


def pipeline_identity(pipeline: Pipeline) -> str:
    """What a pipeline's runners compute with: sha256 of its stages' identities, in order
    (`ExportFolder.identity`); a saved state records it."""
    import hashlib

    return hashlib.sha256(" ".join(e.identity() for e in pipeline.stages).encode()).hexdigest()


def as_pipeline(pipeline: Pipeline | str | os.PathLike[str]) -> Pipeline:
    return pipeline if isinstance(pipeline, Pipeline) else load_pipeline(pipeline)


class PipelineRunner(Runner):
    """A pipeline export's stages chained in this process (see the module docstring)."""

    name = "pipeline"

    def __init__(self, pipeline: Pipeline | str | os.PathLike[str], *, runtime: str = "ort",
                 threads: int | None = None, name: str | None = None) -> None:
        self.pipeline = as_pipeline(pipeline)
        self.runtime = runtime
        self.config = self.pipeline.config
        self.manifest = full_manifest(self.pipeline)
        self.sessions = [make_session(e, runtime, threads) for e in self.pipeline.stages]
        #: stage 0's image graphs (None for a text-only pipeline)
        self.images = image_graphs(self.pipeline.stages[0], runtime, threads) if self.pipeline.has_vision else None
        if name:
            self.name = name

    def identity(self) -> str:
        return pipeline_identity(self.pipeline)

    @property
    def takes_images(self) -> bool:
        """Whether `forward` takes ``images`` (stage 0 holds the image graphs)."""
        return self.images is not None

    def vision_stages(self, images: Any, expose: Any) -> dict[str, np.ndarray]:
        """Every vision stage's output of stage 0's ``vision.onnx`` on one prompt's images (validation's
        localisation, `images.ImageGraphs.stages`)."""
        if self.images is None:
            raise K3ExportError(f"{self.pipeline.root}: a text-only pipeline has no vision stages")
        return self.images.stages(images, expose)

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray,
                images: Any = None) -> StepOutput:
        if self.images is not None:
            x: dict[str, Tensor] = {INPUTS_EMBEDS: self.images.embed(input_ids, images)}
        elif images is not None:
            raise K3ExportError(f"{self.pipeline.root}: a text-only pipeline cannot take images")
        else:
            x = {INPUT_IDS: input_ids}
        new_state: dict[str, Tensor] = {}
        window: dict[str, Tensor] = {}
        hidden: list[Tensor] = []
        for export, session in zip(self.pipeline.stages, self.sessions):
            x, st = run_stage(export.manifest, session, x, attention_mask, state, self.logits_to_keep)
            new_state.update(st)
            window.update({n: x.pop(w) for n, w in export.manifest.window_outputs().items()})
            hidden += [x.pop(n) for n in export.manifest.hidden_outputs]
        return StepOutput(logits=x[LOGITS], state=new_state, hidden=hidden or None, window=window or None)

    def describe(self) -> str:
        images = ", vision.onnx + embedding.onnx with stage 0" if self.takes_images else ""
        return (f"{self.name} ({len(self.sessions)} stages in-process, {self.runtime}, "
                f"{self.pipeline.root.name}{images})")


# ---------------------------------------------------------------------------------------------- runtime registry
def pipeline_factory(target: Any) -> Runner:
    """``--runtimes ...,pipeline``: the stages chained in-process (ONNX Runtime, CPU)."""
    path = getattr(target, "pipeline_dir", None) or target.need("onnx_dir", "pipeline", "--onnx PIPELINE_DIR")
    return PipelineRunner(path)


__all__ = ["PipelineRunner", "RUNTIMES", "as_pipeline", "full_manifest", "image_graphs", "make_session",
           "pipeline_factory", "run_stage"]
