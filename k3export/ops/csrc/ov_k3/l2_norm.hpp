// OpenVINO operation k3::l2_norm over kernels/l2_norm.h (ov_k3.cpp registers it).
// A fused op: the exporter writes it (`k3export.converters.onnx.fusions`) in place of the standard-op subgraph it
// knows, with that subgraph as its body (ort_k3.cpp binds the same kernel).
#pragma once

#include "common.hpp"
#include "../kernels/l2_norm.h"

namespace k3ov {

// l2_norm(x [..., n]; epsilon) -> x's shape
class L2Norm : public ov::op::Op {
 public:
  using Attrs = k3::attrs::L2Norm;
  OPENVINO_OP(Attrs::name, "k3");
  L2Norm() = default;
  L2Norm(const ov::OutputVector& args, Attrs a) : Op(args), a_(a) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 1, "k3::l2_norm: 1 input expected");
    want(this, 0, Type_t::f32, "x");
    set_output_type(0, ov::element::f32, get_input_partial_shape(0));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<L2Norm>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    visit(a_, v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto xs = in[0].get_shape();
    check(k3::l2_norm_takes(dims(in[0])));
    out[0].set_shape(xs);
    const int64_t n = xs.back(), rows = n == 0 ? 0 : static_cast<int64_t>(in[0].get_size()) / n;
    k3::l2_norm(in[0].data<const float>(), out[0].data<float>(), rows, n, a_.epsilon, kPool);
    return true;
  }

 private:
  Attrs a_;
};

}  // namespace k3ov
