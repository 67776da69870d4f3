"""ONNX Runtime runner: an export folder (checked by `load_export` first) run by an ``InferenceSession``.

An image + text export (``runtime_config.json`` ``graphs``) runs three sessions: ``vision.onnx`` (packed patches ->
image features, at the prefill only), ``embedding.onnx`` (token ids + image features -> ``inputs_embeds``; a decode
step feeds no image features) and the decoder on those embeddings (`images.ImageGraphs`, as every session runtime).
"""

from __future__ import annotations

import os
from pathlib import Path

from k3export.artifacts import load_export

from .ort_session import OrtSession, ort_graph_opener
from .session import SessionRunner


class OrtRunner(SessionRunner):
    """An export folder under ONNX Runtime (CPU EP by default): the export's checked ORT form when it holds one
    (``export --genai`` of MXFP4 experts: no 8-bit copy of the experts is written per session), else its
    ``model.onnx``. `model_path` runs another graph with the same I/O instead (e.g. `lowp.emulate_low_precision`
    of a bf16 export). An export with image graphs also opens ``vision.onnx`` and ``embedding.onnx``
    (`takes_images`)."""

    name = "ort"

    def __init__(self, export_dir: str | os.PathLike[str], *, providers: list[str] | None = None,
                 name: str | None = None, threads: int | None = None,
                 model_path: str | os.PathLike[str] | None = None) -> None:
        from k3export.converters.onnx.forms import check_export

        export = load_export(export_dir)
        export.require_weights()
        if model_path is None:
            check_export(name or self.name, export)
        #: the graph file the session runs
        self.graph_path = Path(model_path) if model_path is not None else export.ort_form_path or export.model_path
        options = export.runtime.session_options
        self.ort = OrtSession(self.graph_path, providers, threads, options)
        super().__init__(export, self.ort, name=name, where=str(self.graph_path),
                         open_graph=ort_graph_opener(providers, threads, options))

    def describe(self) -> str:
        return f"{self.name} (onnxruntime {self.ort.providers[0]}, {self.graph_path.name}{self.image_note})"


__all__ = ["OrtRunner", "OrtSession"]
