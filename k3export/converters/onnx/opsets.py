# Copyright 2026 the k3export authors. Apache-2.0.
"""The opsets, IR version and activation dtypes every graph of an export is written at (the decoder, `export`, and
the image graphs, `vision`), and their checks."""

from __future__ import annotations

import re
from typing import Any

from k3export.dtypes import DTypeError, export_dtype as _export_dtype
from k3export.errors import ExportError

#: the opset the graph builders write against: every node means what its schema at this opset says
BUILT_AT = 27
#: below `BUILT_AT` a graph is stamped with the older opset where each op it uses means the same there
#: (`check_graph_opset`): 23 is the oldest with RMSNormalization and 4-bit DequantizeLinear. An older ONNX Runtime
#: knows fewer opsets (onnxruntime 1.27, the newest with the WebGPU EP, loads up to 26)
SUPPORTED_OPSETS = (23, 24, 25, 26, 27, 28)
DEFAULT_OPSET = 27
IR_VERSION = 11


def export_dtype(dtype: Any):
    """The activation `DType` of an export (fp32, bf16, fp16 in any spelling), else `ExportError`."""
    try:
        return _export_dtype(dtype)
    except DTypeError as exc:
        raise ExportError(str(exc)) from None


def check_opset(opset: int) -> int:
    if not isinstance(opset, int) or opset not in SUPPORTED_OPSETS:
        raise ExportError(
            f"unsupported opset {opset!r}: the K3 graph is built and tested at opsets "
            f"{', '.join(map(str, SUPPORTED_OPSETS))} (up to the newest this onnx/onnxruntime pair supports); "
            "choose one of them")
    return opset


def _signature(schema: Any, attributes: set[str]) -> tuple:
    """What a node of `schema` setting `attributes` means, less the types it accepts: a newer version that only adds
    types, or optional attributes the node leaves unset, means the same."""
    attrs = {a.name: a.type for a in schema.attributes.values() if a.required or a.name in attributes}
    return (sorted(attrs.items()), [(p.name, p.option) for p in schema.inputs],
            [(p.name, p.option) for p in schema.outputs], schema.min_input, schema.max_input, schema.min_output,
            schema.max_output)


def _nodes(model: Any):
    """Every ai.onnx node of `model`: its graph's, its functions' and their subgraphs' (If / Loop bodies)."""
    def walk(nodes):
        for n in nodes:
            if n.domain in ("", "ai.onnx"):
                yield n
            for a in n.attribute:
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from walk(g.node)

    yield from walk(model.graph.node)
    for f in model.functions:
        yield from walk(f.node)


def check_graph_opset(model: Any, opset: int) -> None:
    """`ExportError` naming the first op of `model` (built against `BUILT_AT`, stamped `opset`) that means
    something else at `opset`, or that takes there none of the types the graph gives it (ONNX type inference, strict
    on every node and function body); nothing at `BUILT_AT` and above."""
    if opset >= BUILT_AT:
        return
    import onnx
    from onnx import defs

    seen: set[tuple[str, frozenset[str]]] = set()
    for node in _nodes(model):
        attributes = frozenset(a.name for a in node.attribute)
        if (node.op_type, attributes) in seen:
            continue
        seen.add((node.op_type, attributes))
        newest = defs.get_schema(node.op_type, BUILT_AT, "")
        try:
            old = defs.get_schema(node.op_type, opset, "")
        except defs.SchemaError:
            old = None
        if old is None or _signature(old, attributes) != _signature(newest, attributes):
            raise ExportError(f"opset {opset} cannot express this graph: op {node.op_type} (node {node.name!r}) "
                              f"{'does not exist' if old is None else 'means something else'} there (the graph uses "
                              f"{node.op_type}-{newest.since_version}); export at opset "
                              f"{newest.since_version} or newer")
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise ExportError(f"opset {opset} cannot express this graph: {_type_refusal(str(exc), opset)}") from None


def _type_refusal(error: str, opset: int) -> str:
    """What ONNX type inference's `error` (every failing node, nested) says first: an op given a type it does not
    take at `opset` (and the opset that takes it), else its first failing node."""
    from onnx import defs

    why = " ".join(error.split())
    typed = re.search(r"\(op_type:(\w+)[^)]*\):[^(]*?(\w+) typestr: (\w+), has unsupported type: "
                      r"(tensor\((\w+)\))", why)
    if typed is None:
        first = re.search(r"\(op_type:[^)]*\): \[\w+\] [^(]*", why)
        return f"{first.group(0).strip() if first else why[:300]}; export at a newer opset"
    op, _, typestr, tensor, _ = typed.groups()
    since = next((v for v in range(opset + 1, BUILT_AT + 1)
                  if any(c.type_param_str == typestr and tensor in c.allowed_type_strs
                         for c in defs.get_schema(op, v, "").type_constraints)), BUILT_AT)
    return f"op {op} takes no {tensor} there (the graph gives it one); export at opset {since} or newer"


__all__ = ["BUILT_AT", "DEFAULT_OPSET", "IR_VERSION", "SUPPORTED_OPSETS", "check_graph_opset", "check_opset",
           "export_dtype"]
