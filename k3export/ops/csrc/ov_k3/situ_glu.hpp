// OpenVINO operation k3::situ_glu over kernels/situ_glu.h (ov_k3.cpp registers it).
#pragma once

#include "common.hpp"
#include "../kernels/situ_glu.h"

namespace k3ov {

class SituGlu : public ov::op::Op {
 public:
  OPENVINO_OP("situ_glu", "k3");
  SituGlu() = default;
  SituGlu(const ov::OutputVector& args, float beta1, float beta2) : Op(args), beta1_(beta1), beta2_(beta2) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 2, "k3::situ_glu: 2 inputs expected");
    want(this, 0, Type_t::f32, "gate");
    want(this, 1, Type_t::f32, "up");
    set_output_type(0, ov::element::f32, get_input_partial_shape(0));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<SituGlu>(args, beta1_, beta2_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    v.on_attribute("beta1", beta1_);
    v.on_attribute("beta2", beta2_);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    check(k3::situ_glu_takes(dims(in[0]), dims(in[1])));
    out[0].set_shape(in[0].get_shape());
    k3::situ_glu(in[0].data<const float>(), in[1].data<const float>(), out[0].data<float>(),
                 static_cast<int64_t>(in[0].get_size()), beta1_, beta2_);
    return true;
  }

 private:
  float beta1_ = 1.f, beta2_ = 1.f;
};

}  // namespace k3ov
