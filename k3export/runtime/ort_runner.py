"""ONNX Runtime runner: an export folder (checked by `load_export` first) run by an ``InferenceSession``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from k3export.artifacts import load_export
from k3export.dtypes import dtype as as_dtype

from .base import RuntimeUnavailable, to_numpy
from .session import SessionRunner


class OrtSession:
    """An ``onnxruntime.InferenceSession`` behind the session interface: feeds cast to the graph's input dtypes
    (bfloat16 via ml_dtypes), outputs as numpy; `options` set on its ``SessionOptions`` (an export's
    ``runtime_config.json`` recommends them). A graph with MXFP4 experts runs them in ORT's lossless 8-bit form,
    rewritten when the session is built (`k3export.converters.onnx.mxfp4.ort_session`); a graph already in that
    form (an export's persisted ``model.genai.onnx``) is opened as the file it is."""

    def __init__(self, model_path: str | os.PathLike[str], providers: list[str] | None = None,
                 threads: int | None = None, options: dict[str, Any] | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:  # pragma: no cover
            raise RuntimeUnavailable(f"onnxruntime is not importable: {exc}") from exc
        available = ort.get_available_providers()
        providers = providers or ["CPUExecutionProvider"]
        missing = [p for p in providers if p not in available]
        if missing:
            raise RuntimeUnavailable(f"onnxruntime lacks {missing} (available: {available})")
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        for key, value in (options or {}).items():  # what the export recommends (`RuntimeConfig.session_options`)
            if not hasattr(opts, key):
                raise RuntimeUnavailable(f"onnxruntime {ort.__version__} SessionOptions has no {key!r} (asked for by "
                                         "the export's runtime_config.json session_options)")
            setattr(opts, key, value)
        if threads:
            opts.intra_op_num_threads = threads
        from k3export.converters.onnx.mxfp4 import ort_session  # MXFP4 experts: the 9-bit form; others as they are

        self.session = ort_session(model_path, opts, providers)
        self.providers = self.session.get_providers()
        self._types = {i.name: as_dtype(i.type).numpy for i in self.session.get_inputs()}
        self.input_names = list(self._types)
        optional = self.session.get_overridable_initializers()  # inputs with a default (``logits_to_keep``)
        self.optional_inputs = [i.name for i in optional]
        self._types.update({i.name: as_dtype(i.type).numpy for i in optional})
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        cast = {}
        for name, value in feeds.items():
            dt = self._types[name]
            arr = to_numpy(value, np.float32) if hasattr(value, "detach") else np.asarray(value)
            cast[name] = np.require(arr.astype(dt, copy=False), requirements="C")  # keeps a scalar 0-d
        return dict(zip(self.output_names, self.session.run(self.output_names, cast)))


class OrtRunner(SessionRunner):
    """An export folder under ONNX Runtime (CPU EP by default): the export's checked ORT form when it holds one
    (``export --genai`` of MXFP4 experts: no 8-bit copy of the experts is written per session), else its
    ``model.onnx``. `model_path` runs another graph with the same I/O instead (e.g. `lowp.emulate_low_precision`
    of a bf16 export)."""

    name = "ort"

    def __init__(self, export_dir: str | os.PathLike[str], *, providers: list[str] | None = None,
                 name: str | None = None, threads: int | None = None,
                 model_path: str | os.PathLike[str] | None = None) -> None:
        export = load_export(export_dir)
        export.require_weights()
        #: the graph file the session runs
        self.graph_path = Path(model_path) if model_path is not None else export.ort_form_path or export.model_path
        self.ort = OrtSession(self.graph_path, providers, threads, export.runtime.session_options)
        super().__init__(export, self.ort, name=name, where=str(self.graph_path))

    def describe(self) -> str:
        return f"{self.name} (onnxruntime {self.ort.providers[0]}, {self.graph_path.name})"


__all__ = ["OrtRunner", "OrtSession"]
