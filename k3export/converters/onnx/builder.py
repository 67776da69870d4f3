# Copyright 2026 the k3export authors. Apache-2.0.
"""A small ONNX graph builder: unique value names, constants, and weights declared by name/shape/dtype only.

Weights are never held by the builder: each is a `WeightSpec` (ONNX name, shape, dtype, and the source tensor
names it is made of: several for stacked expert weights, or for projections of one input joined into one product,
`GraphBuilder.merge_projections`). The exporter turns specs into external-data initializers afterwards, streaming
the bytes, or only declares them (no-weights export).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from k3export.dtypes import DType

from .forms import value_uses



@dataclass
class WeightSpec:
    """One initializer: `parts` are source tensor names, one after the other along axis 0: each `part_rows[i]`
    rows of ``shape[1:]`` where given, else (several parts) stacked along a new axis 0."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    parts: list[str] = field(default_factory=list)
    part_rows: tuple[int, ...] = ()
    #: set for the codes or scales of a block-quantized projection (`quantize`): its bytes are computed from the
    #: parts' dense weight, not copied
    quant: Quantized | None = None

    def part_shape(self, i: int) -> tuple[int, ...]:
        """The shape of source tensor `parts[i]`."""
        if self.part_rows:
            return (self.part_rows[i], *self.shape[1:])
        return self.shape[1:] if len(self.parts) > 1 or self.parts[0] != self.name else self.shape

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return int(n * self.dtype.itemsize)


@dataclass(frozen=True, eq=False)
class Quantized:
    """What a quantized initializer holds (`quantize`): the `role` (``blocks`` or ``scales``) of the projection whose
    dense weight `dense` declares (its source parts, joined: [n, k]), at `bits` per code and `block_size` codes a
    scale."""

    role: str
    bits: int
    block_size: int
    dense: WeightSpec  # the projection's dense weight

    @property
    def n(self) -> int:
        return self.dense.shape[0]

    @property
    def k(self) -> int:
        return self.dense.shape[1]

    @property
    def k_blocks(self) -> int:
        return -(-self.k // self.block_size)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.role == "blocks":
            return (self.n, self.k_blocks, self.block_size * self.bits // 8)
        return (self.n, self.k_blocks)


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
        #: weights `merge_projections` leaves in products of their own (a router a quantized export keeps in fp32)
        self.keep_apart: set[str] = set()

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

    def weight(self, name: str, shape: tuple[int, ...], dtype: DType, parts: list[str] | None = None,
               part_rows: tuple[int, ...] = ()) -> str:
        if name not in self.weights:
            self.weights[name] = WeightSpec(name, tuple(int(s) for s in shape), dtype, parts or [name],
                                            tuple(part_rows))
        return name

    def merge_projections(self) -> int:
        """Join the projections of one input into one product: the graph's ``Gemm(x, W_i, transB=1)`` nodes that
        read the same x, each with a weight of its own of one dtype and input width, become one ``Gemm`` over
        their weights one after the other (a `WeightSpec` of all their parts, named by them) and a ``Split``
        into the outputs they had. A decode step streams ~1 MB per projection: one product of several reads
        them as one stream, with one dispatch (big_cfg: 54 products become 16; docs/speed.md has the figures).
        Returns how many products were joined."""
        uses = value_uses(self.nodes)
        groups: dict[tuple, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            spec = self.weights.get(node.input[1]) if node.op_type == "Gemm" and len(node.input) == 2 else None
            if (spec is None or len(spec.shape) != 2 or uses[spec.name] != 1 or spec.dtype.torch_name is None
                    or spec.name in self.keep_apart
                    or [(a.name, a.i) for a in node.attribute] != [("transB", 1)]):
                continue
            groups.setdefault((node.input[0], spec.dtype.name, spec.shape[1], self.merge_kind(spec)), []).append(node)
        joined: dict[int, list[onnx.NodeProto]] = {}
        weights: dict[str, WeightSpec | None] = {}  # a joined weight where its first part was, in place of its parts
        for (x, _, width, _), members in groups.items():
            if len(members) < 2:
                continue
            specs = [self.weights[n.input[1]] for n in members]
            rows = [s.shape[0] for s in specs]
            name = _joined_name([s.name for s in specs])
            weights.update({s.name: None for s in specs})
            weights[specs[0].name] = WeightSpec(name, (sum(rows), width), specs[0].dtype,
                                                [p for s in specs for p in s.parts],
                                                tuple(s.part_shape(i)[0] for s in specs for i in range(len(s.parts))))
            first = members[0]  # its name and place (a profile still reads which layer a node is of)
            joined[id(first)] = [
                helper.make_node("Gemm", [x, name], [first.output[0] + "/joined"], name=first.name, transB=1),
                helper.make_node("Split", [first.output[0] + "/joined", self.const(rows)],
                                 [n.output[0] for n in members], name=first.name + "/split", axis=-1)]
            joined.update({id(n): [] for n in members[1:]})
        self.nodes = [m for n in self.nodes for m in joined.get(id(n), [n])]
        specs = (weights.get(name, spec) for name, spec in self.weights.items())
        self.weights = {spec.name: spec for spec in specs if spec is not None}
        return sum(len(v) > 0 for v in joined.values())

    def merge_kind(self, spec: WeightSpec) -> object:
        """What else `merge_projections` must find equal in weights it joins: how their source stores them (a
        subclass's answer; here nothing)."""
        return None

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


def _joined_name(names: list[str]) -> str:
    """The name of weights joined into one: their common prefix once, then each one's rest, without the shared
    suffix, joined by '+' ("m.layers.1.attn.q_proj+g_proj.weight")."""
    stem = [n.rsplit(".", 1) for n in names]
    suffix = "." + stem[0][1] if len(stem[0]) == 2 and all(len(s) == 2 and s[1] == stem[0][1] for s in stem) else ""
    rests = [s[0] if suffix else n for s, n in zip(stem, names)]
    prefix = rests[0][:len(rests[0]) - len(rests[0].split(".")[-1])]
    while any(not r.startswith(prefix) for r in rests):
        prefix = prefix[:prefix.rstrip(".").rfind(".") + 1]
    return prefix + "+".join(r[len(prefix):] for r in rests) + suffix
