# Copyright 2026 the k3export authors. Apache-2.0.
"""The k3 ops as ONNX nodes plus model-local FunctionProto bodies of standard ops.

Each op appears in the graph as one node of domain ``k3`` carrying ``plugin_namespace="k3"``: TensorRT (>= 10.7)
binds it to the registered plugin of the same name; any runtime without the plugin (ONNX Runtime, or TensorRT
without the plugin library) inlines the FunctionProto body below, so the file runs with no extra library.
Each function's inputs, outputs and attributes are its op's contract, ``k3export.ops.spec`` (the same as
``torch.ops.k3.*`` and the TensorRT plugins); `_function` signs every body with it. The bodies:

* ``kda``: one token -> the recurrence as three small MatMuls per head; more -> the chunked form, in fp32
  (``bodies.kda_function``). q is multiplied by ``scale``; q and k are already L2-normalised.
* ``moe_experts``: the token-slots sorted by expert, a loop over blocks of the selected experts; decode gathers
  per slot (``bodies.moe_experts_function``).
* ``situ_glu``: fp32 ``tanh(g / beta1) sigmoid(g) tanh(u / beta2) * (beta1 beta2)``, cast like gate.
* ``moe_route``: ``TopK`` (sorted, largest, ties -> lower index) of sigmoid(logits) + bias; weights: the unbiased
  sigmoid scores gathered, divided by (their sum + 1e-20) when renormalize, times scale.

The kda body reshapes by the head count, taken from the model, so the body is model-local (one ``kda`` function
per exported model, as are the others).
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto, helper

from k3export.ops.spec import NAMESPACE, SPECS

DOMAIN = PLUGIN_NAMESPACE = NAMESPACE
DOMAIN_VERSION = 1
OPS = tuple(SPECS)


def _const_attr(out: str, attr: str, kind: int) -> onnx.NodeProto:
    """A ``Constant`` node whose value is the function attribute ``attr`` (scalar)."""
    value_attr = {AttributeProto.FLOAT: "value_float", AttributeProto.INT: "value_int"}[kind]
    node = helper.make_node("Constant", [], [out])
    node.attribute.append(helper.make_attribute_ref(value_attr, kind))
    node.attribute[-1].ref_attr_name = attr
    return node


def _ns_default() -> AttributeProto:
    return helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE)


def _function(name: str, nodes: list[onnx.NodeProto], opset: int) -> onnx.FunctionProto:
    """The FunctionProto of op `name`: `nodes` signed with its spec's inputs, outputs and attributes."""
    spec = SPECS[name]
    fn = helper.make_function(DOMAIN, name, list(spec.input_names), list(spec.output_names), list(nodes),
                              opset_imports=[helper.make_opsetid("", opset)], attributes=list(spec.attribute_names))
    fn.attribute_proto.append(_ns_default())  # the parser-control attribute, unused by the body
    fn.doc_string = f"k3::{name} reference body (standard ops); TensorRT binds plugin k3::{name} instead."
    return fn


def situ_glu_function(opset: int) -> onnx.FunctionProto:
    n = helper.make_node
    nodes = [
        _const_attr("b1", "beta1", AttributeProto.FLOAT),
        _const_attr("b2", "beta2", AttributeProto.FLOAT),
        n("Cast", ["gate"], ["gf"], to=TensorProto.FLOAT),
        n("Cast", ["up"], ["uf"], to=TensorProto.FLOAT),
        n("Div", ["gf", "b1"], ["g_s"]),
        n("Tanh", ["g_s"], ["g_t"]),
        n("Sigmoid", ["gf"], ["g_sig"]),
        n("Mul", ["g_t", "g_sig"], ["situ"]),
        n("Div", ["uf", "b2"], ["u_s"]),
        n("Tanh", ["u_s"], ["u_t"]),
        n("Mul", ["situ", "u_t"], ["prod"]),
        n("Mul", ["b1", "b2"], ["b12"]),  # constants: folded when the session is made
        n("Mul", ["prod", "b12"], ["outf"]),
        n("CastLike", ["outf", "gate"], ["out"]),
    ]
    return _function("situ_glu", nodes, opset)


def moe_route_function(opset: int) -> onnx.FunctionProto:
    n = helper.make_node
    f = TensorProto.FLOAT
    nodes = [
        _const_attr("k_scalar", "top_k", AttributeProto.INT),
        _const_attr("renorm_int", "renormalize", AttributeProto.INT),
        _const_attr("scale_v", "scale", AttributeProto.FLOAT),
        n("Constant", [], ["one_shape"], value=helper.make_tensor("one_shape", TensorProto.INT64, [1], [1])),
        n("Constant", [], ["tiny"], value=helper.make_tensor("tiny", f, [], [1e-20])),
        n("Constant", [], ["one"], value=helper.make_tensor("one", f, [], [1.0])),
        n("Reshape", ["k_scalar", "one_shape"], ["k_vec"]),
        n("Cast", ["logits"], ["lf"], to=f),
        n("Cast", ["bias"], ["bf"], to=f),
        n("Sigmoid", ["lf"], ["scores"]),
        n("Add", ["scores", "bf"], ["biased"]),
        n("TopK", ["biased", "k_vec"], ["_top_vals", "indices"], axis=-1, largest=1, sorted=1),
        # axis 1 of [N, E], not -1: the ONNX reference evaluator's GatherElements mis-checks shapes on a negative axis
        n("GatherElements", ["scores", "indices"], ["w_raw"], axis=1),
        # renormalize in {0, 1}: denominator = r * (sum + 1e-20) + (1 - r)
        n("Cast", ["renorm_int"], ["r"], to=f),
        n("ReduceSum", ["w_raw", "one_shape_neg"], ["w_sum"], keepdims=1),
        n("Add", ["w_sum", "tiny"], ["w_sum_eps"]),
        n("Mul", ["w_sum_eps", "r"], ["d1"]),
        n("Sub", ["one", "r"], ["d2"]),
        n("Add", ["d1", "d2"], ["denom"]),
        n("Div", ["w_raw", "denom"], ["w_norm"]),
        n("Mul", ["w_norm", "scale_v"], ["weights"]),
    ]
    nodes.insert(4, n("Constant", [], ["one_shape_neg"],
                      value=helper.make_tensor("one_shape_neg", TensorProto.INT64, [1], [-1])))
    return _function("moe_route", nodes, opset)


def all_functions(config, opset: int, form=None) -> list[onnx.FunctionProto]:
    """The model-local bodies of every k3 op (kda's needs the head count, moe_experts' the activation), written
    for graph form `form` (`forms.graph_form`: with or without ``If`` and sequences)."""
    from k3export.artifacts.graph_forms import expert_block

    from .bodies import kda_function, moe_experts_function
    from .forms import graph_form

    form = graph_form(form)
    kda = kda_function(DOMAIN, config.kda_num_heads, opset, config.linear_attn_config["gate_lower_bound"],
                       branches=form.branches)
    experts = moe_experts_function(DOMAIN, config.hidden_act, config.activation_situ_beta,
                                   config.activation_situ_linear_beta, opset,
                                   block=expert_block(config.moe_intermediate_size, config.expert_input_size),
                                   branches=form.branches, sequences=form.sequences, unique=form.unique,
                                   few_rows=config.moe_intermediate_size if form.ort_contrib else None)
    return [_function("kda", kda.node, opset), situ_glu_function(opset), moe_route_function(opset),
            _function("moe_experts", experts.node, opset)]
