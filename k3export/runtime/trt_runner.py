"""TensorRT runner: an engine built from an export (``k3export build``), run by `TrtSession` behind the same
session interface as ONNX Runtime, driven by the export's manifest (import-guarded: TensorRT needs a GPU to run).

`TrtSession` runs on the TensorRT the engine was built with (`k3export.plugins.flavour`: datacenter ``tensorrt`` or
``tensorrt_rtx``, by its sidecar's flavour when there is one), through the TensorRT 10 Python API that both share:
``Runtime.deserialize_cuda_engine``, one ``IExecutionContext`` per optimisation profile
(``set_optimization_profile_async``), ``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3`` on a torch
CUDA stream, buffers allocated with torch. The k3 plugins are registered first (class-based ones run their kernels
from this process). The profile is chosen by the number of new tokens (decode for one, prefill otherwise), and every
feed is checked against that profile's ranges before TensorRT sees it (`k3export.runtime.trt_engine`). Outputs stay
on the GPU as torch tensors, so the state is fed back without a host round trip. An image + text export's image graphs
run under ONNX Runtime's CUDA provider in the same process: TensorRT-RTX 1.7.1's builder stops on ``vision.onnx``'s
per-image attention ``Loop`` with an internal error (``makeScopeNodesContiguous``), so ``build`` makes an engine of the
decoder only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from k3export.artifacts import ExportFolder, load_export
from k3export.dtypes import dtype as as_dtype
from k3export.errors import ExportError

from . import trt_engine
from .base import RuntimeUnavailable
from .ort_session import CUDA_PROVIDERS, ort_graph_opener
from .session import SessionRunner
from .trt_engine import engine_flavour, find_engine


def tensorrt_status() -> str | None:
    """None when a TensorRT and a CUDA device are usable here; otherwise why not."""
    from k3export.plugins.flavour import flavour_status, load_flavour

    why = flavour_status()
    if why is not None:
        return why
    import torch

    if not torch.cuda.is_available():
        return f"{load_flavour().label} imports, but running an engine needs a CUDA device and none is visible"
    return None


class TrtSession:
    """A deserialized engine: one execution context per optimisation profile, CUDA buffers via torch."""

    def __init__(self, engine_path: str | os.PathLike[str], export: ExportFolder) -> None:
        from k3export.plugins import register_plugins
        from k3export.plugins.flavour import load_flavour

        path = Path(engine_path)
        flavour = load_flavour(engine_flavour(path))
        trt = flavour.trt
        import torch

        if not torch.cuda.is_available():
            raise ExportError("running a TensorRT engine needs an NVIDIA GPU, and none is visible")
        self._trt, self._torch = trt, torch
        register_plugins(flavour=flavour)  # class-based and JIT plugins run from here; AOT ones need their names
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise ExportError(f"{path}: {flavour.label} could not deserialize the engine (built with another "
                              "TensorRT version, or for another GPU?)")
        eng = self.engine
        names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
        self.input_names = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.roles = trt_engine.dim_roles(export.manifest)
        # the input and axis whose size is the number of new tokens: it picks the profile
        self._seq = next(((n, a) for n, r in self.roles.items() for a, role in enumerate(r) if role == "seq"), None)
        self.profiles = []
        for p in range(eng.num_optimization_profiles):
            shapes = {n: tuple(tuple(int(d) for d in s) for s in eng.get_tensor_profile_shape(n, p))
                      for n in self.input_names}
            kind = "prefill"
            if self._seq is not None:
                name, axis = self._seq
                kind = "decode" if shapes[name][2][axis] == 1 else "prefill"
            self.profiles.append(trt_engine.ProfileSpec(kind, shapes))
        self._stream = torch.cuda.Stream()
        self._contexts: dict[int, Any] = {}

    def _context(self, p: int) -> Any:
        if p not in self._contexts:
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(p, self._stream.cuda_stream)
            self._contexts[p] = ctx
        return self._contexts[p]

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One call; returns {output name: torch CUDA tensor} for every output."""
        torch = self._torch
        seq = int(np.shape(feeds[self._seq[0]])[self._seq[1]]) if self._seq is not None else 0
        p = trt_engine.select_profile(self.profiles, seq)
        trt_engine.check_feed_shapes({n: tuple(np.shape(v)) for n, v in feeds.items()}, self.profiles[p], self.roles)
        ctx = self._context(p)
        keep, outs = [], {}
        with torch.cuda.stream(self._stream):
            for name in self.input_names:
                value = feeds[name]
                t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
                t = t.to(device="cuda", dtype=as_dtype(self.engine.get_tensor_dtype(name)).torch).contiguous()
                keep.append(t)
                ctx.set_input_shape(name, tuple(t.shape))
                ctx.set_tensor_address(name, t.data_ptr())
            for name in self.output_names:
                shape = tuple(ctx.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise ExportError(f"output {name!r} has an unresolved shape {shape}")
                t = torch.empty(shape, dtype=as_dtype(self.engine.get_tensor_dtype(name)).torch, device="cuda")
                outs[name] = t
                ctx.set_tensor_address(name, t.data_ptr())
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise ExportError("TensorRT execution failed (see the TensorRT log)")
        self._stream.synchronize()
        return outs


class TrtRunner(SessionRunner):
    """A TensorRT engine driven by the manifest of the ONNX export it was built from (default: the engine's
    folder)."""

    name = "trt"

    def __init__(self, engine: str | os.PathLike[str], onnx_dir: str | os.PathLike[str] | None = None, *,
                 name: str | None = None) -> None:
        self.engine_path = find_engine(engine)  # a wrong path is named first, with TensorRT or without
        export = load_export(onnx_dir if onnx_dir is not None else self.engine_path.parent)
        why = tensorrt_status()
        if why is not None:
            raise RuntimeUnavailable(f"trt runner: {why}")
        super().__init__(export, TrtSession(self.engine_path, export), name=name, where=str(self.engine_path),
                         open_graph=ort_graph_opener(CUDA_PROVIDERS, None, export.runtime.session_options))

    def describe(self) -> str:
        images = f"{self.image_note} on onnxruntime CUDA" if self.takes_images else ""
        return f"{self.name} (TensorRT, {self.engine_path.name}{images})"


__all__ = ["TrtRunner", "TrtSession", "engine_flavour", "find_engine", "tensorrt_status"]
