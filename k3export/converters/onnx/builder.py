# Copyright 2026 the k3export authors. Apache-2.0.
"""A small ONNX graph builder: unique value names, constants, and weights declared by name/shape/dtype only.

Weights are never held by the builder: each is a `WeightSpec` (ONNX name, shape, dtype, and the source tensor
names it is made of, several for stacked expert weights). The exporter turns specs into external-data
initializers afterwards, streaming the bytes, or only declares them (no-weights export).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from k3export.dtypes import DType

@dataclass
class WeightSpec:
    """One initializer: `parts` are source tensor names, stacked along a new axis 0 when more than one."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    parts: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return int(n * self.dtype.itemsize)


class GraphBuilder:
    """Collects nodes, weight specs, inputs and outputs of one graph."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.weights: dict[str, WeightSpec] = {}
        self.constants: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._counter = 0
        self._const_cache: dict[tuple, str] = {}
        self.scope = ""

    def fresh(self, hint: str) -> str:
        self._counter += 1
        prefix = f"{self.scope}/" if self.scope else ""
        return f"{prefix}{hint}_{self._counter}"

    @contextmanager
    def collecting(self) -> Iterator[list[onnx.NodeProto]]:
        """Nodes made inside the block go to the list it yields (a subgraph's body), not to the graph; they may
        read the graph's values and constants (ONNX's outer scope)."""
        outer, self.nodes = self.nodes, []
        try:
            yield self.nodes
        finally:
            self.nodes = outer

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", name_hint: str | None = None,
           **attrs) -> str | list[str]:
        outs = [self.fresh(name_hint or op_type) for _ in range(n_out)]
        node = helper.make_node(op_type, inputs, outs, name=self.fresh(f"n_{op_type}"), domain=domain or None,
                                **attrs)
        self.nodes.append(node)
        return outs[0] if n_out == 1 else outs

    # ------------------------------------------------------------------ constants and weights
    def const(self, value, dtype: int = TensorProto.INT64) -> str:
        arr = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))
        key = (dtype, arr.shape, arr.tobytes())
        if key in self._const_cache:
            return self._const_cache[key]
        name = f"const_{len(self._const_cache)}"
        self.constants.append(helper.make_tensor(name, dtype, arr.shape, arr.flatten().tolist()))
        self._const_cache[key] = name
        return name

    def weight(self, name: str, shape: tuple[int, ...], dtype: DType, parts: list[str] | None = None) -> str:
        if name not in self.weights:
            self.weights[name] = WeightSpec(name, tuple(int(s) for s in shape), dtype, parts or [name])
        return name

    # ------------------------------------------------------------------ graph I/O
    def add_input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def add_optional_input(self, name: str, elem_type: int, default: int | float) -> str:
        """A scalar graph input backed by an initializer of the same name: `default` unless the caller feeds one
        (ONNX's overridable initializer; onnxruntime does not list it among the required inputs)."""
        self.constants.append(helper.make_tensor(name, elem_type, [], [default]))
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, []))
        return name

    def add_output(self, value: str, name: str, elem_type: int, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [value], [name], name=self.fresh("n_out")))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
