# Copyright 2026 the k3export authors. Apache-2.0.
"""The ONNX functions of the fused k3 ops (`k3export.ops.spec.FUSED_SPECS`): each body is the standard-op subgraph
the op stands for in the export (what `fusions` matches), written for any float type, so a consumer without the
k3 library (plain ONNX Runtime, OpenVINO reading the inlined graph, the ONNX reference evaluator once inlined)
still reads a file that holds fused nodes; ONNX Runtime and OpenVINO with the k3 library run each as one kernel.

A fused node may leave out optional trailing inputs (``start``, ``any_key``), and ``attn_res_aggregate`` takes any
number of sources; ONNX functions have neither, so a body is written for one variant: the inputs the export's nodes
give (the same for every node of an export), and for ``attn_res_aggregate`` one function per number of sources,
told apart by the node's ``overload`` (ONNX IR >= 10). ``kda_layer`` and ``moe_route_experts`` call the k3
functions of their parts (``short_conv``, ``l2_norm``, ``kda``; ``moe_route``, ``moe_experts``), which the model
holds too.
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto, helper

from k3export.ops.spec import FUSED_SPECS, NAMESPACE

from .forms import INT64_MAX, MLA_QUERY_BLOCKS

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


def short_conv_function(opset: int, start: bool, kernel: int | None = None) -> onnx.FunctionProto:
    """`start`: the nodes give each row's window start (an export with an attention mask). `kernel`: the taps W of
    the model the function is written for (model-local): the builder's own form, one ``Mul`` per tap (else the
    windows gathered, for any W)."""
    nodes = [
        _const("zero", [0]), _const("one", [1]), _const("end", [INT64_MAX]), _const("shape_rows", [-1, 1, 1]),
        _const("shape_offsets", [1, -1, 1]), _const("zero_s", 0), _const("one_s", 1), _const("tap_axis", [2]),
        _node("Transpose", ["state"], ["state_t"], perm=[0, 2, 1]),
        _node("Concat", ["state_t", "x"], ["full"], axis=1),                                   # [B, W-1+T, C]
    ]
    if kernel is None:  # the windows gathered: [B, T, W, C] times the taps, summed over W
        nodes += [_node("Shape", ["x"], ["t"], start=1, end=2), _node("Squeeze", ["t", "zero"], ["t_s"]),
                  _node("Range", ["zero_s", "t_s", "one_s"], ["rows"]),
                  _node("Unsqueeze", ["rows", "one"], ["rows_col"]),
                  _node("Shape", ["taps"], ["w"], start=0, end=1), _node("Squeeze", ["w", "zero"], ["w_s"]),
                  _node("Range", ["zero_s", "w_s", "one_s"], ["taps_at"]),
                  _node("Unsqueeze", ["taps_at", "zero"], ["taps_row"]), _node("Sub", ["w", "one"], ["keep"]),
                  _node("Add", ["rows_col", "taps_row"], ["at"]),                                # [T, W]: t + j
                  _node("Gather", ["full", "at"], ["windows"], axis=1),                          # [B, T, W, C]
                  _node("Mul", ["windows", "taps"], ["terms"]),
                  _node("ReduceSum", ["terms", "tap_axis"], ["conv"], keepdims=0)]
    else:  # as `graph.K3GraphBuilder.short_conv` writes it: one Mul per tap of shifted Slices, their Sum
        nodes.append(_const("keep", [kernel - 1]))
        for j in range(kernel):
            nodes += [_const(f"from_{j}", [j]), _const(f"to_{j}", [j - kernel + 1] if j < kernel - 1 else [INT64_MAX]),
                      _const(f"next_{j}", [j + 1]),
                      _node("Slice", ["full", f"from_{j}", f"to_{j}", "one"], [f"shifted_{j}"]),
                      _node("Slice", ["taps", f"from_{j}", f"next_{j}", "zero"], [f"tap_{j}"]),
                      _node("Mul", [f"shifted_{j}", f"tap_{j}"], [f"term_{j}"])]
        nodes.append(_node("Sum", [f"term_{j}" for j in range(kernel)], ["conv"]))
    nodes += [_node("Sigmoid", ["conv"], ["gate"]), _node("Mul", ["conv", "gate"], ["y"])]  # SiLU
    if start and kernel is not None:  # the W - 1 rows of full from each row's start
        nodes.append(helper.make_node("Constant", [], ["offsets_rows"], value=helper.make_tensor(
            "offsets_rows", TensorProto.INT64, [1, kernel - 1, 1], list(range(kernel - 1)))))
    elif start:
        nodes += [_node("Squeeze", ["keep", "zero"], ["keep_s"]),
                  _node("Range", ["zero_s", "keep_s", "one_s"], ["offsets"]),
                  _node("Reshape", ["offsets", "shape_offsets"], ["offsets_rows"])]
    if start:
        nodes += [
            _node("Reshape", ["start", "shape_rows"], ["start_rows"]),
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


def _attend(prefix: str, q: str, visible: str, any_key: str | None, keys: str, values: str) -> tuple[list, str]:
    """The nodes of MLA's absorbed attention of queries `q` over `keys` / `values`, and its output."""
    p = prefix
    nodes = [_node("MatMul", [q, keys], [p + "scores"]), _node("Mul", [p + "scores", "scale_t"], [p + "scaled"]),
             _node("Where", [visible, p + "scaled", "fill_t"], [p + "masked"]),
             _node("Softmax", [p + "masked"], [p + "probs"], axis=-1)]
    probs = p + "probs"
    if any_key:
        nodes.append(_node("Mul", [probs, any_key], [p + "probs_seen"]))
        probs = p + "probs_seen"
    nodes.append(_node("MatMul", [probs, values], [p + "out"]))
    return nodes, p + "out"


