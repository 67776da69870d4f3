"""TensorRT runner (import-guarded: TensorRT is not installable on CPU-only machines).

A thin `Runner` over ``k3export.converters.tensorrt.TrtSession`` (the engine side: profiles, plugin
registration, feed checks), driven by the state manifest of the ONNX export the engine was built from.
"""

from __future__ import annotations

import os
from typing import Any
from pathlib import Path

import numpy as np

from .base import Runner, RuntimeUnavailable, StepOutput, Tensor
from .manifest import ManifestError, StateManifest


def tensorrt_status() -> str | None:
    """None when TensorRT and a CUDA device are usable here; otherwise why not."""
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return (f"TensorRT is not importable ({exc.__class__.__name__}: {exc}); it is not installable on "
                "CPU-only machines (PyPI ships only stub libs)")
    import torch

    if not torch.cuda.is_available():
        return "TensorRT needs a CUDA device"
    return None


def find_engine(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such engine file or folder")
    found = sorted([*p.glob("*.engine"), *p.glob("*.plan")])
    if len(found) != 1:
        raise ManifestError(f"{p}: expected one .engine/.plan file (found {[f.name for f in found]})")
    return found[0]


class TrtRunner(Runner):
    """A TensorRT engine driven by the same state manifest as the ONNX export it was built from."""

    name = "trt"

    def __init__(self, engine: str | os.PathLike[str], onnx_dir: str | os.PathLike[str] | None = None, *,
                 name: str | None = None) -> None:
        why = tensorrt_status()
        if why is not None:
            raise RuntimeUnavailable(f"trt runner: {why}")
        import torch

        from k3export.converters.tensorrt import TrtSession

        self._torch = torch
        self.engine_path = find_engine(engine)
        manifest_dir = Path(onnx_dir) if onnx_dir is not None else self.engine_path.parent
        self.manifest = StateManifest.load(manifest_dir)
        self.session = TrtSession(self.engine_path, onnx_dir)
        missing = [s.name for s in self.manifest.states if s.name not in self.session.input_names]
        if missing:
            raise ManifestError(f"{self.engine_path}: engine lacks state inputs {missing[:4]}")
        if name:
            self.name = name

    def initial_state(self, batch: int) -> dict[str, Tensor]:
        torch = self._torch
        dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        return {s.name: torch.zeros(s.concrete_shape(batch, 0), dtype=dt[s.dtype], device="cuda")
                for s in self.manifest.states}

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor]) -> StepOutput:
        torch = self._torch
        B, T = input_ids.shape
        feeds: dict[str, Any] = {self.manifest.input_ids: torch.as_tensor(input_ids, device="cuda")}
        past = 0
        for s in self.manifest.states:
            v = state[s.name]
            feeds[s.name] = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v), device="cuda")
            if s.kind == "latent":
                past = int(feeds[s.name].shape[1])
        if "attention_mask" in self.session.input_names:
            feeds["attention_mask"] = torch.ones(B, past + T, dtype=torch.int64, device="cuda")
        out = self.session.run(feeds)
        hidden_names = sorted((n for n in out if n.startswith("hidden_states.")), key=lambda n: int(n.split(".")[1]))
        return StepOutput(logits=out[self.manifest.logits],
                          state={s.name: out[s.present] for s in self.manifest.states},
                          hidden=[out[n] for n in hidden_names] or None)

    def describe(self) -> str:
        return f"{self.name} (TensorRT, {self.engine_path.name})"
