// ONNX Runtime binding of the k3 ops (fp32, CPU): custom ops of domain "k3" whose names, inputs, outputs and
// attributes are the ONNX functions' (k3export/ops/spec.py), so ORT runs one kernel where it would otherwise expand
// the node's function body; and three kernels of standard-op patterns the session fuses (`attn_res_aggregate`,
// `mla_attend`, `short_conv`: k3export/converters/onnx/fusions.py). The kernels are k3_kernels.h; this file only
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

#include "k3_kernels.h"

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

struct SituGlu {
  SituGlu(const OrtApi*, const OrtKernelInfo* info)
      : beta1(attr<float>(info, "beta1")), beta2(attr<float>(info, "beta2")) {}
  Ort::Status Compute(const Tensor<float>& gate, const Tensor<float>& up, Tensor<float>& out) {
    if (gate.Shape() != up.Shape()) return fail("situ_glu: inputs 'gate' and 'up' of one shape expected");
    float* o = out.Allocate(gate.Shape());
    k3::situ_glu(gate.Data(), up.Data(), o, gate.NumberOfElement(), beta1, beta2);
    return Ort::Status{nullptr};
  }
  float beta1, beta2;
};

struct Kda {
  Kda(const OrtApi*, const OrtKernelInfo* info) : scale(attr<float>(info, "scale")) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v, const Tensor<float>& g,
                      const Tensor<float>& beta, const Tensor<float>& s0, Tensor<float>& o, Tensor<float>& s1) {
    const auto qs = q.Shape(), vs = v.Shape(), ss = s0.Shape(), bs = beta.Shape();
    if (qs.size() != 4 || k.Shape() != qs || g.Shape() != qs || vs.size() != 4)
      return fail("kda: q, k, g [B, T, H, K] and v [B, T, H, V] expected");
    const int64_t B = qs[0], T = qs[1], H = qs[2], K = qs[3], V = vs[3];
    if (vs[0] != B || vs[1] != T || vs[2] != H || bs != std::vector<int64_t>{B, T, H} ||
        ss != std::vector<int64_t>{B, H, K, V})
      return fail("kda: v [B, T, H, V], beta [B, T, H] and initial_state [B, H, K, V] expected");
    float* op = o.Allocate(vs);
    float* sp = s1.Allocate(ss);
    k3::kda(q.Data(), k.Data(), v.Data(), g.Data(), beta.Data(), s0.Data(), op, sp, B, T, H, K, V, scale,
            pool(ctx));
    return Ort::Status{nullptr};
  }
  float scale;
};

// Not an op of the export: `k3export.converters.onnx.fusions` writes it in place of the Attention-Residuals
// standard ops that graph.py's `aggregate` emits (the sources, each [..., N, D], before their Unsqueeze and Concat).
struct AttnResAggregate {
  AttnResAggregate(const OrtApi*, const OrtKernelInfo* info) : eps(attr<float>(info, "epsilon")) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& gw, const Ort::Custom::Variadic& sources,
                      Tensor<float>& out) {
    const int64_t S = static_cast<int64_t>(sources.Size());
    const auto gs = gw.Shape();
    if (S == 0 || gs.size() != 1) return fail("attn_res_aggregate: weight [D] and at least one source expected");
    const auto shape = sources[0]->Shape();
    const int64_t D = gs[0];
    std::vector<const float*> src(S);
    for (int64_t s = 0; s < S; ++s) {
      const auto& t = static_cast<const Tensor<float>&>(*sources[s]);
      if (t.Shape() != shape || shape.empty() || shape.back() != D)
        return fail("attn_res_aggregate: sources of one shape [..., D] expected, D the weight's length");
      src[s] = t.Data();
    }
    const int64_t rows = D == 0 ? 0 : static_cast<const Tensor<float>&>(*sources[0]).NumberOfElement() / D;
    k3::attn_res_aggregate(src.data(), S, gw.Data(), out.Allocate(shape), rows, D, eps, pool(ctx));
    return Ort::Status{nullptr};
  }
  float eps;
};

