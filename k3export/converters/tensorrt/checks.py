"""Everything ``build_engine`` / ``TrtSession`` check before TensorRT sees a model or a feed.

Plain Python (onnx + numpy), so CI tests all of it without TensorRT:

* ``inspect_k3_nodes``     every ``k3``-domain node is a k3 plugin (``k3export.ops.spec.ALL_SPECS``) with
                           ``plugin_namespace="k3"``, the op's attributes (names and types), its input count,
                           and the dtypes / shapes of its initializer inputs (``check_initializer_inputs``);
                           ``require_plugins`` says so when an export has no k3 node at all. Run it on
                           ``plugin_forms.plugin_model(model)``: an MXFP4 ``k3::moe_experts`` is checked as
                           the ``k3::moe_experts_mxfp4`` it is built as.
* ``check_precision``      precision asked vs the dtype the ONNX graph was exported in (TensorRT >= 11
                           builds strongly typed networks: the graph carries the precision) and vs
                           the target's compute capability.
* ``check_target``         the compute capability an engine is built for vs what the installed TensorRT builds for
                           (TensorRT-RTX: its ``ComputeCapability`` list; datacenter TensorRT: the GPU it runs on),
                           refused in one line naming the alternatives.
* ``ProfileSpec`` / ``select_profile`` / ``check_feed_shapes`` (``k3export.artifacts.engine_sidecar``, re-exported)
                           an optimisation profile (``build.make_profiles`` derives them from the manifest), and
                           its ranges checked on every feed with an error naming tensor, axis and flag.
* ``format_parser_errors`` TensorRT ONNX parser errors -> one message naming node index, name and op.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3export.dtypes import EXPORT_DTYPES, DTypeError, dtype
from k3export.errors import ExportError
from k3export.ops.spec import ALL_SPECS, OpInputError, OpSpec
from k3export.plugins import rules
from k3export.plugins.flavour import FLAVOURS, Capability, Flavour, format_cc
from k3export.artifacts.engine_sidecar import ProfileError, ProfileSpec, check_feed_shapes, select_profile

from .plugin_forms import plugin_form

__all__ = ["K3Node", "MIN_COMPUTE_CAPABILITY", "ParserErrorInfo", "ProfileError", "ProfileSpec", "check_feed_shapes",
           "check_fp8", "check_initializer_inputs", "check_precision", "check_target", "format_parser_errors",
           "inspect_k3_nodes", "load_onnx",
           "parser_error_info", "require_plugins", "select_profile"]

#: lowest compute capability with native support (bf16 arithmetic needs Ampere, sm_80)
MIN_COMPUTE_CAPABILITY = {"bf16": (8, 0), "fp16": (5, 3), "fp32": (0, 0)}


# ---------------------------------------------------------------------------------------------- files
def load_onnx(path: str | Path):
    """The ModelProto without its external weights (structure only; the parser reads weights itself), the k3
    library's fused ops replaced by their bodies (`graph_forms.inline_fused`: no plugin of theirs; the k3 ops those
    call stay plugin nodes)."""
    import onnx

    from k3export.artifacts.graph_forms import inline_fused

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ExportError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    return inline_fused(model)


# ---------------------------------------------------------------------------------------------- k3 nodes
@dataclass(frozen=True)
class K3Node:
    index: int  # position in graph.node (what the TensorRT parser reports)
    name: str
    op: str
    attributes: dict[str, Any]


def _attr_value(a: Any) -> Any:
    from onnx import AttributeProto, helper

    v = helper.get_attribute_value(a)
    if a.type == AttributeProto.STRING and isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


def inspect_k3_nodes(model: Any, where: str = "model.onnx", standard_ops: Sequence[str] = ()) -> list[K3Node]:
    """The graph's k3 plugin nodes; ExportError naming node index, name and op for anything TensorRT
    could not map to a k3 plugin (unknown op, missing plugin_namespace, attribute names/types). Nodes of
    `standard_ops` are built from their function bodies (`plugin_forms.standard_op_bodies`), not as plugins."""
    functions = {(f.domain, f.name) for f in model.functions}
    inits = {t.name: t for t in model.graph.initializer}
    nodes = []
    for i, node in enumerate(model.graph.node):
        if node.domain != rules.PLUGIN_NAMESPACE:
            continue
        label = f"{where}: node {i} {node.name!r} ({node.domain}::{node.op_type})"
        attrs = {a.name: _attr_value(a) for a in node.attribute}
        if node.op_type not in ALL_SPECS or node.op_type in standard_ops:
            if "plugin_namespace" not in attrs and (node.domain, node.op_type) in functions:
                continue  # a plain model-local function: the parser inlines its body
            raise ExportError(f"{label}: unknown k3 op; the k3 ops are "
                              f"{', '.join(s.plugin_id for s in ALL_SPECS.values())}")
        ns = attrs.get("plugin_namespace")
        if ns != rules.PLUGIN_NAMESPACE:
            raise ExportError(
                f"{label}: attribute plugin_namespace is {ns!r}, expected {rules.PLUGIN_NAMESPACE!r}; without it "
                "TensorRT inlines the op's function body instead of using the plugin (re-export with k3 plugins)"
            )
        spec = ALL_SPECS[node.op_type]
        plugin_attrs = {k: v for k, v in attrs.items() if k not in rules.PARSER_CONTROL_ATTRS}
        try:
            spec.check_attributes(plugin_attrs, where=label)
        except OpInputError as exc:
            raise ExportError(str(exc)) from None
        if len(node.input) != len(spec.inputs) or len(node.output) != len(spec.outputs):
            form = plugin_form(node.op_type, len(node.input))
            hint = (f" (this is the ONNX form of {form.plugin_id}: build_engine rewrites it with "
                    "plugin_forms.plugin_model before checking)" if form is not None else "")
            raise ExportError(
                f"{label}: has {len(node.input)} inputs / {len(node.output)} outputs; the plugin takes "
                f"{len(spec.inputs)} {spec.input_names} and returns {len(spec.outputs)} {spec.output_names}{hint}"
            )
        check_initializer_inputs(spec, node, inits, plugin_attrs, label)
        nodes.append(K3Node(i, node.name, node.op_type, plugin_attrs))
    return nodes


def check_initializer_inputs(spec: OpSpec, node: Any, inits: Mapping[str, Any], attrs: dict, label: str) -> None:
    """The node's initializer inputs against the plugin's declared dtypes and shapes (`OpSpec.check`, limits
    included); ExportError naming the input. Bytes the spec declares uint8 are int8 in the graph TensorRT parses
    (``rules.TRT_BYTES``). The graph carries no types for activations, so each activation takes
    its dims from the initializers that share its symbols and its dtype from an initializer typed like it."""
    known = {a.name: inits[n] for a, n in zip(spec.inputs, node.input) if n in inits}
    if not known or any(a.dims == "..." and a.name not in known for a in spec.inputs):
        return  # nothing static to check, or an activation of unknown rank
    types: dict[str, str] = {}
    for a, n in zip(spec.inputs, node.input):
        if a.name in known:
            try:
                types[a.name] = rules.spec_dtype(a, dtype(known[a.name].data_type).name)
            except DTypeError:
                from onnx import TensorProto

                onnx_type = TensorProto.DataType.Name(known[a.name].data_type)
                raise ExportError(f"{label}: input {a.name!r} ({n}) has ONNX type {onnx_type}, which "
                                  f"{spec.plugin_id} does not take") from None
    bound: dict[str, int] = {}
    for a in spec.inputs:
        if a.name in known:
            for sym, d in zip(a.dims.split(), known[a.name].dims):
                bound.setdefault(sym, int(d))
    shapes = [tuple(int(d) for d in known[a.name].dims) if a.name in known else
              tuple(bound.get(sym, sym) for sym in a.dims.split()) for a in spec.inputs]
    for a in spec.inputs:
        if a.name not in types:
            allowed = spec.allowed(a, types)
            like = [types[b.name] for b in spec.inputs if b.dtype == "=" + a.name and b.name in types]
            types[a.name] = like[0] if like and like[0] in allowed else allowed[0]
    try:
        spec.check(shapes, [types[a.name] for a in spec.inputs], attrs)
    except OpInputError as exc:
        raise ExportError(f"{label}: {exc}") from None


def require_plugins(nodes: Sequence[K3Node], where: str = "model.onnx") -> None:
    """ExportError when an export has no k3 plugin node at all (exported without the k3 plugins)."""
    if not nodes:
        raise ExportError(
            f"{where} has no k3 plugin nodes ({', '.join(s.plugin_id for s in ALL_SPECS.values())}): it was "
            "exported with standard ops only. Re-export with the k3 plugin ops, or build with "
            "--allow-no-plugins to let TensorRT run the standard-op graph."
        )


# ---------------------------------------------------------------------------------------------- precision
def check_precision(precision: str, model_dtype: str | None, compute_capability: tuple[int, int] | None = None,
                    device_name: str = "this GPU") -> str:
    """Canonical dtype of `precision`; ExportError when unknown, when the export was made in another dtype,
    or when the GPU (compute capability) lacks it."""
    key = str(precision).lower()
    if key not in EXPORT_DTYPES:
        raise ExportError(f"precision {precision!r}: expected one of {', '.join(sorted(EXPORT_DTYPES))}")
    want = EXPORT_DTYPES[key].name
    if model_dtype is not None and model_dtype != want:
        short = dtype(model_dtype).short
        raise ExportError(
            f"precision {key} asked, but the ONNX model was exported in {model_dtype} ({short}). TensorRT builds "
            f"strongly typed networks (the graph's dtypes decide), so re-export with --dtype {key} or build with "
            f"--precision {short}"
        )
    if compute_capability is not None:
        cc = tuple(int(c) for c in compute_capability)
        need = MIN_COMPUTE_CAPABILITY[key]
        if cc < need:
            raise ExportError(
                f"precision {key} needs a GPU with compute capability >= {need[0]}.{need[1]}; {device_name} is "
                f"sm_{cc[0]}{cc[1]}. Export and build in {'fp16' if key == 'bf16' and cc >= (5, 3) else 'fp32'} "
                f"instead{', or build for a target >= ' + format_cc(need) if 'target' in device_name else ''}"
            )
    return want


def check_target(flavour: Flavour, target: Capability | None, gpu: Capability | None) -> Capability:
    """The compute capability to build for: `target` (None: the visible GPU's, `gpu`). ExportError (one line naming
    the alternatives) when the installed TensorRT cannot build for it: TensorRT-RTX builds for the capabilities its
    ``ComputeCapability`` enum names (`Flavour.targets`), with or without a GPU; datacenter TensorRT builds only for
    the GPU it runs on."""
    name = FLAVOURS[flavour.name]
    targets = flavour.targets
    if targets is not None:
        listed = ", ".join(format_cc(t) for t in targets)
        if target is None and gpu is None:
            raise ExportError(f"no GPU is visible, so {name} needs the compute capability to build for: pass "
                              f"--target-cc, one of {listed}")
        cc = target if target is not None else gpu
        if cc not in targets:
            raise ExportError(f"{flavour.label} cannot build for compute capability {format_cc(cc)}; it builds for "
                              f"{listed} (--target-cc). For {format_cc(cc)}, build with datacenter TensorRT on such a "
                              "GPU")
        return cc
    if gpu is None:
        raise ExportError(f"{flavour.label} builds on an NVIDIA GPU, for that GPU, and none is visible; build there, "
                          "or install TensorRT-RTX (`pip install tensorrt-rtx-cu12`), which builds with no GPU for a "
                          "chosen --target-cc")
    if target is not None and target != gpu:
        raise ExportError(f"{flavour.label} builds for the GPU it runs on (compute capability {format_cc(gpu)}), not "
                          f"for {format_cc(target)}: build on a {format_cc(target)} GPU, or with TensorRT-RTX, which "
                          "builds for a chosen --target-cc")
    return gpu


#: the oldest compute capability with FP8: TensorRT-RTX 1.7 builds the blocked FP8 ``DequantizeLinear`` of
#: ``export --projections fp8`` for 8.9 and 12.0, and fails the build for 8.6 (tests/engines)
FP8_MIN_CC = (8, 9)


def check_fp8(flavour: Flavour, target: Capability, model: Any, where: str = "model.onnx") -> None:
    """Refuse, in one line naming the reason, a build of a graph that keeps block-FP8 projections
    (`forms.fp8_projections`) where the installed TensorRT cannot build them for `target`: below `FP8_MIN_CC`, and
    with datacenter TensorRT (not measured: only TensorRT-RTX builds here)."""
    from k3export.converters.onnx.forms import fp8_projections

    kept = fp8_projections(model)
    if not kept:
        return
    what = f"{where} keeps {len(kept)} projections in block FP8 (DequantizeLinear on FLOAT8E4M3FN)"
    if not flavour.rtx:
        raise ExportError(f"{what}; k3export builds those with TensorRT-RTX only (datacenter TensorRT's build of "
                          "them was not measured): export with --projections dense, or build with TensorRT-RTX")
    if tuple(target) < FP8_MIN_CC:
        raise ExportError(f"{what}; compute capability {format_cc(target)} has no FP8 and {flavour.label} cannot "
                          f"build them for it: export with --projections dense, or build for --target-cc "
                          f"{format_cc(FP8_MIN_CC)} or newer")


# ---------------------------------------------------------------------------------------------- parser
@dataclass(frozen=True)
class ParserErrorInfo:
    desc: str
    code: str = ""
    node_index: int = -1
    node_name: str = ""
    node_op: str = ""


def parser_error_info(err: Any) -> ParserErrorInfo:
    """Read a ``tensorrt.ParserError`` (methods vary across TensorRT versions)."""

    def call(attr: str, default: Any) -> Any:
        f = getattr(err, attr, None)
        try:
            return f() if callable(f) else (default if f is None else f)
        except Exception:
            return default

    return ParserErrorInfo(str(call("desc", err)), str(call("code", "")), int(call("node", -1)),
                           str(call("node_name", "")), str(call("node_operator", "")))


def format_parser_errors(errors: Sequence[ParserErrorInfo], model: Any = None, where: str = "model.onnx") -> str:
    """One message for all parser errors: node index, name and op of each (looked up in `model` when the
    parser did not say), plus a hint when a k3 op is involved."""
    lines = []
    k3_involved = False
    for e in errors:
        name, op = e.node_name, e.node_op
        if model is not None and 0 <= e.node_index < len(model.graph.node):
            n = model.graph.node[e.node_index]
            name = name or n.name
            op = op or (f"{n.domain}::{n.op_type}" if n.domain else n.op_type)
        if op.startswith(rules.PLUGIN_NAMESPACE + "::") or op in ALL_SPECS:
            k3_involved = True
        node = f"node {e.node_index} {name!r} ({op})" if e.node_index >= 0 else "graph"
        lines.append(f"  {node}: {e.desc}" + (f" [{e.code}]" if e.code else ""))
    msg = f"TensorRT's ONNX parser rejected {where} ({len(errors)} error{'s' * (len(errors) != 1)}):\n" + "\n".join(lines)
    if k3_involved:
        msg += ("\n  hint: k3 ops need the k3 plugins registered (k3export.plugins.register_plugins(), TensorRT "
                ">= 10.9) and nodes with plugin_namespace='k3'")
    return msg
