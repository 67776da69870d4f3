// OpenVINO operation k3::attn_res_aggregate over kernels/attn_res_aggregate.h (ov_k3.cpp registers it).
// A fused op: the exporter writes it (`k3export.converters.onnx.fusions`) in place of the standard-op subgraph it
// knows, with that subgraph as its body (ort_k3.cpp binds the same kernel).
#pragma once

#include "common.hpp"
#include "../kernels/attn_res_aggregate.h"

namespace k3ov {

// attn_res_aggregate(weight [D], *sources [..., D]; epsilon) -> [..., D]
class AttnResAggregate : public ov::op::Op {
 public:
  using Attrs = k3::attrs::AttnResAggregate;
  OPENVINO_OP(Attrs::name, "k3");
  AttnResAggregate() = default;
  AttnResAggregate(const ov::OutputVector& args, Attrs a) : Op(args), a_(a) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() >= 2, "k3::attn_res_aggregate: a weight and sources expected");
    for (size_t i = 0; i < get_input_size(); ++i) want(this, i, Type_t::f32, i ? "source" : "weight");
    set_output_type(0, ov::element::f32, get_input_partial_shape(1));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<AttnResAggregate>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    visit(a_, v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    std::vector<k3::Dims> shapes;
    std::vector<const float*> src;
    for (size_t s = 1; s < in.size(); ++s) {
      shapes.push_back(dims(in[s]));
      src.push_back(in[s].data<const float>());
    }
    check(k3::attn_res_aggregate_takes(dims(in[0]), shapes));
    const int64_t S = static_cast<int64_t>(src.size()), D = shapes[0].back();
    out[0].set_shape(in[1].get_shape());
    const int64_t rows = D == 0 ? 0 : static_cast<int64_t>(in[1].get_size()) / D;
    k3::attn_res_aggregate(src.data(), S, in[0].data<const float>(), out[0].data<float>(), rows, D, a_.epsilon, kPool);
    return true;
  }

 private:
  Attrs a_;
};

}  // namespace k3ov