def mla_attend_function(opset: int, halves: bool, any_key: bool, query_block: int) -> onnx.FunctionProto:
    """`halves`: the nodes give the cache's key / value halves (``halves = 1``); `any_key`: they give ``any_key``.
    As the export writes MLA's attention (`graph.K3GraphBuilder.in_query_blocks`): in one call, or past
    `query_block` queries in blocks of at most that many (an ``If`` over a ``Loop``, the then branch named
    `MLA_QUERY_BLOCKS`; queries and masks padded to equal blocks with visible rows, dropped after)."""
    f, b = TensorProto.FLOAT, TensorProto.BOOL
    nodes = [_const_attr("scale_v", "scale", _FLOAT), _const_attr("fill_v", "fill", _FLOAT),
             _node("CastLike", ["scale_v", "q"], ["scale_t"]), _node("CastLike", ["fill_v", "q"], ["fill_t"]),
             _const("zero", [0]), _const("one", [1]), _const("two", [2]), _const("end", [INT64_MAX]),
             _const("rows_axis", [-2]), _const("block", query_block), _const("block_less_one", query_block - 1),
             _const("one_s", 1)]
    keys, values = "lat_t", "c"
    if halves:  # latent_s = key_s ++ value_s, its first R features the keys, its first value_dim the values
        nodes += [
            _const("feature_axis", [3]),
            _const_attr("dc_s", "value_dim", _INT), _node("Reshape", ["dc_s", "one"], ["dc"]),
            _node("Concat", ["lat_t", "c"], ["joined"], axis=-1),                                # [B, 1, S, 2W]
            _node("Shape", ["q"], ["r"], start=3, end=4),
            _node("Slice", ["joined", "zero", "r", "feature_axis"], ["latents"]),
            _node("Transpose", ["latents"], ["keys"], perm=[0, 1, 3, 2]),
            _node("Slice", ["joined", "zero", "dc", "feature_axis"], ["values"]),
        ]
        keys, values = "keys", "values"
    whole, whole_out = _attend("all_", "q", "visible", "any_key" if any_key else None, keys, values)
    nodes += [_node("Shape", ["q"], ["t_vec"], start=2, end=3), _node("Squeeze", ["t_vec", "zero"], ["t"])]
    # blocks: n = ceil(T / block) of rows = ceil(T / n), padded to n * rows
    blocked = [
        _node("Add", ["t", "block_less_one"], ["bq_t_up"]), _node("Div", ["bq_t_up", "block"], ["bq_n"]),
        _node("Add", ["t", "bq_n"], ["bq_t_n"]), _node("Sub", ["bq_t_n", "one_s"], ["bq_t_n1"]),
        _node("Div", ["bq_t_n1", "bq_n"], ["bq_rows"]), _node("Mul", ["bq_n", "bq_rows"], ["bq_padded"]),
        _node("Sub", ["bq_padded", "t"], ["bq_extra_s"]), _node("Unsqueeze", ["bq_extra_s", "zero"], ["bq_extra"]),
        _node("Concat", ["zero", "bq_extra"], ["bq_pad"], axis=0),
        _node("Pad", ["q", "bq_pad", "", "rows_axis"], ["bq_q"]),
        helper.make_node("Constant", [], ["bq_true"], value=helper.make_tensor("bq_true", b, [], [True])),
        _node("Pad", ["visible", "bq_pad", "bq_true", "rows_axis"], ["bq_visible"]),
    ]
    if any_key:
        blocked += [helper.make_node("Constant", [], ["bq_one"], value=helper.make_tensor("bq_one", f, [], [1.0])),
                    _node("CastLike", ["bq_one", "any_key"], ["bq_seen"]),
                    _node("Pad", ["any_key", "bq_pad", "bq_seen", "rows_axis"], ["bq_any_key"])]
    step = [_node("Mul", ["bq_it", "bq_rows"], ["bq_from_s"]), _node("Unsqueeze", ["bq_from_s", "zero"], ["bq_from"]),
            _node("Unsqueeze", ["bq_rows", "zero"], ["bq_len"]), _node("Add", ["bq_from", "bq_len"], ["bq_to"])]
    parts = ["bq_q", "bq_visible"] + (["bq_any_key"] if any_key else [])
    step += [_node("Slice", [x, "bq_from", "bq_to", "rows_axis"], [x + "_block"]) for x in parts]
    attend, out = _attend("bq_", "bq_q_block", "bq_visible_block", "bq_any_key_block" if any_key else None, keys,
                          values)
    step += attend + [_node("Identity", ["bq_cond"], ["bq_cond_out"])]
    body = helper.make_graph(step, "mla_block_body", [helper.make_tensor_value_info("bq_it", TensorProto.INT64, []),
                                                      helper.make_tensor_value_info("bq_cond", b, [])],
                             [helper.make_tensor_value_info("bq_cond_out", b, []),
                              onnx.ValueInfoProto(name=out)])  # q's float type
    blocked += [
        helper.make_node("Constant", [], ["bq_go"], value=helper.make_tensor("bq_go", b, [], [True])),
        _node("Loop", ["bq_n", "bq_go"], ["bq_stacked_raw"], body=body),                       # [n, B, H, rows, Dc]
        # explicitly [n, B, H, rows, Dc]: the ONNX reference evaluator concatenates scan outputs on axis 0
        _node("Unsqueeze", ["bq_n", "zero"], ["bq_n_vec"]), _const("bq_minus_one", [-1]),
        _node("Shape", ["bq_stacked_raw"], ["bq_raw_dims"]), _const("bq_last3", [-3]),
        _node("Slice", ["bq_raw_dims", "bq_last3", "end"], ["bq_tail"]),
        _node("Concat", ["bq_n_vec", "bq_minus_one", "bq_tail"], ["bq_stacked_shape"], axis=0),
        _node("Reshape", ["bq_stacked_raw", "bq_stacked_shape"], ["bq_stacked"]),
        _node("Transpose", ["bq_stacked"], ["bq_by_head"], perm=[1, 2, 0, 3, 4]),
        _node("Shape", ["bq_stacked"], ["bq_dims"]), _const("three", [3]), _const("four", [4]), _const("five", [5]),
        _node("Slice", ["bq_dims", "one", "three"], ["bq_bh"]), _node("Slice", ["bq_dims", "four", "five"], ["bq_dc"]),
        _node("Concat", ["bq_bh", "bq_minus_one", "bq_dc"], ["bq_merged_shape"], axis=0),
        _node("Reshape", ["bq_by_head", "bq_merged_shape"], ["bq_merged"]),                    # [B, H, n * rows, Dc]
        _node("Slice", ["bq_merged", "zero", "t_vec", "two"], ["bq_out"]),
    ]
    branches = [helper.make_graph(ns, name, [], [onnx.ValueInfoProto(name=v)])
                for ns, name, v in ((blocked, MLA_QUERY_BLOCKS, "bq_out"), (whole, "mla_all_queries", whole_out))]
    nodes += [_node("Greater", ["t", "block"], ["many"]),
              _node("If", ["many"], ["out"], then_branch=branches[0], else_branch=branches[1])]
    return _function("mla_attend", _inputs("mla_attend", 5 if any_key else 4), nodes, opset)


