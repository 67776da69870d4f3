// OpenVINO operation k3::moe_experts over kernels/moe_experts.h (ov_k3.cpp registers it).
#pragma once

#include "common.hpp"
#include "../kernels/moe_experts.h"
#include "../kernels/moe_experts_mxfp4.h"

namespace k3ov {

// Dense (6 inputs: w1, w3 [E, I, D], w2 [E, D, I] fp32) or MXFP4 (9 inputs, k3export/ops/spec.py's
// MOE_EXPERTS_MXFP4: the export's FLOAT4E2M1 w1, w3 [E, I, D], w2 [E, D, I] and their FLOAT8E8M0 scales
// [E, I, D/32], [E, D, I/32], read as OpenVINO holds them: two E2M1 codes a byte, element 2j in the low nibble, the
// layout k3::moe_experts_mxfp4 takes). The MXFP4 form is the same op with the scales: the frontend reads the
// export's node as it is, and the weights stay at 4.25 bits (OpenVINO's constants of f4e2m1 / f8e8m0).

// The experts' inputs from 3 on (w1, w3, w2, and the MXFP4 scales after them), in moe_experts and in the fused
// moe_route_experts alike: their types, and MXFP4's D and I
void want_experts(const ov::Node* node, bool mxfp4) {
  for (size_t i = 3; i < 6; ++i) want(node, i, mxfp4 ? Type_t::f4e2m1 : Type_t::f32, mxfp4 ? "MXFP4" : "fp32");
  for (size_t i = 6; i < node->get_input_size(); ++i) want(node, i, Type_t::f8e8m0, "E8M0 scale");
  if (mxfp4 && known(node, 3) && known(node, 5)) {
    const auto s1 = node->get_input_shape(3), s2 = node->get_input_shape(5);
    NODE_VALIDATION_CHECK(node, s1.size() == 3 && s2.size() == 3 && s1[1] % 32 == 0 && s1[2] % 32 == 0, "k3::",
                          node->get_type_info().name,
                          ": MXFP4 w1 [E, I, D] with D and I multiples of 32 expected");
  }
}

// The experts on routed slots (weights, indices [N, top_k]: `ws`, `is` their shapes): z is in[2] of the fused node
// (in[0] of moe_experts), the weights in[3..5] and the MXFP4 scales in[6..8] of both
template <class Attrs>
void run_experts(const char* op, const Attrs& a, const ov::TensorVector& in, size_t z, const float* weights,
                 const int64_t* idx, const k3::Dims& ws, const k3::Dims& is, ov::Tensor& out) {
  const auto zs = dims(in[z]), s1 = dims(in[3]);
  std::vector<k3::Dims> scales;
  for (size_t i = 6; i < in.size(); ++i) scales.push_back(dims(in[i]));
  check(k3::moe_experts_takes(op, zs, ws, is, s1, dims(in[4]), dims(in[5]), idx, scales));
  const int64_t N = zs[0], top_k = ws[1], E = s1[0], I = s1[1], D = zs[1];
  out.set_shape(in[z].get_shape());
  const float* x = in[z].data<const float>();
  float* u = out.data<float>();
  if (scales.empty()) {
    k3::moe_experts(x, weights, idx, in[3].data<const float>(), in[4].data<const float>(), in[5].data<const float>(),
                    u, N, top_k, E, D, I, situ(a), a.beta1, a.beta2, kPool);
    return;
  }
  auto bytes = [&](size_t i) { return static_cast<const uint8_t*>(in[i].data()); };
  k3::moe_experts_mxfp4(x, weights, idx, bytes(3), bytes(4), bytes(5), bytes(6), bytes(7), bytes(8), u, N, top_k, E, D,
                        I, situ(a), a.beta1, a.beta2, kPool);
}

class MoeExperts : public ov::op::Op {
 public:
  using Attrs = k3::attrs::MoeExperts;
  OPENVINO_OP(Attrs::name, "k3");
  MoeExperts() = default;
  MoeExperts(const ov::OutputVector& args, Attrs a) : Op(args), a_(a) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 6 || get_input_size() == 9,
                          "k3::moe_experts: 6 inputs (dense) or 9 (MXFP4) expected");
    want(this, 0, Type_t::f32, "z");
    want(this, 1, Type_t::f32, "weights");
    want_index(this, 2, "indices");
    want_experts(this, get_input_size() == 9);
    set_output_type(0, ov::element::f32, get_input_partial_shape(0));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<MoeExperts>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    visit(a_, v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    std::vector<int64_t> wide;
    run_experts("moe_experts", a_, in, 0, in[1].data<const float>(), as_i64(in[2], wide), dims(in[1]), dims(in[2]),
                out[0]);
    return true;
  }

 private:
  Attrs a_;
};

}  // namespace k3ov
