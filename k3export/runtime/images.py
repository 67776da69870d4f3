"""`ImageGraphs`: an image + text export's ``vision.onnx`` and ``embedding.onnx``, run by any session runtime.

Every runner of exported graphs (`session.SessionRunner`: ONNX Runtime, OpenVINO, the ONNX reference evaluator,
TensorRT; the pipeline runners' stage 0) computes its decoder's ``inputs_embeds`` here, with the sessions its runtime
opens (a `GraphOpener`): the prefill runs ``vision.onnx`` on the prompt's packed images (`loop.Images`) and splices the
features over the placeholder tokens in ``embedding.onnx``; a decode step feeds the embedding graph no features.

The vision graph is standard ONNX (no functions, no ``If``), so every session runtime that reads the standard form
runs it as written; `stages` runs it with every stage's output exposed (validation's localisation of a divergence).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from k3export.errors import K3ExportError
from k3export.modeling.contract import (EMBEDDING_ROLE, IMAGE_FEATURES, INPUT_IDS, INPUTS_EMBEDS, VISION_ROLE,
                                       vision_feeds)


#: what a runner's `describe` adds for an export's image graphs
IMAGE_GRAPHS_NOTE = " + vision.onnx, embedding.onnx"


def check_placeholders(input_ids: Any, placeholder_id: int, image_tokens: int) -> None:
    """Refuse a prompt whose placeholder tokens do not number the images' tokens: an embedding graph (or genai)
    would keep or drop features silently."""
    have = int((np.asarray(input_ids) == placeholder_id).sum())
    if have != image_tokens:
        raise K3ExportError(f"the prompt has {have} image placeholder tokens (id {placeholder_id}) but the images give "
                            f"{image_tokens} tokens; expand each image's placeholder with the processor")


def with_weights(model: Any, path: str | os.PathLike[str]) -> Any:
    """A copy of `model` (`path`'s graph edited in memory, loaded without its external data) with that data read
    from beside `path`: for runtimes that take a graph from memory but cannot resolve its external data there."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    out = onnx.ModelProto()
    out.CopyFrom(model)  # the caller's proto stays light
    load_external_data_for_model(out, str(Path(path).parent))
    return out


class GraphOpener(Protocol):
    """A runtime's session of a graph file (`session.Session`); `model`: that file's graph edited in memory (its
    external data still relative to `path`'s folder), run instead of the file's own."""

    def __call__(self, path: Path, *, model: Any = None) -> Any: ...


class ImageGraphs:
    """`export`'s image graphs (it must hold them: ``export.has_vision``), each a session of `open_graph`."""

    def __init__(self, export: Any, open_graph: GraphOpener) -> None:
        self.export, self._open = export, open_graph
        self.vision = open_graph(export.graph_paths[VISION_ROLE])
        self.embedding = open_graph(export.graph_paths[EMBEDDING_ROLE])
        features = next(t for t in export.manifest.graph(VISION_ROLE).outputs if t.name == IMAGE_FEATURES)
        self._no_features = np.zeros((0, int(features.shape[-1])), np.float32)  # a decode step: no image tokens
        self._staged: tuple[Any, dict[str, str]] | None = None

    def features(self, images: Any) -> np.ndarray:
        """``vision.onnx`` on one prompt's packed images (`loop.Images`), the feeds checked as the PyTorch tower
        checks them (the graph cannot refuse a bad grid with a message): [image tokens, hidden]."""
        return np.asarray(self.vision.run(self.feeds(images))[IMAGE_FEATURES])

    def feeds(self, images: Any) -> dict[str, np.ndarray]:
        """The vision graph's feeds of `images`, checked against the runtime config's ``vision_config`` (a dict:
        no `K3VisionConfig`, so transformers stays out of the process)."""
        return vision_feeds(self.export.runtime.vision_config, images.pixel_values, images.grid_thws)

    def embed(self, input_ids: np.ndarray, images: Any = None) -> np.ndarray:
        """``inputs_embeds`` of `input_ids` [B, T] with `images`' features over the placeholder tokens (none given:
        a decode step); a prompt whose placeholder count differs from the images' tokens is refused
        (`check_placeholders`)."""
        features = self._no_features
        if images is not None:
            features = self.features(images)
            check_placeholders(input_ids, self.export.runtime.media_placeholder_token_id, features.shape[0])
        feeds = {INPUT_IDS: np.asarray(input_ids, np.int64), IMAGE_FEATURES: features}
        return self.embedding.run(feeds)[INPUTS_EMBEDS]

    def stages(self, images: Any, expose: Any) -> dict[str, np.ndarray]:
        """Every vision stage's output on one prompt's images, by stage: the export's own ``vision.onnx`` with its
        stage values added as outputs in memory by ``expose(model, vision_config, path) -> (model, {stage: output
        name})`` (validation passes the exporter's `with_stage_outputs`; a runtime never edits a graph itself),
        opened on the first call (a passing validation never pays for it)."""
        import onnx

        if self._staged is None:
            path = self.export.graph_paths[VISION_ROLE]
            model, stages = expose(onnx.load(str(path), load_external_data=False), self.export.vision_config, path)
            self._staged = (self._open(path, model=model), stages)
        session, stages = self._staged
        out = session.run(self.feeds(images))
        return {stage: np.asarray(out[name]) for stage, name in stages.items()}


__all__ = ["GraphOpener", "IMAGE_GRAPHS_NOTE", "ImageGraphs", "check_placeholders", "with_weights"]
