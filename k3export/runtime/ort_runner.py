"""ONNX Runtime runner: an export folder (checked by `load_export` first) run by an ``InferenceSession``.

An image + text export (``runtime_config.json`` ``graphs``) runs three sessions: ``vision.onnx`` (packed patches ->
image features, at the prefill only), ``embedding.onnx`` (token ids + image features -> ``inputs_embeds``; a decode
step feeds no image features) and the decoder on those embeddings. `Runner.forward` takes the prefill's images as
the keyword ``images`` (`k3export.runtime.loop.Images`, handed over by `loop.with_images`). `OrtRunner.vision_stages`
runs the same ``vision.onnx`` with every stage's output exposed (validation's localisation of a vision divergence).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from k3export.artifacts import load_export
from k3export.errors import K3ExportError
from k3export.modeling.contract import EMBEDDING_ROLE, IMAGE_FEATURES, INPUT_IDS, INPUTS_EMBEDS, VISION_ROLE

from .ort_session import OrtSession
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
        self.ort = OrtSession(self.graph_path, providers, threads, export.runtime.session_options)
        super().__init__(export, self.ort, name=name, where=str(self.graph_path))
        #: the image graphs' sessions (None for a text-only export)
        self.vision: OrtSession | None = None
        self.embedding: OrtSession | None = None
        self._session_args = (providers, threads, export.runtime.session_options)
        self._stage_session: Any = None
        if export.has_vision:
            options = export.runtime.session_options
            self.vision = OrtSession(export.graph_paths[VISION_ROLE], providers, threads, options)
            self.embedding = OrtSession(export.graph_paths[EMBEDDING_ROLE], providers, threads, options)
            features = next(t for t in self.manifest.graph(VISION_ROLE).outputs if t.name == IMAGE_FEATURES)
            self._no_features = np.zeros((0, int(features.shape[-1])), np.float32)

    @property
    def takes_images(self) -> bool:
        """Whether `forward` takes ``images`` (the export holds the image graphs)."""
        return self.embedding is not None

    def image_features(self, images: Any) -> np.ndarray:
        """``vision.onnx`` on one prompt's packed images (`loop.Images`), the feeds checked as the PyTorch tower
        checks them: [image tokens, hidden]."""
        from k3export.converters.onnx.vision import vision_feeds

        if self.vision is None:
            raise K3ExportError(f"{self.export.root}: a text-only export cannot take images")
        feeds = vision_feeds(self.export.vision_config, images.pixel_values, images.grid_thws)
        return self.vision.run(feeds)[IMAGE_FEATURES]

    def vision_stages(self, images: Any) -> dict[str, np.ndarray]:
        """Every vision stage's output on one prompt's images, by stage (`converters.onnx.vision.vision_stages`):
        the export's own ``vision.onnx`` with its stage values added as outputs in memory
        (`vision.with_stage_outputs`), opened once, on the first call (a passing validation never pays for it)."""
        import onnx
        import onnxruntime as ort

        from k3export.converters.onnx.vision import vision_feeds, with_stage_outputs
        from k3export.dtypes import dtype as as_dtype

        from .ort_session import ort_session

        if self.vision is None:
            raise K3ExportError(f"{self.export.root}: a text-only export has no vision stages")
        if self._stage_session is None:
            path = self.export.graph_paths[VISION_ROLE]
            model, stages = with_stage_outputs(onnx.load(str(path), load_external_data=False),
                                               self.export.vision_config, path)
            providers, threads, options = self._session_args
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            for key, value in (options or {}).items():  # checked when the runner opened vision.onnx
                setattr(opts, key, value)
            if threads:
                opts.intra_op_num_threads = threads
            session = ort_session(path, opts, providers or self.vision.providers, model=model)
            self._stage_session = (session, stages)
        session, stages = self._stage_session
        feeds = vision_feeds(self.export.vision_config, images.pixel_values, images.grid_thws)
        types = {i.name: as_dtype(i.type).numpy for i in session.get_inputs()}
        names = list(stages.values())
        values = session.run(names, {k: v.astype(types[k], copy=False) for k, v in feeds.items()})
        by_name = dict(zip(names, values))
        return {stage: by_name[out] for stage, out in stages.items()}

    def inputs_embeds(self, input_ids: np.ndarray, images: Any = None) -> np.ndarray:
        """``embedding.onnx``: the token embeddings of `input_ids` [B, T] with `images`' features over the
        placeholder tokens (none given: a decode step, every token its own embedding)."""
        features = self._no_features if images is None else self.image_features(images)
        if images is not None:  # the graph cannot refuse a mismatch: it would keep or drop features silently
            pid = self.export.runtime.media_placeholder_token_id
            have = int((np.asarray(input_ids) == pid).sum())
            if have != features.shape[0]:
                raise K3ExportError(f"the prompt has {have} image placeholder tokens (id {pid}) but the images give "
                                    f"{features.shape[0]} tokens; expand each image's placeholder with the processor")
        return self.embedding.run({INPUT_IDS: input_ids, IMAGE_FEATURES: features})[INPUTS_EMBEDS]

    def describe(self) -> str:
        images = " + vision.onnx, embedding.onnx" if self.takes_images else ""
        return f"{self.name} (onnxruntime {self.ort.providers[0]}, {self.graph_path.name}{images})"


__all__ = ["OrtRunner", "OrtSession"]
