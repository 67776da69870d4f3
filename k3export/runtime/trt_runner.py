"""TensorRT runner (import-guarded: TensorRT is not installable on CPU-only machines).

Contract for the engine side (``k3export.converters.tensorrt``): expose

    load_engine(engine_path: str | Path, manifest: StateManifest) -> EngineSession

where an ``EngineSession`` (see the `EngineSession` protocol below) has

    input_names: list[str]        # input_ids, [attention_mask], every manifest state name
    output_names: list[str]       # logits, every manifest present name, optional hidden_states.{i}
    run(feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]
        feeds are CUDA tensors (input_ids int64 [B, T]; states in the manifest dtype, recurrent fp32);
        it sets the optimisation-profile shapes from the feeds, runs, and returns CUDA tensors by name.

The engine folder holds ``state_manifest.json`` (copied from the ONNX export) beside the ``.engine`` /
``.plan`` file. When ``load_engine`` does not exist yet, `TensorRTSession` below (plain TensorRT Python API,
``execute_async_v3`` with torch-allocated buffers) is used; it imports ``k3export.plugins`` first so that
the k3 plugins are registered before the engine is deserialised.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .base import Runner, RuntimeUnavailable, StepOutput, Tensor
from .manifest import ManifestError, StateManifest


class EngineSession(Protocol):
    input_names: list[str]
    output_names: list[str]

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]: ...


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


class TensorRTSession:
    """Minimal `EngineSession` over the TensorRT Python API (TensorRT >= 10: named tensors, execute_async_v3)."""

    def __init__(self, engine_path: Path) -> None:
        import tensorrt as trt
        import torch

        try:
            import k3export.plugins  # noqa: F401  registers the k3 plugins (tensorrt.plugin) when present
        except ImportError:
            pass
        self._torch = torch
        self._trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        trt.init_libnvinfer_plugins(self.logger, "")
        runtime = trt.Runtime(self.logger)
        self.engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise RuntimeUnavailable(f"{engine_path}: TensorRT could not deserialise the engine")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.output_names = [n for n in names if self.engine.get_tensor_mode(n) != mode]

    def _torch_dtype(self, name: str):
        trt, torch = self._trt, self._torch
        table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                 trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}
        return table[self.engine.get_tensor_dtype(name)]

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        torch = self._torch
        stream = torch.cuda.current_stream()
        keep = []
        for n in self.input_names:
            t = feeds[n].to(device="cuda", dtype=self._torch_dtype(n)).contiguous()
            keep.append(t)
            self.context.set_input_shape(n, tuple(t.shape))
            self.context.set_tensor_address(n, t.data_ptr())
        outputs = {}
        for n in self.output_names:
            shape = tuple(self.context.get_tensor_shape(n))
            outputs[n] = torch.empty(shape, dtype=self._torch_dtype(n), device="cuda")
            self.context.set_tensor_address(n, outputs[n].data_ptr())
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        stream.synchronize()
        return outputs


def _engine_loader():
    """`k3export.converters.tensorrt.load_engine` when the TensorRT helper provides it, else our session."""
    try:
        from k3export.converters.tensorrt import load_engine  # type: ignore[attr-defined]
    except ImportError:
        return lambda path, manifest: TensorRTSession(Path(path))
    return load_engine


class TrtRunner(Runner):
    """A TensorRT engine driven by the same state manifest as the ONNX export it was built from."""

    name = "trt"

    def __init__(self, engine: str | os.PathLike[str], *, manifest: StateManifest | None = None,
                 name: str | None = None) -> None:
        why = tensorrt_status()
        if why is not None:
            raise RuntimeUnavailable(f"trt runner: {why}")
        import torch

        self._torch = torch
        self.engine_path = find_engine(engine)
        self.manifest = manifest or StateManifest.load(self.engine_path.parent)
        self.session: EngineSession = _engine_loader()(self.engine_path, self.manifest)
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
