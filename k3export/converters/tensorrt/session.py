"""``TrtSession``: run a k3 TensorRT engine like an onnxruntime InferenceSession.

    sess = TrtSession("model.engine", onnx_dir="export/")
    outs = sess.run({"input_ids": ids, "past_key_values.0.recurrent_state": s0, ...})  # name -> np.ndarray

Feeds are numpy arrays (any float dtype; cast to the engine's input dtype, bf16 included); outputs
come back as numpy (bf16 as float32). The optimisation profile is chosen by the number of new tokens
(decode profile for one token, prefill otherwise) and every feed is checked against that profile's
ranges before TensorRT sees it (``checks.check_feed_shapes``: the error names tensor, axis and flag).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from k3export.errors import ExportError
from k3export.plugins import register_plugins, require_tensorrt

from . import checks


class TrtSession:
    """A deserialized engine, one execution context per optimisation profile, CUDA buffers via torch."""

    def __init__(self, engine_path: str | Path, onnx_dir: str | Path | None = None, input_ids: str = "input_ids"):
        trt, _ = require_tensorrt()
        import torch

        if not torch.cuda.is_available():
            raise ExportError("running a TensorRT engine needs an NVIDIA GPU, and none is visible")
        self._trt, self._torch = trt, torch
        register_plugins()  # JIT plugins call back into Python; AOT ones only need the creators' names
        path = Path(engine_path)
        if not path.is_file():
            raise ExportError(f"{path}: no such engine file (build one with `k3export build`)")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise ExportError(f"{path}: TensorRT could not deserialize the engine (built with another TensorRT "
                              "version or GPU?)")
        self.input_ids = input_ids
        eng = self.engine
        names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
        self.input_names = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.profiles = []
        for p in range(eng.num_optimization_profiles):
            shapes = {n: tuple(tuple(int(d) for d in s) for s in eng.get_tensor_profile_shape(n, p))
                      for n in self.input_names}
            ids_max = shapes.get(input_ids, ((0, 0),) * 3)[2]
            kind = "decode" if len(ids_max) == 2 and ids_max[1] == 1 else "prefill"
            self.profiles.append(checks.ProfileSpec(kind, shapes))
        self.roles = None
        if onnx_dir is not None:
            model = checks.load_onnx(checks.find_onnx_model(onnx_dir))
            self.roles = checks.dim_roles(checks.graph_inputs(model), input_ids)
        self._stream = torch.cuda.Stream()
        self._contexts: dict[int, Any] = {}

    # ------------------------------------------------------------------ onnxruntime-like introspection
    def get_inputs(self) -> list[str]:
        return list(self.input_names)

    def get_outputs(self) -> list[str]:
        return list(self.output_names)

    def _context(self, p: int) -> Any:
        if p not in self._contexts:
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(p, self._stream.cuda_stream)
            self._contexts[p] = ctx
        return self._contexts[p]

    def _torch_dtype(self, name: str) -> Any:
        trt, torch = self._trt, self._torch
        table = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                 trt.DataType.BF16: torch.bfloat16, trt.DataType.INT32: torch.int32,
                 trt.DataType.INT64: torch.int64, trt.DataType.BOOL: torch.bool, trt.DataType.INT8: torch.int8}
        return table[self.engine.get_tensor_dtype(name)]

    # ------------------------------------------------------------------ run
    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run one call; returns {output name: numpy array} for `output_names` (default: all outputs)."""
        torch = self._torch
        if self.input_ids not in feeds:
            raise checks.ProfileError(f"missing engine input {self.input_ids!r}")
        seq = int(np.asarray(feeds[self.input_ids]).shape[-1])
        p = checks.select_profile(self.profiles, seq)
        profile = self.profiles[p]
        checks.check_feed_shapes({n: np.shape(v) for n, v in feeds.items()}, profile, self.roles)
        wanted = list(output_names) if output_names is not None else list(self.output_names)
        unknown = [n for n in wanted if n not in self.output_names]
        if unknown:
            raise ExportError(f"unknown outputs {unknown}; the engine returns {self.output_names[:6]} ...")
        ctx = self._context(p)
        keep = []
        with torch.cuda.stream(self._stream):
            for name in self.input_names:
                value = feeds[name]
                t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
                t = t.to(device="cuda", dtype=self._torch_dtype(name)).contiguous()
                keep.append(t)
                ctx.set_input_shape(name, tuple(t.shape))
                ctx.set_tensor_address(name, t.data_ptr() if t.numel() else 0)
            outs = {}
            for name in self.output_names:
                shape = tuple(ctx.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise ExportError(f"output {name!r} has an unresolved shape {shape}")
                t = torch.empty(shape, dtype=self._torch_dtype(name), device="cuda")
                outs[name] = t
                ctx.set_tensor_address(name, t.data_ptr() if t.numel() else 0)
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise ExportError("TensorRT execution failed (see the TensorRT log)")
        self._stream.synchronize()
        result = {}
        for name in wanted:
            t = outs[name]
            if t.dtype in (torch.bfloat16,):
                t = t.float()
            result[name] = t.cpu().numpy()
        return result