def kda_layer_function(opset: int, start: bool, heads: tuple[int, int, int] | None = None
                            ) -> onnx.FunctionProto:
    """k3::short_conv, the split of its output into q, k (H heads of K, from g [B, T, H, K]) and v (H of V, from
    initial_state [B, H, K, V]), k3::l2_norm of q and k and k3::kda: the nodes this op stands for. `heads`: (H, K,
    V) of the model the function is written for (model-local, as kda's body is), constants instead of shape ops."""
    k3 = NAMESPACE
    nodes = [_node("short_conv", ["state", "x", "taps"] + (["start"] if start else []), ["y", "present"], domain=k3)]
    if heads is None:
        nodes += [
            _node("Shape", ["g"], ["h"], start=2, end=3), _node("Shape", ["g"], ["k_dim"], start=3, end=4),
            _node("Shape", ["initial_state"], ["v_dim"], start=3, end=4),
            _node("Mul", ["h", "k_dim"], ["hk"]), _node("Mul", ["h", "v_dim"], ["hv"]),
            _node("Concat", ["hk", "hk", "hv"], ["parts"], axis=0), _const("keep2", [0, 0]),
            _node("Concat", ["keep2", "h", "k_dim"], ["qk_shape"], axis=0),
            _node("Concat", ["keep2", "h", "v_dim"], ["v_shape"], axis=0)]
    else:
        H, K, V = heads
        nodes += [_const("parts", [H * K, H * K, H * V]), _const("qk_shape", [0, 0, H, K]),
                  _const("v_shape", [0, 0, H, V])]
    nodes += [
        _node("Split", ["y", "parts"], ["q_flat", "k_flat", "v_flat"], axis=-1),
        _node("Reshape", ["q_flat", "qk_shape"], ["q_raw"]), _node("Reshape", ["k_flat", "qk_shape"], ["k_raw"]),
        _node("Reshape", ["v_flat", "v_shape"], ["v"]),
        _node("l2_norm", ["q_raw"], ["q"], (_ref("epsilon", _FLOAT),), domain=k3),
        _node("l2_norm", ["k_raw"], ["k"], (_ref("epsilon", _FLOAT),), domain=k3),
        _node("kda", ["q", "k", "v", "g", "beta", "initial_state"], ["o", "final_state"], (_ref("scale", _FLOAT),),
              domain=k3, plugin_namespace=k3),
    ]
    return _function("kda_layer", _inputs("kda_layer", 7 if start else 6), nodes, opset, calls=True)


