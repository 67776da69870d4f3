"""Every way to run a K3 model or an artifact of it, behind one interface (`Runner`), driven by a state manifest.

    runner = make_runner("ort", Target(onnx_dir="export/"))          # torch, triton, ort, ort-cuda, ort-webgpu,
                                                                     # genai, trt, openvino (stateful),
                                                                     # openvino-stateless, openvino-decode-graph,
                                                                     # onnx-reference
    result = greedy_decode(runner, input_ids, steps=8)               # the one decode loop (prefill + N steps)

`RUNNERS` maps a runtime name to its factory; `base` holds the interface, `loop` the attention-mask builder, the
`Decoding` that carries state and mask, and `greedy_decode`; `session.SessionRunner` is the one execution path of
exported graphs (ONNX Runtime, OpenVINO, ONNX reference and TensorRT sessions), `images.ImageGraphs` that of an image
+ text export's vision and embedding graphs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3export.errors import K3ExportError

from .base import Runner, RunnerWrapper, RuntimeUnavailable, StepOutput, as_ids, to_numpy
from .loop import Decoding, GreedyResult, greedy_decode, left_pad, next_tokens


@dataclass
class Target:
    """What a runner runs: the PyTorch model (torch, triton) and / or the artifacts made from it (ort, trt)."""

    model: Any = None  # K3ForCausalLM, in the reference's dtype
    onnx_dir: str | os.PathLike[str] | None = None
    engine: str | os.PathLike[str] | None = None
    pipeline_dir: str | os.PathLike[str] | None = None  # a pipeline export (runtimes pipeline, ray)
    device: str = "cpu"
    triton_steps: int | None = None  # most decode steps for the (slow on CPU) Triton interpreter
    #: k3export's native kernels (ONNX Runtime's k3 ops library, OpenVINO's k3 extension) on or off; None: the
    #: environment's default (``K3EXPORT_ORT_OPS`` / ``K3EXPORT_OV_EXT``, `k3export.switches`)
    kernels: bool | None = None

    def need(self, what: str, runtime: str, flag: str) -> Any:
        value = getattr(self, what)
        if value is None:
            raise K3ExportError(f"runtime {runtime} needs {flag}")
        return value


def _torch(t: Target) -> Runner:
    from .torch_runner import TorchRunner

    return TorchRunner(t.need("model", "torch", "a model"), device=t.device)


def _torch_in(dtype: str) -> Callable[[Target], Runner]:
    """PyTorch eager on a copy of the model in `dtype` (``torch-bf16``: a bf16 checkpoint as stored, judged with
    bf16 tolerances against the wider reference)."""
    def make(t: Target) -> Runner:
        from .torch_runner import TorchRunner, cast_model

        return TorchRunner(cast_model(t.need("model", f"torch-{dtype}", "a model"), dtype), device=t.device,
                           name=f"torch-{dtype}")

    return make


def _triton(t: Target) -> Runner:
    from .torch_runner import TritonRunner, cast_model

    steps = t.triton_steps if t.triton_steps is not None else (8 if t.device == "cpu" else None)
    model = t.need("model", "triton", "a model")
    if model.get_input_embeddings().weight.dtype.itemsize > 4:  # an fp64 reference: the kernels compute in fp32
        model = cast_model(model, "fp32")
    return TritonRunner(model, device=t.device, max_steps=steps)


def _ort(t: Target) -> Runner:
    from .ort_runner import OrtRunner

    return OrtRunner(t.need("onnx_dir", "ort", "--onnx ONNX_DIR"), kernels=t.kernels)


def _ort_cuda(t: Target) -> Runner:
    from .ort_runner import OrtRunner
    from .ort_session import CUDA_PROVIDERS

    return OrtRunner(t.need("onnx_dir", "ort-cuda", "--onnx ONNX_DIR"), providers=CUDA_PROVIDERS, name="ort-cuda",
                     kernels=t.kernels)


def _ort_webgpu(t: Target) -> Runner:
    """ONNX Runtime's WebGPU EP, in a worker run by the Python that `webgpu_runner.PYTHON_ENV` names."""
    from .webgpu_runner import OrtWebGpuRunner

    return OrtWebGpuRunner(t.need("onnx_dir", "ort-webgpu", "--onnx ONNX_DIR"))


