// ONNX Runtime binding of the k3 ops (fp32, CPU): custom ops of domain "k3" whose names, inputs, outputs and
// attributes are the ONNX functions' (k3export/ops/spec.py), so ORT runs one kernel where it would otherwise expand
// the node's function body, the fused ops the exporter writes included (spec.py's FUSED_SPECS, matched by
// k3export/converters/onnx/fusions.py). The kernels, and the shapes each takes, are kernels/<op>.h; this file only
// maps ORT tensors onto them.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT
#include <onnxruntime_lite_custom_op.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kernels/attn_res_aggregate.h"
#include "kernels/kda.h"
#include "kernels/l2_norm.h"
#include "kernels/mla_attend.h"
#include "kernels/moe_experts.h"
#include "kernels/moe_experts_mxfp4.h"
#include "kernels/moe_experts_nvfp4.h"
#include "kernels/moe_route.h"
#include "kernels/moe_route_experts.h"
#include "kernels/short_conv.h"
#include "kernels/kda_layer.h"
#include "kernels/situ_glu.h"

namespace {

using Ort::Custom::Tensor;

Ort::Status fail(const std::string& msg) { return Ort::Status(("k3::" + msg).c_str(), ORT_INVALID_ARGUMENT); }

// k3::Parallel on ORT's intra-op thread pool: [0, n) in up to 16 ranges, one ParallelFor task each
struct Ranges {
  int64_t n, parts;
  const std::function<void(int64_t, int64_t)>* body;
};

void ort_run(void* ctx, int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  Ranges r{n, std::min<int64_t>(n, 16), &body};
  Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(
      static_cast<const OrtKernelContext*>(ctx),
      [](void* data, size_t i) {
        const auto* r = static_cast<const Ranges*>(data);
        const int64_t lo = r->n * static_cast<int64_t>(i) / r->parts, hi = r->n * (static_cast<int64_t>(i) + 1) / r->parts;
        (*r->body)(lo, hi);
      },
      static_cast<size_t>(r.parts), 0, &r));
}

k3::Parallel pool(OrtKernelContext* ctx) { return k3::Parallel{&ort_run, ctx}; }

template <typename T>
T attr(const OrtKernelInfo* info, const char* name) {
  return Ort::ConstKernelInfo(info).GetAttribute<T>(name);
}

// An optional index input as the kernels take it: its values and shape, or nulls where it is not given
struct OptionalIndex {
  explicit OptionalIndex(std::optional<const Tensor<int64_t>*> t) {
    if (t.has_value() && *t != nullptr) data = (*t)->Data(), shape = (*t)->Shape();
  }
  const k3::Dims* dims_or_null() const { return data ? &shape : nullptr; }
  const int64_t* data = nullptr;
  k3::Dims shape;
};

struct SituGlu {
  SituGlu(const OrtApi*, const OrtKernelInfo* info)
      : beta1(attr<float>(info, "beta1")), beta2(attr<float>(info, "beta2")) {}
  Ort::Status Compute(const Tensor<float>& gate, const Tensor<float>& up, Tensor<float>& out) {
    if (auto why = k3::situ_glu_takes(gate.Shape(), up.Shape()); !why.empty()) return fail(why);
    k3::situ_glu(gate.Data(), up.Data(), out.Allocate(gate.Shape()), gate.NumberOfElement(), beta1, beta2);
    return Ort::Status{nullptr};
  }
  float beta1, beta2;
};

struct Kda {
  Kda(const OrtApi*, const OrtKernelInfo* info) : scale(attr<float>(info, "scale")) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v, const Tensor<float>& g,
                      const Tensor<float>& beta, const Tensor<float>& s0, Tensor<float>& o, Tensor<float>& s1) {
    const auto qs = q.Shape(), vs = v.Shape(), ss = s0.Shape();
    if (auto why = k3::kda_takes(qs, k.Shape(), vs, g.Shape(), beta.Shape(), ss); !why.empty()) return fail(why);
    k3::kda(q.Data(), k.Data(), v.Data(), g.Data(), beta.Data(), s0.Data(), o.Allocate(vs), s1.Allocate(ss), qs[0],
            qs[1], qs[2], qs[3], vs[3], scale, pool(ctx));
    return Ort::Status{nullptr};
  }
  float scale;
};

