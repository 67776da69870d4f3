# Copyright 2026 the k3export authors. Apache-2.0.
"""The three plugin-bound k3 ops as ONNX nodes plus model-local FunctionProto bodies of standard ops.

Each op appears in the graph as one node of domain ``k3`` carrying ``plugin_namespace="k3"``: TensorRT (>= 10.7)
binds it to the registered plugin of the same name; any runtime without the plugin (ONNX Runtime, or TensorRT
without the plugin library) inlines the FunctionProto body below, so the file runs with no extra library.
Contracts (identical to ``torch.ops.k3.*`` and the TensorRT plugins):

* ``k3::kda(q [B,T,H,K], k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] fp32, beta [B,T,H] fp32,
  initial_state [B,H,K,V] fp32) -> (o [B,T,H,V] in q's dtype, final_state [B,H,K,V] fp32)``, attribute
  ``scale`` (FLOAT, q is multiplied by it). q and k are already L2-normalised. Body (``bodies.kda_function``):
  one token -> opset-27 ``LinearAttention(update_rule="gated_delta")``; more -> the chunked form, in fp32.
* ``k3::moe_experts(z [N,D], weights [N,top_k] fp32, indices [N,top_k] INT64, w1 [E,I,D], w3 [E,I,D], w2 [E,D,I])
  -> u [N,D] fp32``, attributes ``act`` (STRING situ | silu), ``beta1``, ``beta2``: a loop over the selected
  experts (``bodies.moe_experts_function``).
* ``k3::situ_glu(gate, up) -> out`` (gate's dtype), attributes ``beta1``, ``beta2`` (FLOAT); fp32 math:
  ``beta1 tanh(g / beta1) sigmoid(g) * beta2 tanh(u / beta2)``.
* ``k3::moe_route(logits [N,E] fp32, bias [E] fp32) -> (weights [N,top_k] fp32, indices [N,top_k] INT64)``,
  attributes ``top_k`` (INT), ``renormalize`` (INT 0/1), ``scale`` (FLOAT). Selection: ``TopK`` (sorted, largest,
  ties -> lower index) of sigmoid(logits) + bias; weights: the unbiased sigmoid scores gathered, divided by
  (their sum + 1e-20) when renormalize, times scale.

The kda body needs the head count as a static attribute of ``LinearAttention``; it is taken from the model, so the
body is model-local (one ``kda`` function per exported model, as are the other two).
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto, helper

DOMAIN = "k3"
DOMAIN_VERSION = 1
PLUGIN_NAMESPACE = "k3"
OPS = ("kda", "situ_glu", "moe_route", "moe_experts")


def _const_attr(out: str, attr: str, kind: int) -> onnx.NodeProto:
    """A ``Constant`` node whose value is the function attribute ``attr`` (scalar)."""
    value_attr = {AttributeProto.FLOAT: "value_float", AttributeProto.INT: "value_int"}[kind]
    node = helper.make_node("Constant", [], [out])
    node.attribute.append(helper.make_attribute_ref(value_attr, kind))
    node.attribute[-1].ref_attr_name = attr
    return node


def _ns_default() -> AttributeProto:
    return helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE)


def _function(name: str, inputs: list[str], outputs: list[str], nodes: list[onnx.NodeProto],
              attributes: list[str], opset: int) -> onnx.FunctionProto:
    fn = helper.make_function(
        DOMAIN, name, inputs, outputs, nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=attributes,
    )
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
        n("Mul", ["g_t", "b1"], ["g_cap"]),
        n("Sigmoid", ["gf"], ["g_sig"]),
        n("Mul", ["g_cap", "g_sig"], ["situ"]),
        n("Div", ["uf", "b2"], ["u_s"]),
        n("Tanh", ["u_s"], ["u_t"]),
        n("Mul", ["u_t", "b2"], ["u_cap"]),
        n("Mul", ["situ", "u_cap"], ["outf"]),
        n("CastLike", ["outf", "gate"], ["out"]),
    ]
    return _function("situ_glu", ["gate", "up"], ["out"], nodes, ["beta1", "beta2"], opset)


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
        n("GatherElements", ["scores", "indices"], ["w_raw"], axis=-1),
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
    return _function("moe_route", ["logits", "bias"], ["weights", "indices"], nodes,
                     ["top_k", "renormalize", "scale"], opset)


def all_functions(config, opset: int) -> list[onnx.FunctionProto]:
    """The model-local bodies of every k3 op (kda's needs the head count, moe_experts' the activation)."""
    from .bodies import kda_function, moe_experts_function

    return [kda_function(DOMAIN, config.kda_num_heads, opset), situ_glu_function(opset), moe_route_function(opset),
            moe_experts_function(DOMAIN, config.hidden_act, config.activation_situ_beta,
                                 config.activation_situ_linear_beta, opset)]
