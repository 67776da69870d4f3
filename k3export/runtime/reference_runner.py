"""ONNX reference-evaluator runner: an export run by ``onnx.reference.ReferenceEvaluator``, the standard's own
executable semantics (numpy, one node at a time).

It reads both graph forms with dense experts (`k3export.artifacts.graph_forms`: it expands model-local functions
itself), not MXFP4 experts (its ``Pad`` rejects the negative pads that crop an expert from a 4-bit stack). It holds
every weight in memory as numpy and runs slowly, so it takes small exports only (`REFERENCE_MAX_WEIGHT_BYTES`):
a check that the graph means, by the standard, what the PyTorch model computes. It runs onnx's ops except
``GatherElements``, which it computes itself (`_evaluator_class`): onnx's takes at most 63 entries along its axis.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from k3export.artifacts import load_export
from k3export.dtypes import dtype as as_dtype

from .base import RuntimeUnavailable, to_numpy
from .images import with_weights
from .session import SessionRunner

#: the largest export the reference evaluator is given (weights held as numpy, ops run by numpy one at a time)
REFERENCE_MAX_WEIGHT_BYTES = 1 << 30


@functools.cache
def _evaluator_class() -> type:
    """``ReferenceEvaluator`` with an exact ``GatherElements`` of its own.

    onnx's gathers through ``np.choose``, which takes 64 arrays at most, the index among them: it failed on any
    axis longer than 63, such as the short conv's [conv state | prompt] window at a prefill of 61 tokens or more.
    The graph stays as it is (ONNX Runtime, OpenVINO and TensorRT run it as it is, and changing it for one runtime
    would change what the others are validated on); this evaluator computes the op with ``np.take_along_axis``, the
    same element picks at any length. A subclass, not ``new_ops`` alone: the evaluator builds the bodies of
    model-local functions and subgraphs as ``self.__class__`` without passing ``new_ops`` on (onnx 1.23)."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data: np.ndarray, indices: np.ndarray, axis: int = 0) -> tuple[np.ndarray]:
            axis = axis % data.ndim
            idx = indices.astype(np.int64, copy=False)
            idx = np.where(idx < 0, idx + data.shape[axis], idx)  # the standard's negative indices
            # output[..., i, ...] = data[..., idx[..., i, ...], ...] over the index tensor's own extent elsewhere
            crop = tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(indices.shape))
            return (np.take_along_axis(data[crop], idx, axis=axis),)

    class Evaluator(ReferenceEvaluator):
        def __init__(self, proto: Any, *args: Any, new_ops: list[type] | None = None, **kwargs: Any) -> None:
            super().__init__(proto, *args, new_ops=[*(new_ops or []), GatherElements], **kwargs)

    return Evaluator


class ReferenceSession:
    """A ``ReferenceEvaluator`` of a graph file behind the session interface: feeds cast to the graph's input
    dtypes; an input backed by an initializer (``logits_to_keep``) is optional. `model`: run this graph (loaded
    without its external data, which is read from beside `model_path`) instead of the file's own."""

    def __init__(self, model_path: str | os.PathLike[str], model: Any = None) -> None:
        try:
            import onnx

            from k3export.artifacts.graph_forms import inline_fused

            evaluator = _evaluator_class()
        except ImportError as exc:  # pragma: no cover
            raise RuntimeUnavailable(f"onnx.reference is not importable: {exc}") from exc
        # external data read from beside the file
        model = onnx.load(str(model_path)) if model is None else with_weights(model, model_path)
        model = inline_fused(model)  # the evaluator reads no function overload (the aggregate's per source count)
        inits = {t.name for t in model.graph.initializer}
        self._types = {i.name: as_dtype(i.type.tensor_type.elem_type).numpy for i in model.graph.input}
        self.input_names = [i.name for i in model.graph.input if i.name not in inits]
        self.optional_inputs = [i.name for i in model.graph.input if i.name in inits]
        self.output_names = [o.name for o in model.graph.output]
        self.evaluator = evaluator(model)
        self.version = onnx.__version__

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        cast = {}
        for name, value in feeds.items():
            arr = to_numpy(value, np.float32) if hasattr(value, "detach") else np.asarray(value)
            cast[name] = np.require(arr.astype(self._types[name], copy=False), requirements="C")  # keeps a scalar 0-d
        with np.errstate(over="ignore"):  # sigmoid / exp of large negatives: 0, as the standard means
            return dict(zip(self.output_names, self.evaluator.run(self.output_names, cast)))


class ReferenceRunner(SessionRunner):
    """A small export folder under the ONNX reference evaluator."""

    name = "onnx-reference"

    def __init__(self, export_dir: str | os.PathLike[str], *, name: str | None = None) -> None:
        from k3export.artifacts.graph_forms import check_export

        export = load_export(export_dir)
        export.require_weights()
        check_export(name or self.name, export)
        if export.runtime.weight_bytes > REFERENCE_MAX_WEIGHT_BYTES:
            raise RuntimeUnavailable(
                f"{name or self.name}: {export.root} holds {export.runtime.weight_bytes / 2**30:.1f} GiB of weights; "
                f"the ONNX reference evaluator runs exports of at most {REFERENCE_MAX_WEIGHT_BYTES / 2**30:.0f} GiB")
        self.ref = ReferenceSession(export.model_path)
        super().__init__(export, self.ref, name=name, open_graph=ReferenceSession)

    def describe(self) -> str:
        graph = self.export.model_path.name
        return f"{self.name} (onnx {self.ref.version} ReferenceEvaluator, {graph}{self.image_note})"


__all__ = ["REFERENCE_MAX_WEIGHT_BYTES", "ReferenceRunner", "ReferenceSession"]