// A fused op: the exporter writes it (`k3export.converters.onnx.fusions`) in place of the Attention-Residuals
// standard ops that graph.py's `aggregate` emits (the sources, each [..., N, D], before their Unsqueeze and Concat).
struct AttnResAggregate {
  AttnResAggregate(const OrtApi*, const OrtKernelInfo* info) : eps(attr<float>(info, "epsilon")) {}
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
                           eps, pool(ctx));
    return Ort::Status{nullptr};
  }
  float eps;
};

// A fused op: the exporter writes it (`fusions.fuse_mla_attend`) in place of the ``If`` that picks MLA's
// attention in one call or in blocks of queries (graph.py's `in_query_blocks`), whose branches both compute it.
// Inputs 1 and 2: the latents transposed and their first value_dim features, or (halves = 1) the cache's key and
// value halves themselves (`k3::MlaCache`).
struct MlaAttend {
  MlaAttend(const OrtApi*, const OrtKernelInfo* info)
      : scale(attr<float>(info, "scale")), fill(attr<float>(info, "fill")), halves(attr<int64_t>(info, "halves")),
        value_dim(attr<int64_t>(info, "value_dim")) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& q, const Tensor<float>& a, const Tensor<float>& b,
                      const Tensor<bool>& visible, std::optional<const Tensor<float>*> any_key, Tensor<float>& out) {
    const auto qs = q.Shape(), as = a.Shape(), bs = b.Shape(), vs = visible.Shape();
    const Tensor<float>* ak = any_key.has_value() ? *any_key : nullptr;
    const k3::Dims ak_shape = ak ? ak->Shape() : k3::Dims{};
    if (auto why = k3::mla_attend_takes(qs, as, bs, vs, ak ? &ak_shape : nullptr, halves, value_dim); !why.empty())
      return fail(why);
    const int64_t B = qs[0], H = qs[1], T = qs[2];
    const auto [cache, S, Dc] = k3::mla_inputs(halves, value_dim, a.Data(), as, b.Data(), bs);
    k3::mla_attend(q.Data(), cache, visible.Data(), vs.size() == 4 && vs[0] == B && B > 1, ak ? ak->Data() : nullptr,
                   out.Allocate({B, H, T, Dc}), B, H, T, qs[3], S, Dc, scale, fill, pool(ctx));
    return Ort::Status{nullptr};
  }
  float scale, fill;
  int64_t halves, value_dim;
};

// A fused op: the exporter writes it (`fusions.fuse_short_conv`) in place of KDA's short convolution as graph.py
// writes it (graph.py's `short_conv`: the conv state transposed onto the new rows, a Mul per tap, SiLU, the new
// state's window, transposed back).
struct ShortConv {
  ShortConv(const OrtApi*, const OrtKernelInfo*) {}
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

// A fused op: the exporter writes it (`fusions.fuse_kda_layer`) in place of a short_conv, the split of its
// output into q, k and v, the l2_norm of q and k, and the kda that reads them.
struct KdaLayer {
  KdaLayer(const OrtApi*, const OrtKernelInfo* info)
      : scale(attr<float>(info, "scale")), eps(attr<float>(info, "epsilon")) {}
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
                       o.Allocate({B, T, H, V}), present.Allocate(ss), s1.Allocate(s0s), B, T, ss[2] + 1, H, K, V,
                       scale, eps, pool(ctx));
    return Ort::Status{nullptr};
  }
  float scale, eps;
};

// A fused op: the exporter writes it (`fusions.fuse_l2_norm`) in place of KDA's q / k L2 normalisation as
// graph.py writes it (graph.py's `l2norm`).
struct L2Norm {
  L2Norm(const OrtApi*, const OrtKernelInfo* info) : eps(attr<float>(info, "epsilon")) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& x, Tensor<float>& y) {
    const auto xs = x.Shape();
    if (auto why = k3::l2_norm_takes(xs); !why.empty()) return fail(why);
    const int64_t n = xs.back(), rows = n == 0 ? 0 : x.NumberOfElement() / n;
    k3::l2_norm(x.Data(), y.Allocate(xs), rows, n, eps, pool(ctx));
    return Ort::Status{nullptr};
  }
  float eps;
};