def _trt(t: Target) -> Runner:
    from .trt_runner import TrtRunner, tensorrt_status

    why = tensorrt_status()
    if why is not None:
        raise RuntimeUnavailable(f"trt runner: {why}")
    return TrtRunner(t.need("engine", "trt", "--engine ENGINE"), t.onnx_dir)


def _genai(t: Target) -> Runner:
    from .genai_runner import GenaiRunner

    return GenaiRunner(t.need("onnx_dir", "genai", "--onnx ONNX_DIR"))


def _openvino(t: Target) -> Runner:
    from .openvino_runner import OpenVinoRunner

    return OpenVinoRunner(t.need("onnx_dir", "openvino", "--onnx ONNX_DIR"), kernels=t.kernels)


def _openvino_stateless(t: Target) -> Runner:
    """OpenVINO feeding and fetching every carried state each call (the graph as exported, no variables)."""
    from .openvino_runner import OpenVinoRunner

    return OpenVinoRunner(t.need("onnx_dir", "openvino-stateless", "--onnx ONNX_DIR"), stateful=False,
                          name="openvino-stateless", kernels=t.kernels)


def _openvino_decode_graph(t: Target) -> Runner:
    """OpenVINO, stateful, its one-token calls on a second model compiled for one token at batch 1."""
    from .openvino_runner import OpenVinoRunner

    return OpenVinoRunner(t.need("onnx_dir", "openvino-decode-graph", "--onnx ONNX_DIR"), decode_graph=True,
                          name="openvino-decode-graph", kernels=t.kernels)


def _onnx_reference(t: Target) -> Runner:
    from .reference_runner import ReferenceRunner

    return ReferenceRunner(t.need("onnx_dir", "onnx-reference", "--onnx ONNX_DIR"))


#: runtime name -> runner factory
RUNNERS: dict[str, Callable[[Target], Runner]] = {
    "torch": _torch, "torch-bf16": _torch_in("bf16"), "torch-fp16": _torch_in("fp16"), "triton": _triton, "ort": _ort,
    "ort-cuda": _ort_cuda, "ort-webgpu": _ort_webgpu, "genai": _genai, "trt": _trt,
    "openvino": _openvino, "openvino-stateless": _openvino_stateless,
    "openvino-decode-graph": _openvino_decode_graph, "onnx-reference": _onnx_reference,
}


def make_runner(runtime: str, target: Target) -> Runner:
    """The runner of `runtime` for `target`; `RuntimeUnavailable` when it cannot run here (says why)."""
    if runtime not in RUNNERS:
        raise K3ExportError(f"unknown runtime {runtime!r}; choose from {', '.join(RUNNERS)}")
    return RUNNERS[runtime](target)


def __getattr__(name: str) -> Any:  # the runner classes, without importing torch / onnxruntime up front
    modules = {"TorchRunner": "torch_runner", "TritonRunner": "torch_runner", "load_model": "torch_runner",
               "triton_status": "torch_runner", "OrtRunner": "ort_runner", "OrtSession": "ort_session",
               "OrtWebGpuRunner": "webgpu_runner",
               "TrtRunner": "trt_runner", "TrtSession": "trt_runner", "tensorrt_status": "trt_runner",
               "SessionRunner": "session"}
    if name in modules:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{modules[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Decoding", "GreedyResult", "OrtRunner", "OrtSession", "OrtWebGpuRunner", "RUNNERS", "Runner", "RunnerWrapper",
    "RuntimeUnavailable", "SessionRunner", "StepOutput", "Target", "TorchRunner", "TritonRunner", "TrtRunner",
    "TrtSession", "as_ids", "greedy_decode", "left_pad", "load_model", "make_runner", "next_tokens", "tensorrt_status",
    "to_numpy", "triton_status",
]
