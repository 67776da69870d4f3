// OpenVINO operation k3::kda over kernels/kda.h (ov_k3.cpp registers it).
#pragma once

#include "common.hpp"
#include "../kernels/kda.h"

namespace k3ov {

class Kda : public ov::op::Op {
 public:
  using Attrs = k3::attrs::Kda;
  OPENVINO_OP(Attrs::name, "k3");
  Kda() = default;
  Kda(const ov::OutputVector& args, Attrs a) : Op(args), a_(a) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 6, "k3::kda: 6 inputs expected");
    for (size_t i = 0; i < 6; ++i) want(this, i, Type_t::f32, "fp32");
    set_output_type(0, ov::element::f32, get_input_partial_shape(2));  // o: v's shape
    set_output_type(1, ov::element::f32, get_input_partial_shape(5));  // final state: initial_state's
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<Kda>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    visit(a_, v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto qs = dims(in[0]), vs = dims(in[2]);
    check(k3::kda_takes(qs, dims(in[1]), vs, dims(in[3]), dims(in[4]), dims(in[5])));
    const int64_t B = qs[0], T = qs[1], H = qs[2], K = qs[3], V = vs[3];
    out[0].set_shape(in[2].get_shape());
    out[1].set_shape(in[5].get_shape());
    k3::kda(in[0].data<const float>(), in[1].data<const float>(), in[2].data<const float>(),
            in[3].data<const float>(), in[4].data<const float>(), in[5].data<const float>(), out[0].data<float>(),
            out[1].data<float>(), B, T, H, K, V, a_.scale, kPool);
    return true;
  }

 private:
  Attrs a_;
};

}  // namespace k3ov
