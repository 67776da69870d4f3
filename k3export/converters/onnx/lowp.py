# Copyright 2026 the k3export authors. Apache-2.0.
"""Run a bf16 export on ONNX Runtime's CPU provider (which has no bf16 arithmetic kernels), for validation.

`emulate_low_precision` rewrites the graph so that it computes in fp32 but rounds to bf16 (Cast to bf16 and back,
both supported on CPU) every value that the bf16 graph holds in bf16 after an arithmetic op; data-movement ops
(Reshape, Transpose, Concat, Gather, ...) need no rounding. bf16 initializers are cast to fp32 once, bf16 graph
inputs/outputs become fp32 (fed with bf16-representable values). Compared with a bf16 engine the only difference
is where rounding happens inside fused ops (e.g. RMSNormalization rounds once instead of twice): the emulated
graph is a faithful proxy for the precision of the exported bf16 graph, not a bit-exact one.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, shape_inference

_NO_ROUNDING = {
    "Reshape", "Transpose", "Concat", "Slice", "Gather", "GatherElements", "Split", "Squeeze", "Unsqueeze",
    "Expand", "Identity", "Shape",
}


def emulate_low_precision(model: onnx.ModelProto, low: int = TensorProto.BFLOAT16) -> onnx.ModelProto:
    """A copy of `model` (external data not loaded is fine) that ORT CPU runs with bf16 rounding emulated."""
    inferred = shape_inference.infer_shapes(model, strict_mode=False)
    types: dict[str, int] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        types[vi.name] = vi.type.tensor_type.elem_type
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for t in g.initializer:
        types[t.name] = t.data_type

    nodes: list[onnx.NodeProto] = []
    rename: dict[str, str] = {}
    for t in g.initializer:
        if t.data_type == low:
            f32 = t.name + "__f32"
            nodes.append(helper.make_node("Cast", [t.name], [f32], to=TensorProto.FLOAT, name=t.name + "__cast"))
            rename[t.name] = f32
    for vi in list(g.input) + list(g.output):
        if vi.type.tensor_type.elem_type == low:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT

    counter = 0
    for node in g.node:
        node = onnx.NodeProto.FromString(node.SerializeToString())
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        if node.op_type == "Cast":
            for a in node.attribute:
                if a.name == "to" and a.i == low:
                    a.i = TensorProto.FLOAT
        nodes.append(node)
        if node.op_type in _NO_ROUNDING:
            continue
        for j, name in enumerate(node.output):
            if name and types.get(name) == low:
                counter += 1
                raw = f"{name}__unrounded{counter}"
                node.output[j] = raw
                mid = f"{name}__bf16_{counter}"
                nodes.append(helper.make_node("Cast", [raw], [mid], to=low, name=f"round_a{counter}"))
                nodes.append(helper.make_node("Cast", [mid], [name], to=TensorProto.FLOAT, name=f"round_b{counter}"))
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    return out
