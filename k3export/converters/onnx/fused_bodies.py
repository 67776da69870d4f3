# Copyright 2026 the k3export authors. Apache-2.0.
"""The ONNX functions of the fused k3 ops (`k3export.ops.spec.FUSED_SPECS`): each body is the standard-op subgraph
the op stands for in the export (what `fusions` matches), written for any float type, so a consumer without the
k3 library (plain ONNX Runtime, OpenVINO reading the inlined graph, the ONNX reference evaluator once inlined)
still reads a file that holds fused nodes; ONNX Runtime and OpenVINO with the k3 library run each as one kernel.

A fused node may leave out optional trailing inputs (``start``, ``any_key``), and ``attn_res_aggregate`` takes any
number of sources; ONNX functions have neither, so a body is written for one variant: the inputs the export's nodes
give (the same for every node of an export), and for ``attn_res_aggregate`` one function per number of sources,
told apart by the node's ``overload`` (ONNX IR >= 10). ``short_conv_kda`` and ``moe_route_experts`` call the k3
functions of their parts (``short_conv``, ``l2_norm``, ``kda``; ``moe_route``, ``moe_experts``), which the model
holds too.
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto, helper

from k3export.ops.spec import FUSED_SPECS, NAMESPACE

from .forms import INT64_MAX

_INT, _FLOAT = AttributeProto.INT, AttributeProto.FLOAT


def _ref(name: str, kind: int, as_name: str | None = None) -> AttributeProto:
    """Attribute `as_name` (default `name`) of a body node, taking the value of the function's attribute `name`."""
    a = helper.make_attribute_ref(as_name or name, kind)
    a.ref_attr_name = name
    return a


def _node(op: str, inputs: list[str], outputs: list[str], refs: tuple[AttributeProto, ...] = (), domain: str = "",
          **attrs) -> onnx.NodeProto:
    node = helper.make_node(op, inputs, outputs, domain=domain, **attrs)
    node.attribute.extend(refs)
    return node


def _const(out: str, values: list[int] | int) -> onnx.NodeProto:
    """An int64 ``Constant``: a vector, or a scalar for an int."""
    dims = [] if isinstance(values, int) else [len(values)]
    return helper.make_node("Constant", [], [out], value=helper.make_tensor(out, TensorProto.INT64, dims,
                                                                            [values] if not dims else values))


def _const_attr(out: str, attr: str, kind: int) -> onnx.NodeProto:
    """A ``Constant`` scalar whose value is the function's attribute `attr`."""
    return _node("Constant", [], [out], (_ref(attr, kind, "value_float" if kind == _FLOAT else "value_int"),))


def _function(name: str, inputs: list[str], nodes: list[onnx.NodeProto], opset: int, overload: str = "",
              calls: bool = False) -> onnx.FunctionProto:
    """The FunctionProto of fused op `name`: `inputs` (the spec's, less the optional ones the export leaves out, or
    the sources of one count), its spec's outputs and attributes; `calls`: the body calls other k3 functions."""
    spec = FUSED_SPECS[name]
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(NAMESPACE, 1)] if calls else [])
    fn = helper.make_function(NAMESPACE, name, inputs, list(spec.output_names), nodes, opset_imports=imports,
                              attributes=list(spec.attribute_names))
    if overload:
        fn.overload = overload
    fn.doc_string = f"k3::{name}: {spec.doc}. Standard-op body; the k3 library runs it as one kernel."
    return fn


def _inputs(name: str, present: int | None = None) -> list[str]:
    names = list(FUSED_SPECS[name].input_names)
    return names if present is None else names[:present]


def l2_norm_function(opset: int) -> onnx.FunctionProto:
    nodes = [
        _const_attr("eps", "epsilon", _FLOAT), _node("CastLike", ["eps", "x"], ["eps_t"]), _const("last", [-1]),
        _node("Mul", ["x", "x"], ["sq"]), _node("ReduceSum", ["sq", "last"], ["ss"], keepdims=1),
        _node("Add", ["ss", "eps_t"], ["ss_eps"]), _node("Sqrt", ["ss_eps"], ["norm"]),
        _node("Div", ["x", "norm"], ["y"]),
    ]
    return _function("l2_norm", ["x"], nodes, opset)


