// ONNX Runtime kernel k3::l2_norm over kernels/l2_norm.h (ort_k3.cpp registers it). A fused op: the exporter
// writes it in place of KDA's q / k L2 normalisation as graph.py writes it (graph.py's `l2norm`).
#pragma once

#include "common.hpp"
#include "../kernels/l2_norm.h"

namespace k3ort {

struct L2Norm : Kernel<k3::attrs::L2Norm> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& x, Tensor<float>& y) {
    const auto xs = x.Shape();
    if (auto why = k3::l2_norm_takes(xs); !why.empty()) return fail(why);
    const int64_t n = xs.back(), rows = n == 0 ? 0 : x.NumberOfElement() / n;
    k3::l2_norm(x.Data(), y.Allocate(xs), rows, n, a.epsilon, pool(ctx));
    return Ort::Status{nullptr};
  }
};

}  // namespace k3ort
