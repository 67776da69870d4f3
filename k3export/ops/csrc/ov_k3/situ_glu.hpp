// OpenVINO operation k3::situ_glu over kernels/situ_glu.h (ov_k3.cpp registers it).
#pragma once

#include "common.hpp"
#include "../kernels/situ_glu.h"

namespace k3ov {

class SituGlu : public ov::op::Op {
 public:
  using Attrs = k3::attrs::SituGlu;
  OPENVINO_OP(Attrs::name, "k3");
  SituGlu() = default;
  SituGlu(const ov::OutputVector& args, Attrs a) : Op(args), a_(a) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 2, "k3::situ_glu: 2 inputs expected");
    want(this, 0, Type_t::f32, "gate");
    want(this, 1, Type_t::f32, "up");
    set_output_type(0, ov::element::f32, get_input_partial_shape(0));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<SituGlu>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    visit(a_, v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    check(k3::situ_glu_takes(dims(in[0]), dims(in[1])));
    out[0].set_shape(in[0].get_shape());
    k3::situ_glu(in[0].data<const float>(), in[1].data<const float>(), out[0].data<float>(),
                 static_cast<int64_t>(in[0].get_size()), a_.beta1, a_.beta2);
    return true;
  }

 private:
  Attrs a_;
};

}  // namespace k3ov