def moe_route_experts_function(opset: int, scales: bool, overload: str = "") -> onnx.FunctionProto:
    """k3::moe_route, then k3::moe_experts on its slots; `scales`: the experts are MXFP4 and the nodes give their
    scales too (the export's 4-bit ``moe_experts`` function takes them); `overload`: the function's, and the
    ``moe_experts`` overload its body calls (ONNX Runtime's 8-bit one, `k3export.artifacts.expert_views`)."""
    k3, route, experts = NAMESPACE, FUSED_SPECS["moe_route_experts"], FUSED_SPECS["moe_route_experts_mxfp4"]
    weights = list((experts if scales else route).input_names[3:])
    refs = {n: _ref(n, _INT if t is int else _FLOAT if t is float else AttributeProto.STRING)
            for n, t in route.attributes}
    nodes = [
        _node("moe_route", ["logits", "bias"], ["weights", "indices"],
              tuple(refs[n] for n in ("top_k", "renormalize", "scale")), domain=k3, plugin_namespace=k3),
        _node("moe_experts", ["z", "weights", "indices", *weights], ["u"],
              tuple(refs[n] for n in ("act", "beta1", "beta2")), domain=k3, plugin_namespace=k3),
    ]
    nodes[1].overload = overload
    return _function("moe_route_experts", ["logits", "bias", "z", *weights], nodes, opset, overload=overload,
                     calls=True)