def short_conv_function(opset: int, start: bool) -> onnx.FunctionProto:
    """`start`: the nodes give each row's window start (an export with an attention mask)."""
    nodes = [
        _const("zero", [0]), _const("one", [1]), _const("end", [INT64_MAX]), _const("shape_rows", [-1, 1, 1]),
        _const("shape_offsets", [1, -1, 1]), _const("zero_s", 0), _const("one_s", 1), _const("tap_axis", [2]),
        _node("Transpose", ["state"], ["state_t"], perm=[0, 2, 1]),
        _node("Concat", ["state_t", "x"], ["full"], axis=1),                                   # [B, W-1+T, C]
        _node("Shape", ["taps"], ["w"], start=0, end=1), _node("Shape", ["x"], ["t"], start=1, end=2),
        _node("Squeeze", ["w", "zero"], ["w_s"]), _node("Squeeze", ["t", "zero"], ["t_s"]),
        _node("Range", ["zero_s", "t_s", "one_s"], ["rows"]), _node("Range", ["zero_s", "w_s", "one_s"], ["taps_at"]),
        _node("Unsqueeze", ["rows", "one"], ["rows_col"]), _node("Unsqueeze", ["taps_at", "zero"], ["taps_row"]),
        _node("Add", ["rows_col", "taps_row"], ["at"]),                                          # [T, W]: t + j
        _node("Gather", ["full", "at"], ["windows"], axis=1),                                    # [B, T, W, C]
        _node("Mul", ["windows", "taps"], ["terms"]),
        _node("ReduceSum", ["terms", "tap_axis"], ["conv"], keepdims=0),
        _node("Sigmoid", ["conv"], ["gate"]), _node("Mul", ["conv", "gate"], ["y"]),            # SiLU
        _node("Sub", ["w", "one"], ["keep"]),
    ]
    if start:  # the W - 1 rows of full from each row's start
        nodes += [
            _node("Squeeze", ["keep", "zero"], ["keep_s"]), _node("Range", ["zero_s", "keep_s", "one_s"], ["offsets"]),
            _node("Reshape", ["start", "shape_rows"], ["start_rows"]),
            _node("Reshape", ["offsets", "shape_offsets"], ["offsets_rows"]),
            _node("Add", ["start_rows", "offsets_rows"], ["picked"]),                            # [B, W-1, 1]
            _node("Shape", ["state"], ["b"], start=0, end=1), _node("Shape", ["x"], ["c"], start=2, end=3),
            _node("Concat", ["b", "keep", "c"], ["window_shape"], axis=0),
            _node("Expand", ["picked", "window_shape"], ["picked_all"]),
            _node("GatherElements", ["full", "picked_all"], ["window"], axis=1),
        ]
    else:  # the last W - 1 rows
        nodes += [_node("Neg", ["keep"], ["from_end"]),
                  _node("Slice", ["full", "from_end", "end", "one"], ["window"])]
    nodes.append(_node("Transpose", ["window"], ["present"], perm=[0, 2, 1]))
    return _function("short_conv", _inputs("short_conv", 4 if start else 3), nodes, opset)


def attn_res_aggregate_function(opset: int, sources: int) -> onnx.FunctionProto:
    """The aggregate of `sources` sources (overload ``s<sources>``): stacked with Unsqueeze + Concat, keys the
    ``RMSNormalization`` of each (scale `weight`), their sums the logits, softmax over depth, the weighted sum."""
    names = [f"sources_{i}" for i in range(sources)]
    nodes = [_const("zero", [0]), _const("last", [-1])]
    nodes += [_node("Unsqueeze", [v, "zero"], [f"{v}_row"]) for v in names]
    stacked = "sources_0_row" if sources == 1 else "stacked"
    if sources > 1:
        nodes.append(_node("Concat", [f"{v}_row" for v in names], ["stacked"], axis=0))       # [S, ..., D]
    nodes += [
        _node("RMSNormalization", [stacked, "weight"], ["keys"], (_ref("epsilon", _FLOAT),), axis=-1, stash_type=1),
        _node("ReduceSum", ["keys", "last"], ["logits"], keepdims=1),
        _node("Softmax", ["logits"], ["alpha"], axis=0),
        _node("Mul", ["alpha", stacked], ["weighed"]),
        _node("ReduceSum", ["weighed", "zero"], ["out"], keepdims=0),
    ]
    return _function("attn_res_aggregate", ["weight", *names], nodes, opset, overload=f"s{sources}")


