"""ONNX node forms that TensorRT builds as another k3 plugin: the model is rewritten in memory before the parser.

An MXFP4 export keeps its routed experts as standard ONNX (``k3export.converters.onnx.mxfp4``):
``k3::moe_experts(z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale)`` over FLOAT4E2M1 [E, out, in] and
FLOAT8E8M0 [E, out, in/32] initializers. TensorRT's parser would look that node up as a plugin ``moe_experts`` with
9 inputs of types no plugin takes. Its plugin is ``k3::moe_experts_mxfp4`` (``k3export.ops.spec.MOE_EXPERTS_MXFP4``),
which takes the same bytes as uint8: packed E2M1 [E, out, in/2] (two values per byte, element 2j in the low nibble,
ONNX's own 4-bit packing) and E8M0 [E, out, in/32]. An NVFP4 export's 12-input node (E4M3 scales [E, out, in/16]
and fp32 global scales [E] after the packed values, ``k3export.converters.onnx.nvfp4``) is likewise built as
``k3::moe_experts_nvfp4`` (``MOE_EXPERTS_NVFP4``), its values and E4M3 scales as bytes, its global scales as fp32.

`plugin_model` renames such nodes and re-declares their initializers as int8 over the same bytes (TensorRT's parser
turns UINT8 initializers into INT32 and keeps INT8 ones: ``rules.TRT_BYTES``). Only TensorProto metadata changes
(data_type, last dim); external data keeps its location / offset / length and is never read, so
a 1 TB export costs what its graph costs. The parser then reads the weights itself from the export's folder.

MLA attends a long prompt in blocks of queries (an ``If`` over a ``Loop``, for ONNX Runtime's memory); TensorRT
gets the one-call branch (`one_branch`): it fuses attention itself, and its parser then sees no control flow outside
the k3 plugins. A state-window export's one-token KDA shortcut (another ``If``) likewise becomes its general
branch, which computes the same at every length.

An op whose plugin cannot be built (no kernel for the target) is built from its standard-op form instead
(`standard_op_bodies`): its model-local function is replaced by the ``inlined`` graph form's body (no ``If``, no
sequences: ``k3export.converters.onnx.forms``) and its nodes lose ``plugin_namespace``, so the parser inlines that
body. FP4 experts have no such form TensorRT reads (its parser imports no FLOAT8E8M0 initializer; NVFP4's body was
not tried).
"""

from __future__ import annotations

import itertools
from typing import Any

from k3export.converters.onnx.forms import TRT_SKIPPED_BRANCHES, value_uses
from k3export.dtypes import DTypeError, dtype
from k3export.errors import ExportError
from k3export.ops.spec import MOE_EXPERTS, MOE_EXPERTS_MXFP4, MOE_EXPERTS_NVFP4, NAMESPACE, Arg, OpSpec
from k3export.plugins.rules import BYTE_SPECS, SPEC_BYTES, TRT_BYTES

#: (ONNX op type, input count) -> the plugin TensorRT builds that node as, where it is not the op of that name.
#: Everything else (input names, dtypes, shapes, attributes) comes from the plugin's spec.
PLUGIN_FORMS: dict[tuple[str, int], OpSpec] = {(MOE_EXPERTS.name, len(s.inputs)): s
                                                for s in (MOE_EXPERTS_MXFP4, MOE_EXPERTS_NVFP4)}
#: storage-only ONNX types (no TensorRT or torch type holds them) whose bytes a plugin takes as they are
RAW_BYTE_TYPES = frozenset({"float4e2m1", "float8e8m0"})


def plugin_form(op_type: str, n_inputs: int) -> OpSpec | None:
    """The plugin a ``k3`` node of `op_type` with `n_inputs` inputs is built as, when it is another op's."""
    return PLUGIN_FORMS.get((op_type, n_inputs))


def _kept_branch(node: Any) -> Any:
    """The branch TensorRT builds of `node` when it is one of the graph's named ``If`` nodes whose then-branch it
    skips (`TRT_SKIPPED_BRANCHES`), else None."""
    if node.op_type != "If":
        return None
    branches = {a.name: a.g for a in node.attribute}
    if branches["then_branch"].name.rsplit("/", 1)[-1].startswith(TRT_SKIPPED_BRANCHES):
        return branches["else_branch"]
    return None


def one_branch(graph: Any) -> None:
    """Replace each such ``If`` node in `graph` by the branch TensorRT builds (`_kept_branch`), in place."""
    from onnx import helper

    nodes = list(graph.node)
    del graph.node[:]
    for node in nodes:
        kept = _kept_branch(node)
        if kept is None:
            graph.node.append(node)
            continue
        graph.node.extend(kept.node)
        name = node.name or node.output[0]  # a function body's If, inlined, has no name of its own
        graph.node.extend(helper.make_node("Identity", [value.name], [out], name=f"{name}/kept_{n}")
                          for n, (value, out) in enumerate(zip(kept.output, node.output)))


