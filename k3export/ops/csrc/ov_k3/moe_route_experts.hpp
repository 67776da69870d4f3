// OpenVINO operation k3::moe_route_experts over kernels/moe_route_experts.h (ov_k3.cpp registers it).
// A fused op: the exporter writes it (`k3export.converters.onnx.fusions`) in place of the standard-op subgraph it
// knows, with that subgraph as its body (ort_k3.cpp binds the same kernel).
#pragma once

#include "common.hpp"
#include "moe_route.hpp"
#include "moe_experts.hpp"
#include "../kernels/moe_route_experts.h"

namespace k3ov {

// moe_route_experts(logits [N, E], bias [E], z [N, D], w1, w3, w2[, w1_scale, w3_scale, w2_scale]; top_k,
// renormalize, scale, act, beta1, beta2) -> u [N, D]: moe_route, and moe_experts on its slots, dense or MXFP4
class MoeRouteExperts : public ov::op::Op {
 public:
  using Attrs = k3::attrs::MoeRouteExperts;
  OPENVINO_OP(Attrs::name, "k3");
  MoeRouteExperts() = default;
  MoeRouteExperts(const ov::OutputVector& args, Attrs a) : Op(args), a_(a) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 6 || get_input_size() == 9,
                          "k3::moe_route_experts: 6 inputs (dense) or 9 (MXFP4) expected");
    want(this, 0, Type_t::f32, "logits");
    want(this, 1, Type_t::f32, "bias");
    want(this, 2, Type_t::f32, "z");
    want_experts(this, get_input_size() == 9);
    set_output_type(0, ov::element::f32, get_input_partial_shape(2));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<MoeRouteExperts>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    visit(a_, v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto ls = dims(in[0]);
    check(k3::moe_route_experts_takes(ls, dims(in[1]), a_.top_k, dims(in[2]), dims(in[3])));
    const k3::Routed s(in[0].data<const float>(), in[1].data<const float>(), ls[0], ls[1], a_.top_k, a_.renormalize != 0,
                       a_.scale);
    run_experts("moe_route_experts", a_, in, 2, s.weights.data(), s.indices.data(), s.shape, s.shape, out[0]);
    return true;
  }

 private:
  Attrs a_;
};

}  // namespace k3ov
