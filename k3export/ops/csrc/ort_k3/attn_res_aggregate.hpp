// ONNX Runtime kernel k3::attn_res_aggregate over kernels/attn_res_aggregate.h (ort_k3.cpp registers it). A fused
// op: the exporter writes it in place of the Attention-Residuals standard ops that graph.py's `aggregate` emits (the
// sources, each [..., N, D], before their Unsqueeze and Concat).
#pragma once

#include "common.hpp"
#include "../kernels/attn_res_aggregate.h"

namespace k3ort {

struct AttnResAggregate : Kernel<k3::attrs::AttnResAggregate> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& gw, const Ort::Custom::Variadic& sources,
                      Tensor<float>& out) {
    std::vector<k3::Dims> shapes;
    std::vector<const float*> src;
    for (size_t s = 0; s < sources.Size(); ++s) {
      const auto& t = static_cast<const Tensor<float>&>(*sources[s]);
      shapes.push_back(t.Shape());
      src.push_back(t.Data());
    }
    if (auto why = k3::attn_res_aggregate_takes(gw.Shape(), shapes); !why.empty()) return fail(why);
    const int64_t D = gw.Shape()[0];
    const int64_t rows = D == 0 ? 0 : static_cast<const Tensor<float>&>(*sources[0]).NumberOfElement() / D;
    k3::attn_res_aggregate(src.data(), static_cast<int64_t>(src.size()), gw.Data(), out.Allocate(shapes[0]), rows, D,
                           a.epsilon, pool(ctx));
    return Ort::Status{nullptr};
  }
};

}  // namespace k3ort
