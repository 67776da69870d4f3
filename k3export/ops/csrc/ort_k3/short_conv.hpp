// ONNX Runtime kernel k3::short_conv over kernels/short_conv.h (ort_k3.cpp registers it). A fused op: the exporter
// writes it in place of KDA's short convolution as graph.py writes it (the conv state transposed onto the new rows,
// a Mul per tap, SiLU, the new state's window, transposed back).
#pragma once

#include "common.hpp"
#include "../kernels/short_conv.h"

namespace k3ort {

struct ShortConv : Kernel<k3::attrs::ShortConv> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& state, const Tensor<float>& x,
                      const Tensor<float>& taps, std::optional<const Tensor<int64_t>*> start, Tensor<float>& y,
                      Tensor<float>& present) {
    const auto ss = state.Shape(), xs = x.Shape(), ts = taps.Shape();
    const OptionalIndex st(start);
    if (auto why = k3::short_conv_takes(ss, xs, ts, st.dims_or_null(), st.data); !why.empty()) return fail(why);
    k3::short_conv(state.Data(), x.Data(), taps.Data(), st.data, y.Allocate(xs), present.Allocate(ss), xs[0], xs[1],
                   xs[2], ts[0], pool(ctx));
    return Ort::Status{nullptr};
  }
};

}  // namespace k3ort
