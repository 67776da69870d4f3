// OpenVINO operation k3::kda_layer over kernels/kda_layer.h (ov_k3.cpp registers it).
// A fused op: the exporter writes it (`k3export.converters.onnx.fusions`) in place of the standard-op subgraph it
// knows, with that subgraph as its body (ort_k3.cpp binds the same kernel).
#pragma once

#include "common.hpp"
#include "../kernels/kda_layer.h"

namespace k3ov {

// kda_layer(state [B, C, W-1], x [B, T, C = 2HK + HV], taps [W, C], g [B, T, H, K], beta [B, T, H],
// initial_state [B, H, K, V], [start [B] int64]; scale, epsilon) -> (o [B, T, H, V], present, final_state)
class KdaLayer : public ov::op::Op {
 public:
  using Attrs = k3::attrs::KdaLayer;
  OPENVINO_OP(Attrs::name, "k3");
  KdaLayer() = default;
  KdaLayer(const ov::OutputVector& args, Attrs a) : Op(args), a_(a) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 6 || get_input_size() == 7,
                          "k3::kda_layer: 6 or 7 inputs expected");
    const char* names[] = {"state", "x", "taps", "g", "beta", "initial_state"};
    for (size_t i = 0; i < 6; ++i) want(this, i, Type_t::f32, names[i]);
    if (get_input_size() == 7) want_index(this, 6, "start");
    const auto g = get_input_partial_shape(3), s0 = get_input_partial_shape(5);
    const bool ranked = g.rank().is_static() && g.rank().get_length() == 4 && s0.rank().is_static() &&
                        s0.rank().get_length() == 4;
    set_output_type(0, ov::element::f32,
                    ranked ? ov::PartialShape{g[0], g[1], g[2], s0[3]} : ov::PartialShape::dynamic());
    set_output_type(1, ov::element::f32, get_input_partial_shape(0));
    set_output_type(2, ov::element::f32, s0);
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<KdaLayer>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    visit(a_, v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto ss = dims(in[0]), gs = dims(in[3]), s0s = dims(in[5]);
    const OptionalIndex st(in, 6);
    check(k3::kda_layer_takes(ss, dims(in[1]), dims(in[2]), st.dims_or_null(), st.data, gs, dims(in[4]), s0s));
    const int64_t B = gs[0], T = gs[1], H = gs[2], K = gs[3], V = s0s[3];
    out[0].set_shape(ov::Shape{size_t(B), size_t(T), size_t(H), size_t(V)});
    out[1].set_shape(in[0].get_shape());
    out[2].set_shape(in[5].get_shape());
    k3::kda_layer(in[0].data<const float>(), in[1].data<const float>(), in[2].data<const float>(), st.data,
                       in[3].data<const float>(), in[4].data<const float>(), in[5].data<const float>(),
                       out[0].data<float>(), out[1].data<float>(), out[2].data<float>(), B, T, ss[2] + 1, H, K, V,
                       a_.scale, a_.epsilon, kPool);
    return true;
  }

 private:
  Attrs a_;
};

}  // namespace k3ov