def mla_attend_function(opset: int, halves: bool, any_key: bool) -> onnx.FunctionProto:
    """`halves`: the nodes give the cache's key / value halves (``halves = 1``); `any_key`: they give ``any_key``.
    One call at every length (the export's ``If`` that attends long prompts in blocks of queries is what the k3
    kernel replaces: it computes a query row at a time)."""
    nodes = [_const_attr("scale_v", "scale", _FLOAT), _const_attr("fill_v", "fill", _FLOAT),
             _node("CastLike", ["scale_v", "q"], ["scale_t"]), _node("CastLike", ["fill_v", "q"], ["fill_t"])]
    keys, values = "lat_t", "c"
    if halves:  # latent_s = key_s ++ value_s, its first R features the keys, its first value_dim the values
        nodes += [
            _const("zero", [0]), _const("feature_axis", [3]), _const("one_shape", [1]),
            _const_attr("dc_s", "value_dim", _INT), _node("Reshape", ["dc_s", "one_shape"], ["dc"]),
            _node("Concat", ["lat_t", "c"], ["joined"], axis=-1),                                # [B, 1, S, 2W]
            _node("Shape", ["q"], ["r"], start=3, end=4),
            _node("Slice", ["joined", "zero", "r", "feature_axis"], ["latents"]),
            _node("Transpose", ["latents"], ["keys"], perm=[0, 1, 3, 2]),
            _node("Slice", ["joined", "zero", "dc", "feature_axis"], ["values"]),
        ]
        keys, values = "keys", "values"
    nodes += [
        _node("MatMul", ["q", keys], ["scores"]), _node("Mul", ["scores", "scale_t"], ["scaled"]),
        _node("Where", ["visible", "scaled", "fill_t"], ["masked"]), _node("Softmax", ["masked"], ["probs"], axis=-1),
    ]
    if any_key:
        nodes.append(_node("Mul", ["probs", "any_key"], ["probs_seen"]))
    nodes.append(_node("MatMul", ["probs_seen" if any_key else "probs", values], ["out"]))
    return _function("mla_attend", _inputs("mla_attend", 5 if any_key else 4), nodes, opset)


def short_conv_kda_function(opset: int, start: bool) -> onnx.FunctionProto:
    """k3::short_conv, the split of its output into q, k (H heads of K, from g [B, T, H, K]) and v (H of V, from
    initial_state [B, H, K, V]), k3::l2_norm of q and k and k3::kda: the nodes this op stands for."""
    k3 = NAMESPACE
    nodes = [
        _node("short_conv", ["state", "x", "taps"] + (["start"] if start else []), ["y", "present"], domain=k3),
        _node("Shape", ["g"], ["h"], start=2, end=3), _node("Shape", ["g"], ["k_dim"], start=3, end=4),
        _node("Shape", ["initial_state"], ["v_dim"], start=3, end=4),
        _node("Mul", ["h", "k_dim"], ["hk"]), _node("Mul", ["h", "v_dim"], ["hv"]),
        _node("Concat", ["hk", "hk", "hv"], ["parts"], axis=0),
        _node("Split", ["y", "parts"], ["q_flat", "k_flat", "v_flat"], axis=-1),
        _const("keep2", [0, 0]),
        _node("Concat", ["keep2", "h", "k_dim"], ["qk_shape"], axis=0),
        _node("Concat", ["keep2", "h", "v_dim"], ["v_shape"], axis=0),
        _node("Reshape", ["q_flat", "qk_shape"], ["q_raw"]), _node("Reshape", ["k_flat", "qk_shape"], ["k_raw"]),
        _node("Reshape", ["v_flat", "v_shape"], ["v"]),
        _node("l2_norm", ["q_raw"], ["q"], (_ref("epsilon", _FLOAT),), domain=k3),
        _node("l2_norm", ["k_raw"], ["k"], (_ref("epsilon", _FLOAT),), domain=k3),
        _node("kda", ["q", "k", "v", "g", "beta", "initial_state"], ["o", "final_state"], (_ref("scale", _FLOAT),),
              domain=k3),
    ]
    return _function("short_conv_kda", _inputs("short_conv_kda", 7 if start else 6), nodes, opset, calls=True)


def moe_route_experts_function(opset: int, scales: bool) -> onnx.FunctionProto:
    """k3::moe_route, then k3::moe_experts on its slots; `scales`: the experts are MXFP4 (or NVFP4) and the nodes
    give their scales too (the export's 4-bit ``moe_experts`` function takes them)."""
    k3, route, experts = NAMESPACE, FUSED_SPECS["moe_route_experts"], FUSED_SPECS["moe_route_experts_mxfp4"]
    weights = list((experts if scales else route).input_names[3:])
    refs = {n: _ref(n, _INT if t is int else _FLOAT if t is float else AttributeProto.STRING)
            for n, t in route.attributes}
    nodes = [
        _node("moe_route", ["logits", "bias"], ["weights", "indices"],
              tuple(refs[n] for n in ("top_k", "renormalize", "scale")), domain=k3),
        _node("moe_experts", ["z", "weights", "indices", *weights], ["u"],
              tuple(refs[n] for n in ("act", "beta1", "beta2")), domain=k3),
    ]
    return _function("moe_route_experts", ["logits", "bias", "z", *weights], nodes, opset, calls=True)


__all__ = ["attn_res_aggregate_function", "l2_norm_function", "mla_attend_function", "moe_route_experts_function",
           "short_conv_function", "short_conv_kda_function"]