def _as_bytes(t: Any, arg: Arg, label: str) -> bool:
    """Re-declare initializer `t` as TensorRT's byte type over its bytes when `arg` takes a raw-byte type's bytes
    (spec dtype uint8), or is NVFP4's E4M3 scales read as bytes (`rules.BYTE_SPECS`); whether it did. The last dim
    scales by bits / 8 (FP4 [E, out, in] -> int8 [E, out, in/2])."""
    from onnx import TensorProto

    try:
        have = dtype(t.data_type)
    except DTypeError:
        return False  # not ours to reinterpret: the checks name it against the plugin's dtypes
    raw = have.name in RAW_BYTE_TYPES and arg.dtype == SPEC_BYTES
    if not (raw or (have.name == arg.dtype and arg.dtype in BYTE_SPECS and arg.dtype != SPEC_BYTES)):
        return False
    if t.data_location != TensorProto.EXTERNAL and not t.raw_data:
        raise ExportError(f"{label}: input {arg.name!r} ({t.name}) holds its {have.name} values in typed fields; "
                          "the plugin needs its raw bytes (external data or raw_data)")
    if not t.dims or t.dims[-1] * have.bits % 8:
        raise ExportError(f"{label}: input {arg.name!r} ({t.name}) {have.name} {list(t.dims)}: the last dim does "
                          f"not fill whole bytes")
    t.dims[-1] = t.dims[-1] * have.bits // 8
    t.data_type = dtype(TRT_BYTES).onnx
    return True


def plugin_model(model: Any, where: str = "model.onnx") -> Any:
    """`model` (weights not loaded) with every node in `PLUGIN_FORMS` as its plugin and the initializers it takes as
    raw bytes re-declared int8 (same bytes, same external-data entries); `model` itself when there is none. A
    replaced op's function that nothing calls any more is dropped. ExportError when such an initializer also feeds
    another node (retyping it would change that node). Optional inputs backed by an initializer (``logits_to_keep``)
    become constants at their defaults: an engine's inputs are the manifest's, and it returns every position's
    logits. MLA's query blocks become their one-call branch, a window's one-token KDA its general one (`one_branch`)."""
    import onnx

    def forms_of(m: Any) -> list[tuple[int, OpSpec]]:
        found = [(i, plugin_form(n.op_type, len(n.input))) for i, n in enumerate(m.graph.node) if n.domain == NAMESPACE]
        return [(i, spec) for i, spec in found if spec is not None]

    constant = {t.name for t in model.graph.initializer}
    blocks = any(_kept_branch(n) is not None for n in model.graph.node)
    if not blocks and not forms_of(model) and not any(v.name in constant for v in model.graph.input):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    one_branch(out.graph)
    forms = forms_of(out)
    kept = [v for v in out.graph.input if v.name not in constant]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    inits = {t.name: t for t in out.graph.initializer}
    uses = value_uses(itertools.chain(out.graph.node, *(f.node for f in out.functions)))
    retyped: set[str] = set()
    replaced = {out.graph.node[i].op_type for i, _ in forms}
    for i, spec in forms:
        node = out.graph.node[i]
        label = f"{where}: node {i} {node.name!r} ({node.domain}::{node.op_type})"
        for arg, name in zip(spec.inputs, node.input):
            if name in retyped or name not in inits or not _as_bytes(inits[name], arg, label):
                continue
            retyped.add(name)
            if uses[name] > sum(name in out.graph.node[j].input for j, _ in forms):
                raise ExportError(f"{label}: initializer {name!r} also feeds another node; it cannot be re-declared "
                                  f"{TRT_BYTES} for {spec.plugin_id}")
        node.op_type = spec.name
    called = {(n.domain, n.op_type) for n in out.graph.node} | {(n.domain, n.op_type) for f in out.functions
                                                                    for n in f.node}
    for j in reversed(range(len(out.functions))):
        f = out.functions[j]
        if f.domain == NAMESPACE and f.name in replaced and (f.domain, f.name) not in called:
            del out.functions[j]
    return out


def standard_op_bodies(model: Any, ops: Any, config: Any, opset: int, where: str = "model.onnx") -> Any:
    """`model` with the nodes of each op in `ops` built from its standard-op body (module docstring), in place;
    ExportError naming the op when it has none TensorRT reads (MXFP4 experts, a replaced plugin form)."""
    from k3export.converters.onnx.forms import INLINED
    from k3export.converters.onnx.functions import all_functions

    ops = set(ops)
    if not ops:
        return model
    bodies = {f.name: f for f in all_functions(config, opset, INLINED)}
    byte_forms = {spec.name for spec in PLUGIN_FORMS.values()}
    present = {n.op_type for n in model.graph.node if n.domain == NAMESPACE}
    for op in sorted(ops):
        if op in byte_forms:
            raise ExportError(f"{where}: k3::{op} has no standard-op form TensorRT reads (FP4 experts: its parser "
                              "imports no FLOAT8E8M0 initializer, and the NVFP4 body was not built): export with "
                              "--experts dense to build the experts without it")
        if op not in bodies:
            raise ExportError(f"{where}: k3::{op} has no standard-op form; those with one are "
                              f"{', '.join(sorted(bodies))}")
        if op not in present:
            raise ExportError(f"{where}: no k3::{op} node to build from its standard-op form (the graph's k3 ops: "
                              f"{', '.join(sorted(present)) or 'none'})")
    for j, f in enumerate(model.functions):
        if f.domain == NAMESPACE and f.name in ops:
            model.functions[j].CopyFrom(bodies[f.name])
    for node in model.graph.node:
        if node.domain == NAMESPACE and node.op_type in ops:
            keep = [a for a in node.attribute if a.name != "plugin_namespace"]
            del node.attribute[:]
            node.attribute.extend(keep)
    return model


__all__ = ["PLUGIN_FORMS", "RAW_BYTE_TYPES", "plugin_form", "plugin_model", "standard_op_bodies"]
