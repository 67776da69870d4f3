// ONNX Runtime kernel k3::moe_route over kernels/moe_route.h (ort_k3.cpp registers it).
#pragma once

#include "common.hpp"
#include "../kernels/moe_route.h"

namespace k3ort {

struct MoeRoute : Kernel<k3::attrs::MoeRoute> {
  using Kernel::Kernel;
  Ort::Status Compute(const Tensor<float>& logits, const Tensor<float>& bias, Tensor<float>& weights,
                      Tensor<int64_t>& indices) {
    const auto ls = logits.Shape();
    if (auto why = k3::moe_route_takes(ls, bias.Shape(), a.top_k); !why.empty()) return fail(why);
    const std::vector<int64_t> os{ls[0], a.top_k};
    k3::moe_route(logits.Data(), bias.Data(), weights.Allocate(os), indices.Allocate(os), ls[0], ls[1], a.top_k,
                  a.renormalize != 0, a.scale);
    return Ort::Status{nullptr};
  }
};

}  // namespace k3ort
