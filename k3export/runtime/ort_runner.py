"""ONNX Runtime runner: an export folder (checked by `load_export` first) run by an ``InferenceSession``.

An image + text export (``runtime_config.json`` ``graphs``) runs three sessions: ``vision.onnx`` (packed patches ->
image features, at the prefill only), ``embedding.onnx`` (token ids + image features -> ``inputs_embeds``; a decode
step feeds no image features) and the decoder on those embeddings (`images.ImageGraphs`, as every session runtime).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from k3export.artifacts import load_export
from k3export.modeling.contract import BATCH, LOGITS, LOGITS_TO_KEEP, PAST, SEQ, TOTAL

from . import ort_ops
from .base import StepOutput, Tensor
from .ort_session import OrtSession, ort_graph_opener
from .session import SessionRunner


class OrtRunner(SessionRunner):
    """An export folder under ONNX Runtime (CPU EP by default): the export's checked ORT form when it holds one
    (``export --genai`` of MXFP4 experts: no 8-bit copy of the experts is written per session) and the k3 custom-op
    library, which reads the 4-bit experts themselves, is not in use, else its ``model.onnx``. `model_path` runs
    another graph with the same I/O instead (e.g. `lowp.emulate_low_precision` of a bf16 export). An export with
    image graphs also opens ``vision.onnx`` and ``embedding.onnx`` (`takes_images`).

    `bind` (default): each call runs through ONNX Runtime's IO binding (`OrtSession.run_bound`): the fed state is
    read where it lies and the logits and every ``present`` are written into preallocated buffers, so a decode
    step moves no state through copies; False runs ``InferenceSession.run`` on numpy feeds.

    `kernels`: run the k3 nodes with k3export's custom-op library (True, where it builds and takes the graph:
    `ort_ops.used`) or with their function bodies (False); None: ``K3EXPORT_ORT_OPS`` decides (`k3export.switches`,
    on by default)."""

    name = "ort"

    def __init__(self, export_dir: str | os.PathLike[str], *, providers: list[str] | None = None,
                 name: str | None = None, threads: int | None = None,
                 model_path: str | os.PathLike[str] | None = None, bind: bool = True,
                 kernels: bool | None = None) -> None:
        from k3export.artifacts.graph_forms import check_export

        export = load_export(export_dir)
        export.require_weights()
        if model_path is None:
            check_export(name or self.name, export)
        #: the graph file the session runs
        self.graph_path = Path(model_path) if model_path is not None else export.ort_form_path or export.model_path
        if model_path is None and export.ort_form_path is not None and ort_ops.used(export.graph, providers, kernels):
            self.graph_path = export.model_path  # the k3 library reads its 4-bit experts: no 9-bit form needed
        options = export.runtime.session_options
        # model.onnx was parsed once, by `load_export`: the session takes that graph
        graph = export.graph if self.graph_path == export.model_path else None
        self.ort = OrtSession(self.graph_path, providers, threads, options, k3_ops=kernels, graph=graph)
        super().__init__(export, self.ort, name=name, where=str(self.graph_path),
                         open_graph=ort_graph_opener(providers, threads, options, kernels))

        self.bind = bind and "CPUExecutionProvider" == self.ort.providers[0]
        #: the fixed dims of the logits (vocab) as the manifest declares them
        self._logits_shape = next(t.shape for t in self.manifest.outputs if t.name == LOGITS)

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray,
                images: Any = None) -> StepOutput:
        feeds = self.feeds(input_ids, state, attention_mask, images)
        if not self.bind:
            return self.step_output(self.ort.run(feeds))
        batch, new = input_ids.shape
        sizes = {BATCH: batch, SEQ: new, PAST: attention_mask.shape[1] - new, TOTAL: attention_mask.shape[1]}
        shapes = {s.present: tuple(sizes[d] if isinstance(d, str) else d for d in s.present_shape)
                  for s in self.manifest.states}
        rows = min(int(feeds[LOGITS_TO_KEEP]), new) if LOGITS_TO_KEEP in feeds else new
        shapes[LOGITS] = tuple({**sizes, SEQ: rows}.get(d, d) if isinstance(d, str) else d for d in self._logits_shape)
        return self.step_output(self.ort.run_bound(feeds, shapes))

    def describe(self) -> str:
        ops = ", k3 ops library" if self.ort.k3_ops else ""
        return f"{self.name} (onnxruntime {self.ort.providers[0]}{ops}, {self.graph_path.name}{self.image_note})"


__all__ = ["OrtRunner", "OrtSession"]
