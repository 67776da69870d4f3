// OpenVINO operation k3::moe_route over kernels/moe_route.h (ov_k3.cpp registers it).
#pragma once

#include "common.hpp"
#include "../kernels/moe_route.h"

namespace k3ov {

// The router's attributes, held by moe_route and by the fused moe_route_experts
struct RouteAttrs {
  int64_t top_k = 1;
  bool renormalize = true;
  float scale = 1.f;
  void visit(ov::AttributeVisitor& v) {
    v.on_attribute("top_k", top_k);
    v.on_attribute("renormalize", renormalize);
    v.on_attribute("scale", scale);
  }
};

class MoeRoute : public ov::op::Op {
 public:
  OPENVINO_OP("moe_route", "k3");
  MoeRoute() = default;
  MoeRoute(const ov::OutputVector& args, RouteAttrs r) : Op(args), r_(r) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 2, "k3::moe_route: 2 inputs expected");
    want(this, 0, Type_t::f32, "logits");
    want(this, 1, Type_t::f32, "bias");
    const auto ls = get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(this, ls.rank().is_dynamic() || ls.size() == 2, "k3::moe_route: logits [N, E] expected");
    const ov::PartialShape os{ls.rank().is_static() ? ls[0] : ov::Dimension::dynamic(), r_.top_k};
    set_output_type(0, ov::element::f32, os);
    set_output_type(1, ov::element::i64, os);
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<MoeRoute>(args, r_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    r_.visit(v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto ls = in[0].get_shape();
    check(k3::moe_route_takes(dims(in[0]), dims(in[1]), r_.top_k));
    const ov::Shape os{ls[0], static_cast<size_t>(r_.top_k)};
    out[0].set_shape(os);
    out[1].set_shape(os);
    k3::moe_route(in[0].data<const float>(), in[1].data<const float>(), out[0].data<float>(),
                  out[1].data<int64_t>(), ls[0], ls[1], r_.top_k, r_.renormalize, r_.scale);
    return true;
  }

 private:
  RouteAttrs r_;
};

}  // namespace k3ov
