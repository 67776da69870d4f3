# Copyright 2026 the k3export authors. Apache-2.0.
"""Standard-op subgraphs of the exported graph fused into one kernel of ONNX Runtime's k3 ops library.

A decode step runs hundreds of nodes on a few KB each, and each costs ~2.5 us between the weight reads
(docs/speed.md), so a string of them done by one kernel is time saved. These fusions are ONNX Runtime's form of the
graph when the library is registered (`k3export.runtime.ort_session`), as ORT's own optimizer fuses the patterns it
knows: the export file is not changed, every other consumer reads it as it is, and the library's session is
checked against the standard ops (tests/runtime/test_ort_ops.py).

* ``attn_res_aggregate``: the Attention-Residuals aggregate that `graph.K3GraphBuilder.aggregate` writes
  (``RMSNormalization`` of the stacked sources, ``ReduceSum``, ``Softmax`` over depth, ``Mul``, ``ReduceSum``, and
  the ``Unsqueeze`` + ``Concat`` that stack them) becomes one node
  ``k3::attn_res_aggregate(weight, *sources, epsilon)`` over the unstacked sources; its kernel is
  ``k3::attn_res_aggregate`` in ``ops/csrc/k3_kernels.h``, the maths of ``modeling_k3.attn_res_aggregate``.

A subgraph that differs in any way (another axis, an intermediate used twice or a graph output) is left alone.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from .functions import DOMAIN, DOMAIN_VERSION

ATTN_RES_AGGREGATE = "attn_res_aggregate"


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _read(nodes: list[onnx.NodeProto]) -> set[str]:
    """Every value `nodes` read, in the graphs of their attributes (``If`` branches, ``Loop`` bodies) as well."""
    names: set[str] = set()
    for n in nodes:
        names.update(n.input)
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                names |= _read(list(g.node))
    return names


def fuse_attn_res(model: onnx.ModelProto) -> int:
    """Fuse every Attention-Residuals aggregate of `model`'s main graph (in place, weights not needed); returns how
    many were fused."""
    graph = model.graph
    consts = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}

    def only(value: str, op: str) -> onnx.NodeProto | None:
        users = consumers.get(value, [])
        ok = len(users) == 1 and users[0].op_type == op and users[0].domain == "" and value not in outputs
        return users[0] if ok else None

    def axes(node: onnx.NodeProto) -> list[int] | None:
        t = consts.get(node.input[1]) if len(node.input) > 1 else None
        return None if t is None else numpy_helper.to_array(t).tolist()

    def unstacked(vals: str) -> list[str] | None:
        """The [N, D] sources that `vals` [S, N, D] stacks with Unsqueeze (axis 0), then Concat (axis 0)."""
        node = producer.get(vals)
        parts = [vals] if node is not None and node.op_type == "Unsqueeze" else (
            list(node.input) if node is not None and node.op_type == "Concat" and _attr(node, "axis", None) == 0
            else None)
        if parts is None:
            return None
        sources = []
        for p in parts:
            u = producer.get(p)
            if u is None or u.op_type != "Unsqueeze" or axes(u) != [0]:
                return None
            sources.append(u.input[0])
        return sources

    fused: dict[int, onnx.NodeProto] = {}  # id of the last node of a fused pattern -> the fused node
    dropped: set[int] = set()
    stacking: set[int] = set()  # ids of the Unsqueeze nodes under a fused Concat
    for norm in graph.node:
        if norm.op_type != "RMSNormalization" or norm.domain != "" or _attr(norm, "axis", -1) != -1 \
                or _attr(norm, "stash_type", 1) != 1:
            continue
        vals, weight = norm.input[0], norm.input[1]
        logits = only(norm.output[0], "ReduceSum")
        if logits is None or axes(logits) != [-1] or _attr(logits, "keepdims", 1) != 1:
            continue
        alpha = only(logits.output[0], "Softmax")
        if alpha is None or _attr(alpha, "axis", -1) != 0:
            continue
        weighed = only(alpha.output[0], "Mul")
        if weighed is None or sorted(weighed.input) != sorted([alpha.output[0], vals]):
            continue
        total = only(weighed.output[0], "ReduceSum")
        if total is None or axes(total) != [0] or _attr(total, "keepdims", 1) != 0:
            continue
        sources = unstacked(vals)
        if sources is None or {id(n) for n in consumers[vals]} != {id(norm), id(weighed)} or vals in outputs:
            continue
        fused[id(total)] = helper.make_node(
            ATTN_RES_AGGREGATE, [weight, *sources], [total.output[0]], name=f"{norm.name}/{ATTN_RES_AGGREGATE}",
            domain=DOMAIN, epsilon=float(_attr(norm, "epsilon", 1e-5)))
        dropped |= {id(norm), id(logits), id(alpha), id(weighed), id(producer[vals])}
        stacking |= {id(producer[p]) for p in (producer[vals].input if producer[vals].op_type == "Concat" else [])}
    if not fused:
        return 0
    nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in dropped]
    # the Unsqueeze nodes that stacked the sources, once no node (nor a branch inside one) reads them any more: one
    # source can feed several aggregates
    read = _read(nodes) | outputs
    nodes = [n for n in nodes if not (id(n) in stacking and n.output[0] not in read)]
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return len(fused)


__all__ = ["ATTN_RES_AGGREGATE", "fuse_attn_res"]
