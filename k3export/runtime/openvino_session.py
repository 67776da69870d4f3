"""The OpenVINO session of an export (the loader beside `openvino_runner`, as `ort_session` is beside `ort_runner`).

`OpenVinoSession` compiles a graph file for OpenVINO's CPU plugin, with dynamic shapes, at fp32 inference
precision (the plugin's default on CPUs with bf16 arithmetic rounds fp32 matrix products to bf16, where the export
keeps fp32; a bf16 export rounds where its own Casts say), and puts it behind the session interface of
`session.SessionRunner`. Nothing here imports torch: bench/peers.py times it as it runs.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from .base import RuntimeUnavailable, to_numpy
from .images import with_weights

#: CPU plugin properties: every product at the precision the graph declares
OPENVINO_CPU_CONFIG: dict[str, str] = {"INFERENCE_PRECISION_HINT": "f32"}


def openvino_status() -> str | None:
    """None when OpenVINO is importable, else why not."""
    try:
        import openvino  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken native library
        return f"openvino is not importable ({type(exc).__name__}: {exc}); pip install openvino"
    return None


def _initializer_inputs(model: Any) -> set[str]:
    """The graph inputs of an ONNX graph that an initializer of the same name backs (ONNX's overridable
    initializers)."""
    return {i.name for i in model.graph.input} & {t.name for t in model.graph.initializer}


def _optional_inputs(ov: Any, model: Any, names: set[str]) -> dict[str, np.ndarray]:
    """Turn each of `names` back into an input of `model` (OpenVINO's ONNX frontend folds an initializer-backed
    input into a constant, so ``logits_to_keep`` could not be fed); returns {name: its default value}."""
    from openvino import opset13

    defaults: dict[str, np.ndarray] = {}
    params = []
    for node in model.get_ops():
        hit = names & node.get_output_tensor(0).get_names() if node.get_type_name() == "Constant" else set()
        if not hit:
            continue
        name = hit.pop()
        out = node.output(0)
        param = opset13.parameter(out.get_partial_shape(), out.get_element_type(), name=name)
        param.output(0).get_tensor().set_names({name})
        defaults[name] = np.array(node.get_data(), copy=True)
        out.replace(param.output(0))
        params.append(param)
    if params:
        model.add_parameters(params)
        model.validate_nodes_and_infer_types()
    return defaults


class OpenVinoSession:
    """A compiled OpenVINO model behind the session interface: feeds cast to the graph's input types (bfloat16 as
    its bytes), outputs as numpy (bfloat16 via ml_dtypes); an input an initializer backs (``logits_to_keep``) is
    optional, as in ONNX Runtime. `model`: compile this graph (`model_path`'s, edited in memory and loaded without
    its external data, which is read from beside `model_path`) instead of the file's own."""

    def __init__(self, model_path: str | os.PathLike[str], device: str = "CPU", threads: int | None = None, *,
                 model: Any = None) -> None:
        why = openvino_status()
        if why is not None:
            raise RuntimeUnavailable(why)
        import openvino as ov

        self._ov = ov
        core = ov.Core()
        config: dict[str, Any] = dict(OPENVINO_CPU_CONFIG)
        if threads:
            config["INFERENCE_NUM_THREADS"] = int(threads)
        import onnx

        if model is None:
            proto = onnx.load(str(model_path), load_external_data=False)
            graph = core.read_model(str(model_path))
        else:  # read from memory with its weights inlined: OpenVINO resolves external data only beside a file
            proto = with_weights(model, model_path)
            graph = core.read_model(io.BytesIO(proto.SerializeToString()))
        # the graph's own names, read before compiling: compilation folds a pass-through (an fp32 -> fp32 Cast of
        # a state) into its neighbour, and the merged tensor then answers to an internal name as well
        self.input_names = [i.get_any_name() for i in graph.inputs]
        self.output_names = [o.get_any_name() for o in graph.outputs]
        self._defaults = _optional_inputs(ov, graph, _initializer_inputs(proto))
        #: inputs with a default (``logits_to_keep``), fed their default when a call leaves them out
        self.optional_inputs = list(self._defaults)
        self.compiled = core.compile_model(graph, device, config)
        self.version = ov.__version__
        self.request = self.compiled.create_infer_request()
        self._inputs = {n: self.compiled.input(n) for n in self.input_names + self.optional_inputs}
        self._types = {n: p.get_element_type() for n, p in self._inputs.items()}
        self._outputs = {n: self.compiled.output(n) for n in self.output_names}

    def _tensor(self, name: str, value: Any) -> Any:
        ov = self._ov
        want = self._types[name]
        if want == ov.Type.bf16:
            import ml_dtypes

            bits = np.require(to_numpy(value, np.float32).astype(ml_dtypes.bfloat16), requirements="C").view(np.uint16)
            tensor = ov.Tensor(ov.Type.bf16, ov.Shape(list(bits.shape)))
            tensor.data.view(np.uint16)[...] = bits
            return tensor
        arr = to_numpy(value, np.float32) if hasattr(value, "detach") else np.asarray(value)
        # np.require keeps a scalar 0-d (np.ascontiguousarray makes it [1]: logits_to_keep)
        return ov.Tensor(np.require(arr.astype(want.to_dtype(), copy=False), requirements="C"))

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        feeds = {**self._defaults, **feeds}
        self.request.infer({self._inputs[name]: self._tensor(name, value) for name, value in feeds.items()})
        out = {}
        for name, port in self._outputs.items():
            tensor = self.request.get_tensor(port)
            if tensor.element_type == self._ov.Type.bf16:
                import ml_dtypes

                out[name] = np.array(tensor.data, copy=True).view(np.uint16).view(ml_dtypes.bfloat16)
            else:
                out[name] = np.array(tensor.data, copy=True)  # the request reuses its buffers next call
        return out


__all__ = ["OPENVINO_CPU_CONFIG", "OpenVinoSession", "openvino_status"]
