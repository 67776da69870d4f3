// OpenVINO operation k3::mla_attend over kernels/mla_attend.h (ov_k3.cpp registers it).
// A fused op: the exporter writes it (`k3export.converters.onnx.fusions`) in place of the standard-op subgraph it
// knows, with that subgraph as its body (ort_k3.cpp binds the same kernel).
#pragma once

#include "common.hpp"
#include "../kernels/mla_attend.h"

namespace k3ov {

// mla_attend(q [B, H, T, R], lat_t [B, 1, R, S] and c [B, 1, S, Dc], or (halves) the cache's key and value
// [B, 1, S, W], visible [T, S] or [B|1, 1, T, S] bool, [any_key [B, 1, T, 1]]; scale, fill, halves, value_dim)
// -> [B, H, T, Dc]
class MlaAttend : public ov::op::Op {
 public:
  using Attrs = k3::attrs::MlaAttend;
  OPENVINO_OP(Attrs::name, "k3");
  MlaAttend() = default;
  MlaAttend(const ov::OutputVector& args, Attrs a) : Op(args), a_(a) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 4 || get_input_size() == 5, "k3::mla_attend: 4 or 5 inputs expected");
    want(this, 0, Type_t::f32, "q");
    want(this, 1, Type_t::f32, a_.halves ? "key" : "lat_t");
    want(this, 2, Type_t::f32, a_.halves ? "value" : "c");
    const auto vt = get_input_element_type(3);
    NODE_VALIDATION_CHECK(this, vt == ov::element::boolean || vt == ov::element::u8 || vt.is_dynamic(),
                          "k3::mla_attend: input 3 (visible) of type boolean expected, got ", vt);
    if (get_input_size() == 5) want(this, 4, Type_t::f32, "any_key");
    const auto qs = get_input_partial_shape(0), cs = get_input_partial_shape(2);
    ov::PartialShape os = ov::PartialShape::dynamic(4);
    if (qs.rank().is_static() && qs.size() == 4 && (a_.halves || (cs.rank().is_static() && cs.size() == 4)))
      os = ov::PartialShape{qs[0], qs[1], qs[2], a_.halves ? ov::Dimension(a_.value_dim) : cs[3]};
    set_output_type(0, ov::element::f32, os);
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<MlaAttend>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    visit(a_, v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto qs = dims(in[0]), as = dims(in[1]), bs = dims(in[2]), vs = dims(in[3]);
    const k3::Dims ak_shape = in.size() == 5 ? dims(in[4]) : k3::Dims{};
    check(k3::mla_attend_takes(qs, as, bs, vs, in.size() == 5 ? &ak_shape : nullptr, a_.halves, a_.value_dim));
    const int64_t B = qs[0], H = qs[1], T = qs[2];
    const auto [cache, S, Dc] =
        k3::mla_inputs(a_.halves, a_.value_dim, in[1].data<const float>(), as, in[2].data<const float>(), bs);
    out[0].set_shape({static_cast<size_t>(B), static_cast<size_t>(H), static_cast<size_t>(T),
                      static_cast<size_t>(Dc)});
    // boolean and u8 are one byte of 0 / 1 each
    k3::mla_attend(in[0].data<const float>(), cache, static_cast<const bool*>(in[3].data()),
                   vs.size() == 4 && vs[0] == B && B > 1, in.size() == 5 ? in[4].data<const float>() : nullptr,
                   out[0].data<float>(), B, H, T, qs[3], S, Dc, a_.scale, a_.fill, kPool);
    return true;
  }

 private:
  Attrs a_;
};

}  // namespace k3ov
