// k3::moe_route_experts: moe_route, then the experts on its slots in the same call (dense, MXFP4 or NVFP4:
// each binding calls the experts' kernel of its weights).
#pragma once

#include "moe_route.h"
#include "moe_experts.h"

namespace k3 {

// moe_route_experts (the router's, then the experts' checks on its slots): logits [N, E] of z's N and w1's E
inline std::string moe_route_experts_takes(const Dims& logits, const Dims& bias, int64_t top_k, const Dims& z,
                                           const Dims& w1) {
  if (auto why = moe_route_takes(logits, bias, top_k); !why.empty()) return why;
  if (z.size() != 2 || z[0] != logits[0] || w1.size() != 3 || w1[0] != logits[1])
    return "moe_route_experts: logits [N, E], z [N, D] and w1 [E, I, D] of one N and one E expected";
  return "";
}

// moe_route into buffers of its own: the routed slots of moe_route_experts (fusions.fuse_moe_route_experts), which
// hands them to the experts in the same call instead of through two nodes
struct Routed {
  Routed(const float* logits, const float* bias, int64_t N, int64_t E, int64_t top_k, bool renormalize, float scale)
      : shape{N, top_k}, weights(N * top_k), indices(N * top_k) {
    moe_route(logits, bias, weights.data(), indices.data(), N, E, top_k, renormalize, scale);
  }
  Dims shape;  // [N, top_k], of both
  std::vector<float> weights;
  std::vector<int64_t> indices;
};

}  // namespace k3
