// ONNX Runtime kernels k3::moe_experts (fp32), k3::moe_experts_mxfp4 and k3::moe_experts_nvfp4 over
// kernels/moe_experts*.h (ort_k3.cpp registers them), and the experts' call on routed slots that the fused
// moe_route_experts shares.
#pragma once

#include "common.hpp"
#include "../kernels/moe_experts.h"
#include "../kernels/moe_experts_mxfp4.h"
#include "../kernels/moe_experts_nvfp4.h"

namespace k3ort {

// Routed slots as the experts take them: weights and indices [N, top_k] (`ws`, `is`: their shapes)
struct Slots {
  const float* weights;
  const int64_t* indices;
  k3::Dims ws, is;
};

Slots slots(const Tensor<float>& weights, const Tensor<int64_t>& indices) {
  return {weights.Data(), indices.Data(), weights.Shape(), indices.Shape()};
}

// A node's act attribute as the kernels take it
template <class Attrs>
bool situ(const Attrs& a) { return a.act == "situ"; }

// Two E2M1 codes a byte: the weights' element counts double the last axis of their bytes
k3::Dims elements(k3::Dims d) {
  if (!d.empty()) d.back() *= 2;
  return d;
}

template <class Attrs>
Ort::Status dense_experts(OrtKernelContext* ctx, const Attrs& a, const Tensor<float>& z, const Slots& s,
                          const Tensor<float>& w1, const Tensor<float>& w3, const Tensor<float>& w2,
                          Tensor<float>& u) {
  const auto zs = z.Shape(), s1 = w1.Shape();
  if (auto why = k3::moe_experts_takes(Attrs::name, zs, s.ws, s.is, s1, w3.Shape(), w2.Shape(), s.indices);
      !why.empty())
    return fail(why);
  k3::moe_experts(z.Data(), s.weights, s.indices, w1.Data(), w3.Data(), w2.Data(), u.Allocate(zs), zs[0], s.ws[1],
                  s1[0], zs[1], s1[1], situ(a), a.beta1, a.beta2, pool(ctx));
  return Ort::Status{nullptr};
}

// The MXFP4 experts on the checkpoint's bytes (k3export/ops/spec.py MOE_EXPERTS_MXFP4). An export keeps them as
// FLOAT4E2M1 / FLOAT8E8M0 initializers, which ORT hands no custom op; a session with this library sees the same
// bytes typed uint8 on a node of this name (k3export.artifacts.expert_views.packed_view).
template <class Attrs>
Ort::Status mxfp4_experts(OrtKernelContext* ctx, const Attrs& a, const Tensor<float>& z, const Slots& s,
                          const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3, const Tensor<uint8_t>& w2,
                          const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                          const Tensor<uint8_t>& w2_scale, Tensor<float>& u) {
  const auto zs = z.Shape(), s1 = elements(w1.Shape());
  if (auto why = k3::moe_experts_takes(Attrs::name, zs, s.ws, s.is, s1, elements(w3.Shape()), elements(w2.Shape()),
                                       s.indices, {w1_scale.Shape(), w3_scale.Shape(), w2_scale.Shape()});
      !why.empty())
    return fail(why);
  k3::moe_experts_mxfp4(z.Data(), s.weights, s.indices, w1.Data(), w3.Data(), w2.Data(), w1_scale.Data(),
                        w3_scale.Data(), w2_scale.Data(), u.Allocate(zs), zs[0], s.ws[1], s1[0], zs[1], s1[1], situ(a),
                        a.beta1, a.beta2, pool(ctx), a.quantize_activations != 0);
  return Ort::Status{nullptr};
}

struct MoeExperts : Kernel<k3::attrs::MoeExperts> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& z, const Tensor<float>& weights,
                      const Tensor<int64_t>& indices, const Tensor<float>& w1, const Tensor<float>& w3,
                      const Tensor<float>& w2, Tensor<float>& u) {
    return dense_experts(ctx, a, z, slots(weights, indices), w1, w3, w2, u);
  }
};

struct MoeExpertsMxfp4 : Kernel<k3::attrs::MoeExpertsMxfp4> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& z, const Tensor<float>& weights,
                      const Tensor<int64_t>& indices, const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3,
                      const Tensor<uint8_t>& w2, const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                      const Tensor<uint8_t>& w2_scale, Tensor<float>& u) {
    return mxfp4_experts(ctx, a, z, slots(weights, indices), w1, w3, w2, w1_scale, w3_scale, w2_scale, u);
  }
};

// The NVFP4 experts on NVIDIA's bytes (k3export/ops/spec.py MOE_EXPERTS_NVFP4): FLOAT4E2M1 / FLOAT8E4M3FN in the
// export, typed uint8 here (k3export.artifacts.expert_views.packed_view), and fp32 global scales [E].
struct MoeExpertsNvfp4 : Kernel<k3::attrs::MoeExpertsNvfp4> {
  using Kernel::Kernel;
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& z, const Tensor<float>& weights,
                      const Tensor<int64_t>& indices, const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3,
                      const Tensor<uint8_t>& w2, const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                      const Tensor<uint8_t>& w2_scale, const Tensor<float>& g1, const Tensor<float>& g3,
                      const Tensor<float>& g2, Tensor<float>& u) {
    const char* op = Attrs::name;
    const Slots s = slots(weights, indices);
    const auto zs = z.Shape(), s1 = elements(w1.Shape());
    if (auto why = k3::moe_experts_takes(op, zs, s.ws, s.is, s1, elements(w3.Shape()), elements(w2.Shape()),
                                         s.indices);
        !why.empty())
      return fail(why);
    const int64_t E = s1[0], I = s1[1], D = s1[2];
    const k3::Dims e{E};
    if (D % 32 || I % 32 || w1_scale.Shape() != k3::Dims{E, I, D / 16} || w3_scale.Shape() != w1_scale.Shape() ||
        w2_scale.Shape() != k3::Dims{E, D, I / 16} || g1.Shape() != e || g3.Shape() != e || g2.Shape() != e)
      return fail(std::string(op) + ": scales [E, I, D/16] and [E, D, I/16], global scales [E], D and I multiples of "
                                    "32 expected");
    k3::moe_experts_nvfp4(z.Data(), s.weights, s.indices, w1.Data(), w3.Data(), w2.Data(), w1_scale.Data(),
                          w3_scale.Data(), w2_scale.Data(), g1.Data(), g3.Data(), g2.Data(), u.Allocate(zs), zs[0],
                          s.ws[1], E, D, I, situ(a), a.beta1, a.beta2, pool(ctx));
    return Ort::Status{nullptr};
  }
};

}  // namespace k3ort
