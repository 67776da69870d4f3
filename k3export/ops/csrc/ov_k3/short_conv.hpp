// OpenVINO operation k3::short_conv over kernels/short_conv.h (ov_k3.cpp registers it).
// A fused op: the exporter writes it (`k3export.converters.onnx.fusions`) in place of the standard-op subgraph it
// knows, with that subgraph as its body (ort_k3.cpp binds the same kernel).
#pragma once

#include "common.hpp"
#include "../kernels/short_conv.h"

namespace k3ov {

// short_conv(state [B, C, K-1], x [B, T, C], taps [K, C], [start [B] int64]) -> (y [B, T, C], present)
class ShortConv : public ov::op::Op {
 public:
  using Attrs = k3::attrs::ShortConv;
  OPENVINO_OP(Attrs::name, "k3");
  ShortConv() = default;
  ShortConv(const ov::OutputVector& args, Attrs) : Op(args) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 3 || get_input_size() == 4, "k3::short_conv: 3 or 4 inputs expected");
    want(this, 0, Type_t::f32, "state");
    want(this, 1, Type_t::f32, "x");
    want(this, 2, Type_t::f32, "taps");
    if (get_input_size() == 4) want_index(this, 3, "start");
    set_output_type(0, ov::element::f32, get_input_partial_shape(1));
    set_output_type(1, ov::element::f32, get_input_partial_shape(0));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<ShortConv>(args, Attrs{});
  }
  bool visit_attributes(ov::AttributeVisitor&) override { return true; }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto xs = dims(in[1]), ts = dims(in[2]);
    const OptionalIndex st(in, 3);
    check(k3::short_conv_takes(dims(in[0]), xs, ts, st.dims_or_null(), st.data));
    out[0].set_shape(in[1].get_shape());
    out[1].set_shape(in[0].get_shape());
    k3::short_conv(in[0].data<const float>(), in[1].data<const float>(), in[2].data<const float>(), st.data,
                   out[0].data<float>(), out[1].data<float>(), xs[0], xs[1], xs[2], ts[0], kPool);
    return true;
  }
};

}  // namespace k3ov