// moe_route's attributes (and the fused moe_route_experts')
struct RouteAttrs {
  explicit RouteAttrs(const OrtKernelInfo* info)
      : top_k(attr<int64_t>(info, "top_k")), renormalize(attr<int64_t>(info, "renormalize") != 0),
        scale(attr<float>(info, "scale")) {}
  int64_t top_k;
  bool renormalize;
  float scale;
};

// An attribute the node may leave out: `otherwise` then
template <typename T>
T attr_or(const OrtKernelInfo* info, const char* name, T otherwise) {
  try {
    return attr<T>(info, name);
  } catch (const Ort::Exception&) {
    return otherwise;
  }
}

// moe_experts' attributes (and the fused moe_route_experts'); quantize_activations: the MXFP4 kernel's only
// (k3export/ops/spec.py MOE_EXPERTS_MXFP4), 0 where the node leaves it out
struct ExpertsAttrs {
  explicit ExpertsAttrs(const OrtKernelInfo* info)
      : situ(attr<std::string>(info, "act") == "situ"), beta1(attr<float>(info, "beta1")),
        beta2(attr<float>(info, "beta2")),
        quantize_activations(attr_or<int64_t>(info, "quantize_activations", 0) != 0) {}
  bool situ;
  float beta1, beta2;
  bool quantize_activations;
};

// Routed slots as the experts take them: weights and indices [N, top_k] (`ws`, `is`: their shapes)
struct Slots {
  const float* weights;
  const int64_t* indices;
  k3::Dims ws, is;
};

Ort::Status dense_experts(OrtKernelContext* ctx, const char* op, const ExpertsAttrs& a, const Tensor<float>& z,
                          const Slots& s, const Tensor<float>& w1, const Tensor<float>& w3, const Tensor<float>& w2,
                          Tensor<float>& u) {
  const auto zs = z.Shape(), s1 = w1.Shape();
  if (auto why = k3::moe_experts_takes(op, zs, s.ws, s.is, s1, w3.Shape(), w2.Shape(), s.indices); !why.empty())
    return fail(why);
  k3::moe_experts(z.Data(), s.weights, s.indices, w1.Data(), w3.Data(), w2.Data(), u.Allocate(zs), zs[0], s.ws[1],
                  s1[0], zs[1], s1[1], a.situ, a.beta1, a.beta2, pool(ctx));
  return Ort::Status{nullptr};
}

// The MXFP4 experts on the checkpoint's bytes (k3export/ops/spec.py MOE_EXPERTS_MXFP4). An export keeps them in
// its k3::moe_experts node as FLOAT4E2M1 / FLOAT8E8M0 initializers, which no kernel API here takes; a session with
// this library sees the same bytes typed uint8 on a node of this name (k3export.artifacts.expert_views.packed_view).
Ort::Status mxfp4_experts(OrtKernelContext* ctx, const char* op, const ExpertsAttrs& a, const Tensor<float>& z,
                          const Slots& s, const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3,
                          const Tensor<uint8_t>& w2, const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                          const Tensor<uint8_t>& w2_scale, Tensor<float>& u) {
  // two E2M1 codes a byte: the weights' element counts double the last axis of their bytes
  auto elements = [](k3::Dims d) { if (!d.empty()) d.back() *= 2; return d; };
  const auto zs = z.Shape(), s1 = elements(w1.Shape());
  if (auto why = k3::moe_experts_takes(op, zs, s.ws, s.is, s1, elements(w3.Shape()), elements(w2.Shape()), s.indices,
                                       {w1_scale.Shape(), w3_scale.Shape(), w2_scale.Shape()});
      !why.empty())
    return fail(why);
  k3::moe_experts_mxfp4(z.Data(), s.weights, s.indices, w1.Data(), w3.Data(), w2.Data(), w1_scale.Data(),
                        w3_scale.Data(), w2_scale.Data(), u.Allocate(zs), zs[0], s.ws[1], s1[0], zs[1], s1[1], a.situ,
                        a.beta1, a.beta2, pool(ctx), a.quantize_activations);
  return Ort::Status{nullptr};
}

