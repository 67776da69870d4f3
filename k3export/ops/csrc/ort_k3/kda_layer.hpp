// ONNX Runtime kernel k3::kda_layer over kernels/kda_layer.h (ort_k3.cpp registers it). A fused op: the exporter
// writes it in place of a short_conv, the split of its output into q, k and v, the l2_norm of q and k, and the kda
// that reads them.
#pragma once

#include "common.hpp"
#include "../kernels/kda_layer.h"

namespace k3ort {

struct KdaLayer : Kernel<k3::attrs::KdaLayer> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& state, const Tensor<float>& x,
                      const Tensor<float>& taps, const Tensor<float>& g, const Tensor<float>& beta,
                      const Tensor<float>& s0, std::optional<const Tensor<int64_t>*> start, Tensor<float>& o,
                      Tensor<float>& present, Tensor<float>& s1) {
    const auto ss = state.Shape(), xs = x.Shape(), gs = g.Shape(), s0s = s0.Shape();
    const OptionalIndex st(start);
    if (auto why = k3::kda_layer_takes(ss, xs, taps.Shape(), st.dims_or_null(), st.data, gs, beta.Shape(), s0s);
        !why.empty())
      return fail(why);
    const int64_t B = gs[0], T = gs[1], H = gs[2], K = gs[3], V = s0s[3];
    k3::kda_layer(state.Data(), x.Data(), taps.Data(), st.data, g.Data(), beta.Data(), s0.Data(),
                  o.Allocate({B, T, H, V}), present.Allocate(ss), s1.Allocate(s0s), B, T, ss[2] + 1, H, K, V, a.scale,
                  a.epsilon, pool(ctx));
    return Ort::Status{nullptr};
  }
};

}  // namespace k3ort
