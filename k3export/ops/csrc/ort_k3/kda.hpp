// ONNX Runtime kernel k3::kda over kernels/kda.h (ort_k3.cpp registers it).
#pragma once

#include "common.hpp"
#include "../kernels/kda.h"

namespace k3ort {

struct Kda : Kernel<k3::attrs::Kda> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v,
                      const Tensor<float>& g, const Tensor<float>& beta, const Tensor<float>& s0, Tensor<float>& o,
                      Tensor<float>& s1) {
    const auto qs = q.Shape(), vs = v.Shape(), ss = s0.Shape();
    if (auto why = k3::kda_takes(qs, k.Shape(), vs, g.Shape(), beta.Shape(), ss); !why.empty()) return fail(why);
    k3::kda(q.Data(), k.Data(), v.Data(), g.Data(), beta.Data(), s0.Data(), o.Allocate(vs), s1.Allocate(ss), qs[0],
            qs[1], qs[2], qs[3], vs[3], a.scale, pool(ctx));
    return Ort::Status{nullptr};
  }
};

}  // namespace k3ort