// The NVFP4 experts on NVIDIA's bytes (k3export/ops/spec.py MOE_EXPERTS_NVFP4): FLOAT4E2M1 / FLOAT8E4M3FN in the
// export, typed uint8 here (k3export.artifacts.expert_views.packed_view), and fp32 global scales [E].
Ort::Status nvfp4_experts(OrtKernelContext* ctx, const char* op, const ExpertsAttrs& a, const Tensor<float>& z,
                          const Slots& s, const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3,
                          const Tensor<uint8_t>& w2, const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                          const Tensor<uint8_t>& w2_scale, const Tensor<float>& g1, const Tensor<float>& g3,
                          const Tensor<float>& g2, Tensor<float>& u) {
  auto elements = [](k3::Dims d) { if (!d.empty()) d.back() *= 2; return d; };
  const auto zs = z.Shape(), s1 = elements(w1.Shape());
  if (auto why = k3::moe_experts_takes(op, zs, s.ws, s.is, s1, elements(w3.Shape()), elements(w2.Shape()), s.indices);
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
                        s.ws[1], E, D, I, a.situ, a.beta1, a.beta2, pool(ctx));
  return Ort::Status{nullptr};
}

struct MoeRoute {
  MoeRoute(const OrtApi*, const OrtKernelInfo* info) : a(info) {}
  Ort::Status Compute(const Tensor<float>& logits, const Tensor<float>& bias, Tensor<float>& weights,
                      Tensor<int64_t>& indices) {
    const auto ls = logits.Shape();
    if (auto why = k3::moe_route_takes(ls, bias.Shape(), a.top_k); !why.empty()) return fail(why);
    const std::vector<int64_t> os{ls[0], a.top_k};
    k3::moe_route(logits.Data(), bias.Data(), weights.Allocate(os), indices.Allocate(os), ls[0], ls[1], a.top_k,
                  a.renormalize, a.scale);
    return Ort::Status{nullptr};
  }
  RouteAttrs a;
};

struct MoeExperts {
  MoeExperts(const OrtApi*, const OrtKernelInfo* info) : a(info) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& z, const Tensor<float>& weights,
                      const Tensor<int64_t>& indices, const Tensor<float>& w1, const Tensor<float>& w3,
                      const Tensor<float>& w2, Tensor<float>& u) {
    return dense_experts(ctx, "moe_experts", a, z, {weights.Data(), indices.Data(), weights.Shape(), indices.Shape()},
                         w1, w3, w2, u);
  }
  ExpertsAttrs a;
};

struct MoeExpertsNvfp4 {
  MoeExpertsNvfp4(const OrtApi*, const OrtKernelInfo* info) : a(info) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& z, const Tensor<float>& weights,
                      const Tensor<int64_t>& indices, const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3,
                      const Tensor<uint8_t>& w2, const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                      const Tensor<uint8_t>& w2_scale, const Tensor<float>& g1, const Tensor<float>& g3,
                      const Tensor<float>& g2, Tensor<float>& u) {
    return nvfp4_experts(ctx, "moe_experts_nvfp4", a, z,
                         {weights.Data(), indices.Data(), weights.Shape(), indices.Shape()}, w1, w3, w2, w1_scale,
                         w3_scale, w2_scale, g1, g3, g2, u);
  }
  ExpertsAttrs a;
};

struct MoeExpertsMxfp4 {
  MoeExpertsMxfp4(const OrtApi*, const OrtKernelInfo* info) : a(info) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& z, const Tensor<float>& weights,
                      const Tensor<int64_t>& indices, const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3,
                      const Tensor<uint8_t>& w2, const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                      const Tensor<uint8_t>& w2_scale, Tensor<float>& u) {
    return mxfp4_experts(ctx, "moe_experts_mxfp4", a, z,
                         {weights.Data(), indices.Data(), weights.Shape(), indices.Shape()}, w1, w3, w2, w1_scale,
                         w3_scale, w2_scale, u);
  }
  ExpertsAttrs a;
};