// Not an op of the export either: `fusions.fuse_mla_attend` writes it in place of the ``If`` that picks MLA's
// attention in one call or in blocks of queries (graph.py's `in_query_blocks`), whose branches both compute it.
struct MlaAttend {
  MlaAttend(const OrtApi*, const OrtKernelInfo* info)
      : scale(attr<float>(info, "scale")), fill(attr<float>(info, "fill")) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& q, const Tensor<float>& lat_t,
                      const Tensor<float>& c, const Tensor<bool>& visible,
                      std::optional<const Tensor<float>*> any_key, Tensor<float>& out) {
    const auto qs = q.Shape(), ls = lat_t.Shape(), cs = c.Shape(), vs = visible.Shape();
    if (qs.size() != 4 || ls.size() != 4 || cs.size() != 4 || ls[0] != qs[0] || ls[1] != 1 || ls[2] != qs[3] ||
        cs[0] != qs[0] || cs[1] != 1 || cs[2] != ls[3])
      return fail("mla_attend: q [B, H, T, R], latents [B, 1, R, S] and [B, 1, S, Dc] expected");
    const int64_t B = qs[0], H = qs[1], T = qs[2], R = qs[3], S = ls[3], Dc = cs[3];
    const bool per_batch = vs.size() == 4 && vs[0] == B && B > 1;
    const bool vis_ok = vs.size() == 2 ? vs == std::vector<int64_t>{T, S}
                                       : vs.size() == 4 && (vs[0] == B || vs[0] == 1) && vs[1] == 1 && vs[2] == T &&
                                             vs[3] == S;
    if (!vis_ok) return fail("mla_attend: visible [T, S] or [B, 1, T, S] expected");
    const float* ak = nullptr;
    if (any_key.has_value() && *any_key != nullptr) {
      if ((*any_key)->Shape() != std::vector<int64_t>{B, 1, T, 1})
        return fail("mla_attend: any_key [B, 1, T, 1] expected");
      ak = (*any_key)->Data();
    }
    k3::mla_attend(q.Data(), lat_t.Data(), c.Data(), visible.Data(), per_batch, ak,
                   out.Allocate({B, H, T, Dc}), B, H, T, R, S, Dc, scale, fill, pool(ctx));
    return Ort::Status{nullptr};
  }
  float scale, fill;
};

// Not an op of the export either: `fusions.fuse_short_conv` writes it in place of KDA's short convolution as graph.py
// writes it (graph.py's `short_conv`: the conv state transposed onto the new rows, a Mul per tap, SiLU, the new
// state's window, transposed back).
struct ShortConv {
  ShortConv(const OrtApi*, const OrtKernelInfo*) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& state, const Tensor<float>& x,
                      const Tensor<float>& taps, std::optional<const Tensor<int64_t>*> start, Tensor<float>& y,
                      Tensor<float>& present) {
    const auto ss = state.Shape(), xs = x.Shape(), ts = taps.Shape();
    if (ss.size() != 3 || xs.size() != 3 || ts.size() != 2 || ss[0] != xs[0] || ss[1] != xs[2] || ts[1] != xs[2] ||
        ts[0] != ss[2] + 1)
      return fail("short_conv: state [B, C, K-1], x [B, T, C] and taps [K, C] expected");
    const int64_t B = xs[0], T = xs[1], C = xs[2], K = ts[0];
    const int64_t* st = nullptr;
    if (start.has_value() && *start != nullptr) {
      if ((*start)->Shape() != std::vector<int64_t>{B}) return fail("short_conv: start [B] expected");
      st = (*start)->Data();
      for (int64_t b = 0; b < B; ++b)
        if (st[b] < 0 || st[b] > T) return fail("short_conv: input 'start' out of [0, T]");
    }
    k3::short_conv(state.Data(), x.Data(), taps.Data(), st, y.Allocate(xs), present.Allocate(ss), B, T, C, K,
                   pool(ctx));
    return Ort::Status{nullptr};
  }
};

// Not an op of the export either: `fusions.fuse_l2_norm` writes it in place of KDA's q / k L2 normalisation as
// graph.py writes it (graph.py's `l2norm`).
struct L2Norm {
  L2Norm(const OrtApi*, const OrtKernelInfo* info) : eps(attr<float>(info, "epsilon")) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& x, Tensor<float>& y) {
    const auto xs = x.Shape();
    if (xs.empty()) return fail("l2_norm: input of rank >= 1 expected");
    const int64_t n = xs.back(), rows = n == 0 ? 0 : x.NumberOfElement() / n;
    k3::l2_norm(x.Data(), y.Allocate(xs), rows, n, eps, pool(ctx));
    return Ort::Status{nullptr};
  }
  float eps;
};

struct MoeRoute {
  MoeRoute(const OrtApi*, const OrtKernelInfo* info)
      : top_k(attr<int64_t>(info, "top_k")), renormalize(attr<int64_t>(info, "renormalize") != 0),
        scale(attr<float>(info, "scale")) {}
  Ort::Status Compute(const Tensor<float>& logits, const Tensor<float>& bias, Tensor<float>& weights,
                      Tensor<int64_t>& indices) {
    const auto ls = logits.Shape();
    if (ls.size() != 2 || bias.Shape() != std::vector<int64_t>{ls[1]} || top_k < 1 || top_k > ls[1])
      return fail("moe_route: logits [N, E], bias [E] and 1 <= top_k <= E expected");
    const std::vector<int64_t> os{ls[0], top_k};
    k3::moe_route(logits.Data(), bias.Data(), weights.Allocate(os), indices.Allocate(os), ls[0], ls[1], top_k,
                  renormalize, scale);
    return Ort::Status{nullptr};
  }
  int64_t top_k;
  bool renormalize;
  float scale;
};

