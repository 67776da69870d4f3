// OpenVINO operation k3::moe_route over kernels/moe_route.h (ov_k3.cpp registers it).
#pragma once

#include "common.hpp"
#include "../kernels/moe_route.h"

namespace k3ov {

class MoeRoute : public ov::op::Op {
 public:
  using Attrs = k3::attrs::MoeRoute;
  OPENVINO_OP(Attrs::name, "k3");
  MoeRoute() = default;
  MoeRoute(const ov::OutputVector& args, Attrs a) : Op(args), a_(a) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 2, "k3::moe_route: 2 inputs expected");
    want(this, 0, Type_t::f32, "logits");
    want(this, 1, Type_t::f32, "bias");
    const auto ls = get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(this, ls.rank().is_dynamic() || ls.size() == 2, "k3::moe_route: logits [N, E] expected");
    const ov::PartialShape os{ls.rank().is_static() ? ls[0] : ov::Dimension::dynamic(), a_.top_k};
    set_output_type(0, ov::element::f32, os);
    set_output_type(1, ov::element::i64, os);
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<MoeRoute>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    visit(a_, v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto ls = in[0].get_shape();
    check(k3::moe_route_takes(dims(in[0]), dims(in[1]), a_.top_k));
    const ov::Shape os{ls[0], static_cast<size_t>(a_.top_k)};
    out[0].set_shape(os);
    out[1].set_shape(os);
    k3::moe_route(in[0].data<const float>(), in[1].data<const float>(), out[0].data<float>(),
                  out[1].data<int64_t>(), ls[0], ls[1], a_.top_k, a_.renormalize != 0, a_.scale);
    return true;
  }

 private:
  Attrs a_;
};

}  // namespace k3ov