// Fused ops: the exporter writes them (`fusions.fuse_moe_route_experts`) in place of a moe_route whose weights
// and indices only a moe_experts (moe_experts_mxfp4) reads: the router's inputs, then the experts' but those two.
// The slots stay in the call (`k3::Routed`); `route` gives none where the inputs do not fit, and `why` says why.
std::optional<k3::Routed> route(const RouteAttrs& a, const Tensor<float>& logits, const Tensor<float>& bias,
                                const k3::Dims& z, const k3::Dims& w1, std::string& why) {
  const auto ls = logits.Shape();
  why = k3::moe_route_experts_takes(ls, bias.Shape(), a.top_k, z, w1);
  if (!why.empty()) return std::nullopt;
  return k3::Routed(logits.Data(), bias.Data(), ls[0], ls[1], a.top_k, a.renormalize, a.scale);
}

Slots slots(const k3::Routed& s) { return {s.weights.data(), s.indices.data(), s.shape, s.shape}; }

struct MoeRouteExperts {
  MoeRouteExperts(const OrtApi*, const OrtKernelInfo* info) : r(info), a(info) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& logits, const Tensor<float>& bias,
                      const Tensor<float>& z, const Tensor<float>& w1, const Tensor<float>& w3,
                      const Tensor<float>& w2, Tensor<float>& u) {
    std::string why;
    const auto s = route(r, logits, bias, z.Shape(), w1.Shape(), why);
    return s ? dense_experts(ctx, "moe_route_experts", a, z, slots(*s), w1, w3, w2, u) : fail(why);
  }
  RouteAttrs r;
  ExpertsAttrs a;
};

struct MoeRouteExpertsMxfp4 {
  MoeRouteExpertsMxfp4(const OrtApi*, const OrtKernelInfo* info) : r(info), a(info) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& logits, const Tensor<float>& bias,
                      const Tensor<float>& z, const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3,
                      const Tensor<uint8_t>& w2, const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                      const Tensor<uint8_t>& w2_scale, Tensor<float>& u) {
    std::string why;
    const auto s = route(r, logits, bias, z.Shape(), w1.Shape(), why);
    return s ? mxfp4_experts(ctx, "moe_route_experts_mxfp4", a, z, slots(*s), w1, w3, w2, w1_scale, w3_scale,
                             w2_scale, u)
             : fail(why);
  }
  RouteAttrs r;
  ExpertsAttrs a;
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  // the ops and their domain live as long as the process: ORT keeps pointers to them in every session
  static std::vector<std::unique_ptr<OrtCustomOp>> ops;
  static Ort::CustomOpDomain domain{nullptr};
  static std::once_flag once;
  try {
    std::call_once(once, [] {
      domain = Ort::CustomOpDomain("k3");
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<SituGlu>("situ_glu", "CPUExecutionProvider"));
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<Kda>("kda", "CPUExecutionProvider"));
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<MoeRoute>("moe_route", "CPUExecutionProvider"));
      ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp<AttnResAggregate>("attn_res_aggregate", "CPUExecutionProvider"));
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<MlaAttend>("mla_attend", "CPUExecutionProvider"));
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<ShortConv>("short_conv", "CPUExecutionProvider"));
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<L2Norm>("l2_norm", "CPUExecutionProvider"));
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<KdaLayer>("kda_layer", "CPUExecutionProvider"));
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<MoeExperts>("moe_experts", "CPUExecutionProvider"));
      ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp<MoeExpertsMxfp4>("moe_experts_mxfp4", "CPUExecutionProvider"));
      ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp<MoeExpertsNvfp4>("moe_experts_nvfp4", "CPUExecutionProvider"));
      ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp<MoeRouteExperts>("moe_route_experts", "CPUExecutionProvider"));
      ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp<MoeRouteExpertsMxfp4>("moe_route_experts_mxfp4", "CPUExecutionProvider"));
      for (auto& op : ops) domain.Add(op.get());
    });
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
