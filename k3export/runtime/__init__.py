"""Runners with one interface (torch eager, Triton kernels, ONNX Runtime, TensorRT), driven by a state manifest.

    runner.prefill(input_ids, state=None) -> StepOutput(logits, state, hidden)
    runner.step(next_ids, state)          -> StepOutput
    runner.initial_state(batch)           -> {manifest name: zero tensor}

See `k3export.runtime.base` for the interface and `k3export.runtime.manifest` for the state names.
"""

from __future__ import annotations

from .base import Runner, RunnerWrapper, RuntimeUnavailable, StepOutput, as_ids, to_numpy
from .manifest import MANIFEST_FILE, RUNTIME_CONFIG_FILE, ManifestError, StateEntry, StateManifest, kind_group
from .ort_runner import OrtRunner
from .torch_runner import TorchRunner, TritonRunner, load_model, triton_status
from .trt_runner import TrtRunner, tensorrt_status

__all__ = [
    "MANIFEST_FILE", "RUNTIME_CONFIG_FILE", "ManifestError", "OrtRunner", "Runner", "RunnerWrapper",
    "RuntimeUnavailable", "StateEntry", "StateManifest", "StepOutput", "TorchRunner", "TritonRunner", "TrtRunner",
    "as_ids", "kind_group", "load_model", "tensorrt_status", "to_numpy", "triton_status",
]