def _variant(node: onnx.NodeProto) -> tuple:
    """What the body of `node`'s function depends on beyond the op: its input count, and mla_attend's `halves`."""
    halves = [a.i for a in node.attribute if a.name == "halves"]
    return (len(node.input), *halves)


def _variant_function(op: str, variant: tuple, opset: int, query_block: int, kernel: int | None,
                      heads: tuple[int, int, int] | None) -> onnx.FunctionProto:
    n = variant[0]
    if op == "l2_norm":
        return l2_norm_function(opset)
    if op == "short_conv":
        return short_conv_function(opset, start=n == 4, kernel=kernel)
    if op == "kda_layer":
        return kda_layer_function(opset, start=n == 7, heads=heads)
    if op == "mla_attend":
        return mla_attend_function(opset, halves=bool(variant[1]), any_key=n == 5, query_block=query_block)
    if op == "moe_route_experts":
        return moe_route_experts_function(opset, scales=n == 9)
    return attn_res_aggregate_function(opset, n - 1)


def add_fused_functions(model: onnx.ModelProto, opset: int, query_block: int, kernel: int | None = None,
                        heads: tuple[int, int, int] | None = None) -> int:
    """Add to `model` (in place) the function of every fused op its main graph calls, written for the inputs its
    nodes give (`query_block`: MLA's queries a block past which it attends in blocks, `mla_attend_function`;
    `kernel`, `heads`: the model's short-conv taps and KDA heads (H, K, V), constants of the bodies that take
    them, as functions are model-local), and those of the parts a body calls (kda_layer: short_conv and
    l2_norm); each
    ``attn_res_aggregate`` node gets the ``overload`` of its source count. Returns how many functions were added.
    The fused nodes of an export take one variant an op (an attention mask or not, the cache's halves or not), but
    for the aggregate's source count; ValueError otherwise."""
    variants: dict[str, set[tuple]] = {}
    for node in model.graph.node:
        if node.domain != NAMESPACE or node.op_type not in FUSED_SPECS:
            continue
        variants.setdefault(node.op_type, set()).add(_variant(node))
        if node.op_type == "attn_res_aggregate":
            node.overload = f"s{len(node.input) - 1}"
        if node.op_type == "kda_layer":  # its body calls its parts
            variants.setdefault("short_conv", set()).add((len(node.input) - 3,))
            variants.setdefault("l2_norm", set()).add((1,))
    have = {(f.domain, f.name, f.overload) for f in model.functions}
    added = 0
    for op, found in sorted(variants.items()):
        if op != "attn_res_aggregate" and len(found) > 1:
            raise ValueError(f"fused k3 op {op}: nodes of {len(found)} variants {sorted(found)} in one graph; its "
                             "function is written for one")
        for variant in sorted(found):
            fn = _variant_function(op, variant, opset, query_block, kernel, heads)
            if (fn.domain, fn.name, fn.overload) not in have:
                model.functions.append(fn)
                added += 1
    return added


__all__ = ["add_fused_functions", "attn_res_aggregate_function", "l2_norm_function", "mla_attend_function",
           "moe_route_experts_function", "short_conv_function", "kda_layer_function"]