struct MoeExperts {
  MoeExperts(const OrtApi*, const OrtKernelInfo* info)
      : situ(attr<std::string>(info, "act") == "situ"), beta1(attr<float>(info, "beta1")),
        beta2(attr<float>(info, "beta2")) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& z, const Tensor<float>& weights, const Tensor<int64_t>& indices,
                      const Tensor<float>& w1, const Tensor<float>& w3, const Tensor<float>& w2, Tensor<float>& u) {
    const auto zs = z.Shape(), ws = weights.Shape(), s1 = w1.Shape(), s2 = w2.Shape();
    if (zs.size() != 2 || ws.size() != 2 || indices.Shape() != ws || ws[0] != zs[0] || s1.size() != 3 ||
        w3.Shape() != s1 || s1[2] != zs[1] || s2 != std::vector<int64_t>{s1[0], zs[1], s1[1]})
      return fail("moe_experts: z [N, D], weights / indices [N, top_k], w1 / w3 [E, I, D], w2 [E, D, I] expected");
    const int64_t* idx = indices.Data();
    for (int64_t i = 0; i < ws[0] * ws[1]; ++i)
      if (idx[i] < 0 || idx[i] >= s1[0]) return fail("moe_experts: input 'indices' out of [0, E)");
    k3::moe_experts(z.Data(), weights.Data(), idx, w1.Data(), w3.Data(), w2.Data(), u.Allocate(zs), zs[0], ws[1],
                    s1[0], zs[1], s1[1], situ, beta1, beta2, pool(ctx));
    return Ort::Status{nullptr};
  }
  bool situ;
  float beta1, beta2;
};

// The MXFP4 experts on the checkpoint's bytes (k3export/ops/spec.py MOE_EXPERTS_MXFP4). An export keeps them in
// its k3::moe_experts node as FLOAT4E2M1 / FLOAT8E8M0 initializers, which no kernel API here takes; a session with
// this library sees the same bytes typed uint8 on a node of this name (k3export.converters.onnx.mxfp4.packed_model).
struct MoeExpertsMxfp4 {
  MoeExpertsMxfp4(const OrtApi*, const OrtKernelInfo* info)
      : situ(attr<std::string>(info, "act") == "situ"), beta1(attr<float>(info, "beta1")),
        beta2(attr<float>(info, "beta2")) {}
  Ort::Status Compute(OrtKernelContext* ctx, const Tensor<float>& z, const Tensor<float>& weights,
                      const Tensor<int64_t>& indices, const Tensor<uint8_t>& w1, const Tensor<uint8_t>& w3,
                      const Tensor<uint8_t>& w2, const Tensor<uint8_t>& w1_scale, const Tensor<uint8_t>& w3_scale,
                      const Tensor<uint8_t>& w2_scale, Tensor<float>& u) {
    const auto zs = z.Shape(), ws = weights.Shape(), s1 = w1.Shape(), s2 = w2.Shape();
    if (zs.size() != 2 || ws.size() != 2 || indices.Shape() != ws || ws[0] != zs[0] || s1.size() != 3 ||
        s2.size() != 3)
      return fail("moe_experts_mxfp4: z [N, D], weights / indices [N, top_k], w1 / w3 [E, I, D/2], w2 [E, D, I/2] "
                  "expected");
    const int64_t E = s1[0], I = s1[1], D = zs[1];
    if (D % 32 || I % 32 || s1[2] * 2 != D || w3.Shape() != s1 || s2 != std::vector<int64_t>{E, D, I / 2} ||
        w1_scale.Shape() != std::vector<int64_t>{E, I, D / 32} || w3_scale.Shape() != w1_scale.Shape() ||
        w2_scale.Shape() != std::vector<int64_t>{E, D, I / 32})
      return fail("moe_experts_mxfp4: w1 / w3 [E, I, D/2] with scales [E, I, D/32], w2 [E, D, I/2] with scales "
                  "[E, D, I/32], D and I multiples of 32 expected");
    const int64_t* idx = indices.Data();
    for (int64_t i = 0; i < ws[0] * ws[1]; ++i)
      if (idx[i] < 0 || idx[i] >= E) return fail("moe_experts_mxfp4: input 'indices' out of [0, E)");
    k3::moe_experts_mxfp4(z.Data(), weights.Data(), idx, w1.Data(), w3.Data(), w2.Data(), w1_scale.Data(),
                          w3_scale.Data(), w2_scale.Data(), u.Allocate(zs), zs[0], ws[1], E, D, I, situ, beta1,
                          beta2, pool(ctx));
    return Ort::Status{nullptr};
  }
  bool situ;
  float beta1, beta2;
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
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<MoeExperts>("moe_experts", "CPUExecutionProvider"));
      ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp<MoeExpertsMxfp4>("moe_experts_mxfp4", "CPUExecutionProvider"));
      for (auto& op : ops) domain.Add(op.get());
    });
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
