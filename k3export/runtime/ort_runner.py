"""ONNX Runtime runner: ``model.onnx`` + ``state_manifest.json`` from an export folder.

Feeds: the manifest's ``input_ids`` name, every state input by name, and (when the graph asks) an
``attention_mask`` of ones over past + new tokens and ``position_ids``. Fetches: logits, every
``present.*`` output (mapped back to the state input names) and, when the export exposes them, the
per-layer debug outputs ``hidden_states.{i}`` used to localise a divergence.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from k3export.files import read_json

from .base import Runner, RuntimeUnavailable, StepOutput, Tensor, to_numpy
from .manifest import RUNTIME_CONFIG_FILE, ManifestError, StateManifest

_ORT_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
           "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def find_onnx_model(onnx_dir: str | os.PathLike[str]) -> Path:
    """The ``.onnx`` file of an export folder (``model.onnx``, else the only ``*.onnx``)."""
    p = Path(onnx_dir)
    if p.is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such ONNX export folder")
    if (p / "model.onnx").is_file():
        return p / "model.onnx"
    found = sorted(p.glob("*.onnx"))
    if len(found) != 1:
        raise ManifestError(f"{p}: expected model.onnx (found {[f.name for f in found]})")
    return found[0]


def read_runtime_config(export_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(export_dir) / RUNTIME_CONFIG_FILE
    if not path.is_file():
        return {}
    return read_json(path, ManifestError)


def np_dtype_for(ort_type: str) -> Any:
    if ort_type in _ORT_NP:
        return _ORT_NP[ort_type]
    if ort_type == "tensor(bfloat16)":
        try:
            import ml_dtypes
        except ImportError as exc:  # pragma: no cover
            raise RuntimeUnavailable("a bfloat16 ONNX input needs the ml_dtypes package") from exc
        return ml_dtypes.bfloat16
    raise ManifestError(f"unsupported ONNX input type {ort_type}")


class OrtRunner(Runner):
    """onnxruntime InferenceSession (CUDA EP when available and asked for, else CPU EP)."""

    name = "ort"

    def __init__(self, export_dir: str | os.PathLike[str], *, providers: list[str] | None = None,
                 name: str | None = None, manifest: StateManifest | None = None, threads: int | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:  # pragma: no cover
            raise RuntimeUnavailable(f"onnxruntime is not importable: {exc}") from exc
        self.model_path = find_onnx_model(export_dir)
        folder = self.model_path.parent
        self.manifest = manifest or StateManifest.load(folder)
        self.runtime_config = read_runtime_config(folder)
        available = ort.get_available_providers()
        if providers is None:
            providers = ["CPUExecutionProvider"]
        missing = [p for p in providers if p not in available]
        if missing:
            raise RuntimeUnavailable(f"onnxruntime lacks {missing} (available: {available})")
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(self.model_path), sess_options=opts, providers=providers)
        self.providers = self.session.get_providers()
        if name:
            self.name = name
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._check_io()
        out_set = set(self._outputs)
        self._hidden_names = sorted((n for n in out_set if n.startswith("hidden_states.")),
                                    key=lambda n: int(n.rsplit(".", 1)[1]))

    def _check_io(self) -> None:
        m = self.manifest
        if m.input_ids not in self._inputs:
            raise ManifestError(f"{self.model_path}: graph has no input {m.input_ids!r} (inputs: {list(self._inputs)})")
        if m.logits not in self._outputs:
            raise ManifestError(f"{self.model_path}: graph has no output {m.logits!r}")
        for s in m.states:
            if s.name not in self._inputs:
                raise ManifestError(f"{self.model_path}: manifest state {s.name!r} is not a graph input")
            if s.present not in self._outputs:
                raise ManifestError(f"{self.model_path}: manifest output {s.present!r} is not a graph output")
        known = {m.input_ids, "attention_mask", "position_ids", *m.names()}
        unknown = [n for n in self._inputs if n not in known]
        if unknown:
            raise ManifestError(f"{self.model_path}: graph inputs {unknown} are neither ids, mask nor manifest states")

    def _past_length(self, state: dict[str, Tensor]) -> int:
        for s in self.manifest.states:
            if s.kind == "latent":
                return int(np.shape(state[s.name])[1])
        return 0  # KDA-only: no growing state, the mask then covers the new tokens only

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor]) -> StepOutput:
        B, T = input_ids.shape
        feeds: dict[str, Any] = {}
        for name, meta in self._inputs.items():
            dt = np_dtype_for(meta.type)
            if name == self.manifest.input_ids:
                feeds[name] = input_ids.astype(dt)
            elif name in state:
                v = state[name]
                feeds[name] = np.ascontiguousarray(to_numpy(v, np.float32).astype(dt) if hasattr(v, "detach")
                                                   else np.asarray(v).astype(dt, copy=False))
        past = self._past_length(state)
        if "attention_mask" in self._inputs:
            feeds["attention_mask"] = np.ones((B, past + T), dtype=np_dtype_for(self._inputs["attention_mask"].type))
        if "position_ids" in self._inputs:
            pos = np.arange(past, past + T, dtype=np.int64)[None].repeat(B, 0)
            feeds["position_ids"] = pos.astype(np_dtype_for(self._inputs["position_ids"].type))
        results = dict(zip(self._outputs, self.session.run(self._outputs, feeds)))
        new_state = {s.name: results[s.present] for s in self.manifest.states}
        hidden = [results[n] for n in self._hidden_names] if self._hidden_names else None
        return StepOutput(logits=results[self.manifest.logits], state=new_state, hidden=hidden)

    def describe(self) -> str:
        return f"{self.name} (onnxruntime {self.providers[0]}, {self.model_path.name})"
