// ONNX Runtime kernels k3::moe_route_experts and k3::moe_route_experts_mxfp4 over kernels/moe_route_experts.h
// (ort_k3.cpp registers them). Fused ops: the exporter writes them in place of a moe_route whose weights and indices
// only a moe_experts reads: the router's inputs, then the experts' but those two. The slots stay in the call
// (`k3::Routed`).
#pragma once

#include "moe_experts.hpp"
#include "../kernels/moe_route_experts.h"

namespace k3ort {

// The routed slots of the fused node, or none where the inputs do not fit (`why` says why)
template <class Attrs>
std::optional<k3::Routed> route(const Attrs& a, const Tensor<float>& logits, const Tensor<float>& bias,
                                const k3::Dims& z, const k3::Dims& w1, std::string& why) {
  const auto ls = logits.Shape();
  why = k3::moe_route_experts_takes(ls, bias.Shape(), a.top_k, z, w1);
  if (!why.empty()) return std::nullopt;
  return k3::Routed(logits.Data(), bias.Data(), ls[0], ls[1], a.top_k, a.renormalize != 0, a.scale);
}

Slots slots(const k3::Routed& s) { return {s.weights.data(), s.indices.data(), s.shape, s.shape}; }

struct MoeRouteExperts : Kernel<k3::attrs::MoeRouteExperts> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& logits, const Tensor<float>& bias,
                      const Tensor<float>& z, const Tensor<float>& w1, const Tensor<float>& w3,
                      const Tensor<float>& w2, Tensor<float>& u) {
    std::string why;
    const auto s = route(a, logits, bias, z.Shape(), w1.Shape(), why);
    return s ? dense_experts(ctx, a, z, slots(*s), w1, w3, w2, u) : fail(why);
  }
};

struct MoeRouteExpertsMxfp4 : Kernel<k3::attrs::MoeRouteExpertsMxfp4> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& logits, const Tensor<float>& bias,
                      const Tensor<float>& z, const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3,
                      const Tensor<uint8_t>& w2, const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                      const Tensor<uint8_t>& w2_scale, Tensor<float>& u) {
    std::string why;
    const auto s = route(a, logits, bias, z.Shape(), w1.Shape(), why);
    return s ? mxfp4_experts(ctx, a, z, slots(*s), w1, w3, w2, w1_scale, w3_scale, w2_scale, u)
             : fail(why);
  }
};

}  // namespace k3ort
