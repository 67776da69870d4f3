// ONNX Runtime kernel k3::mla_attend over kernels/mla_attend.h (ort_k3.cpp registers it). A fused op: the exporter
// writes it in place of the ``If`` that picks MLA's attention in one call or in blocks of queries (graph.py's
// `in_query_blocks`), whose branches both compute it. Inputs 1 and 2: the latents transposed and their first
// value_dim features, or (halves = 1) the cache's key and value halves themselves (`k3::MlaCache`).
#pragma once

#include "common.hpp"
#include "../kernels/mla_attend.h"

namespace k3ort {

struct MlaAttend : Kernel<k3::attrs::MlaAttend> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& q, const Tensor<float>& lat, const Tensor<float>& b,
                      const Tensor<bool>& visible, std::optional<const Tensor<float>*> any_key, Tensor<float>& out) {
    const auto qs = q.Shape(), as = lat.Shape(), bs = b.Shape(), vs = visible.Shape();
    const Tensor<float>* ak = any_key.has_value() ? *any_key : nullptr;
    const k3::Dims ak_shape = ak ? ak->Shape() : k3::Dims{};
    if (auto why = k3::mla_attend_takes(qs, as, bs, vs, ak ? &ak_shape : nullptr, a.halves, a.value_dim);
        !why.empty())
      return fail(why);
    const int64_t B = qs[0], H = qs[1], T = qs[2];
    const auto [cache, S, Dc] = k3::mla_inputs(a.halves, a.value_dim, lat.Data(), as, b.Data(), bs);
    k3::mla_attend(q.Data(), cache, visible.Data(), vs.size() == 4 && vs[0] == B && B > 1, ak ? ak->Data() : nullptr,
                   out.Allocate({B, H, T, Dc}), B, H, T, qs[3], S, Dc, a.scale, a.fill, pool(ctx));
    return Ort::Status{nullptr};
  }
};

}  // namespace k3ort
