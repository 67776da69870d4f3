// CPU kernels for four of the modeling file's hooks, fp32 only: `kda_layer` for one token, `attn_res_aggregate`,
// `rms_norm` and `moe_route`. Each replaces a string of ~5-30 small PyTorch operators, which cost 4-6 us apiece in a
// decode step. The maths and tensor layouts are the PyTorch functions' in modeling_k3.py, which are the reference;
// `attn_res_aggregate` and `moe_route` bind the kernels the ONNX Runtime and OpenVINO libraries share (kernels/).
#include <torch/extension.h>

#include "kernels/attn_res_aggregate.h"
#include "kernels/moe_route.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void check_fp32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": expected a float32 CPU tensor");
}

}  // namespace

// One token: qkv [B, 1, 3HK], conv_weight [3HK, 1, W], conv_state [B, 3HK, W-1], g [B, 1, H, K] log-decay,
// b [B, 1, H], gate [B, 1, HK], state [B, H, K, K]; o_norm_weight [K]. Returns (o [B, 1, H, K], conv state, state).
std::vector<at::Tensor> kda_layer(at::Tensor qkv, at::Tensor conv_weight, at::Tensor conv_state, at::Tensor g,
                                  at::Tensor b, at::Tensor gate, at::Tensor state, at::Tensor o_norm_weight,
                                  double o_norm_eps) {
  for (auto* t : {&qkv, &conv_weight, &conv_state, &g, &b, &gate, &state, &o_norm_weight}) *t = t->contiguous();
  check_fp32(qkv, "qkv");
  check_fp32(state, "state");
  const int64_t B = qkv.size(0), C = qkv.size(2), W = conv_weight.size(-1), H = g.size(-2), K = g.size(-1);
  TORCH_CHECK(qkv.size(1) == 1 && C == 3 * H * K && state.size(1) == H && state.size(2) == K && state.size(3) == K,
              "kda_layer: one token of q|k|v [B, 1, 3HK] and a state [B, H, K, K] expected");
  auto y = at::empty({C}, qkv.options());
  auto new_conv = at::empty({B, C, W - 1}, qkv.options());
  auto new_state = at::empty_like(state);
  auto o = at::empty({B, 1, H, K}, qkv.options());
  std::vector<float> kv(K), acc(K);
  const float scale = 1.f / std::sqrt(static_cast<float>(K));
  const float* w = conv_weight.data_ptr<float>();
  const float* nw = o_norm_weight.data_ptr<float>();
  for (int64_t bi = 0; bi < B; ++bi) {
    const float* x = qkv.data_ptr<float>() + bi * C;
    const float* cs = conv_state.data_ptr<float>() + bi * C * (W - 1);
    float* ncs = new_conv.data_ptr<float>() + bi * C * (W - 1);
    float* yp = y.data_ptr<float>();
    for (int64_t c = 0; c < C; ++c) {  // causal depthwise conv over [state | x], then SiLU
      const float* s = cs + c * (W - 1);
      float a = 0.f;
      for (int64_t j = 0; j < W - 1; ++j) a += s[j] * w[c * W + j];
      a += x[c] * w[c * W + W - 1];
      yp[c] = a / (1.f + std::exp(-a));
      for (int64_t j = 0; j + 1 < W - 1; ++j) ncs[c * (W - 1) + j] = s[j + 1];
      ncs[c * (W - 1) + W - 2] = x[c];
    }
    for (int64_t h = 0; h < H; ++h) {
      float* q = yp + h * K;
      float* k = yp + (H + h) * K;
      const float* v = yp + (2 * H + h) * K;
      for (float* u : {q, k}) {  // L2 norm, eps inside the root
        float ss = 0.f;
        for (int64_t i = 0; i < K; ++i) ss += u[i] * u[i];
        const float r = std::sqrt(ss + 1e-6f);
        for (int64_t i = 0; i < K; ++i) u[i] = u[i] / r;
      }
      const float beta = k3::sigmoid(b.data_ptr<float>()[bi * H + h]);
      const float* gh = g.data_ptr<float>() + (bi * H + h) * K;
      const float* s0 = state.data_ptr<float>() + (bi * H + h) * K * K;
      float* s1 = new_state.data_ptr<float>() + (bi * H + h) * K * K;
      std::fill(kv.begin(), kv.end(), 0.f);
      for (int64_t i = 0; i < K; ++i) {  // decay the rows, and k^T S
        const float e = std::exp(gh[i]), ki = k[i];
        for (int64_t j = 0; j < K; ++j) {
          s1[i * K + j] = s0[i * K + j] * e;
          kv[j] += ki * s1[i * K + j];
        }
      }
      for (int64_t j = 0; j < K; ++j) kv[j] = (v[j] - kv[j]) * beta;  // the delta
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < K; ++i) {  // the write, and (scale q)^T S after it
        const float ki = k[i], qi = q[i] * scale;
        for (int64_t j = 0; j < K; ++j) {
          s1[i * K + j] += ki * kv[j];
          acc[j] += qi * s1[i * K + j];
        }
      }
      float ss = 0.f;  // per-head RMSNorm of o, gated by sigmoid(gate)
      for (int64_t j = 0; j < K; ++j) ss += acc[j] * acc[j];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(K) + static_cast<float>(o_norm_eps));
      const float* gt = gate.data_ptr<float>() + (bi * H + h) * K;
      float* op = o.data_ptr<float>() + (bi * H + h) * K;
      for (int64_t j = 0; j < K; ++j) op[j] = acc[j] * r * nw[j] * k3::sigmoid(gt[j]);
    }
  }
  return {o, new_conv, new_state};
}

// sources: n tensors [..., d]; proj [1, d] (w), norm [d] (gamma): k3::attn_res_aggregate over gamma * w.
at::Tensor attn_res_aggregate(std::vector<at::Tensor> sources, at::Tensor proj, at::Tensor norm, double eps) {
  const size_t n = sources.size();
  TORCH_CHECK(n > 0, "attn_res_aggregate: no sources");
  for (auto& s : sources) {
    s = s.contiguous();
    check_fp32(s, "source");
    TORCH_CHECK(s.sizes() == sources[0].sizes(), "attn_res_aggregate: sources of one shape expected");
  }
  proj = proj.contiguous();
  norm = norm.contiguous();
  const int64_t d = sources[0].size(-1), rows = sources[0].numel() / std::max<int64_t>(d, 1);
  std::vector<float> gw(d);
  for (int64_t j = 0; j < d; ++j) gw[j] = norm.data_ptr<float>()[j] * proj.data_ptr<float>()[j];
  std::vector<const float*> src(n);
  for (size_t i = 0; i < n; ++i) src[i] = sources[i].data_ptr<float>();
  auto out = at::empty_like(sources[0]);
  k3::attn_res_aggregate(src.data(), static_cast<int64_t>(n), gw.data(), out.data_ptr<float>(), rows, d,
                         static_cast<float>(eps));
  return out;
}

// x [..., d], weight [d]: x * rsqrt(mean(x^2) + eps) * weight per row (F.rms_norm's order).
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  x = x.contiguous();
  weight = weight.contiguous();
  check_fp32(x, "x");
  check_fp32(weight, "weight");
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(weight.numel() == d, "rms_norm: weight of ", d, " elements expected");
  auto out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = xp + r * d;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < d; ++j) ss += v[j] * v[j];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t j = 0; j < d; ++j) op[r * d + j] = v[j] * inv * w[j];
  }
  return out;
}

// logits [N, E], bias [E]: select the top_k experts by sigmoid(logits) + bias (ties: lower index first), weigh
// them by the unbiased sigmoid, renormalised when asked, times scale. Returns (weights [N, k], indices int64 [N, k]).
std::vector<at::Tensor> moe_route(at::Tensor logits, at::Tensor bias, int64_t top_k, bool renormalize,
                                  double scale) {
  logits = logits.contiguous();
  bias = bias.contiguous();
  check_fp32(logits, "logits");
  check_fp32(bias, "bias");
  const int64_t E = logits.size(-1), N = logits.numel() / std::max<int64_t>(E, 1);
  TORCH_CHECK(bias.numel() == E && 0 < top_k && top_k <= E, "moe_route: bias [E] and 0 < top_k <= E expected");
  std::vector<int64_t> out_shape(logits.sizes().begin(), logits.sizes().end());
  out_shape.back() = top_k;
  auto weights = at::empty(out_shape, logits.options());
  auto indices = at::empty(out_shape, logits.options().dtype(at::kLong));
  k3::moe_route(logits.data_ptr<float>(), bias.data_ptr<float>(), weights.data_ptr<float>(),
                indices.data_ptr<int64_t>(), N, E, top_k, renormalize, static_cast<float>(scale));
  return {weights, indices};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kda_layer", &kda_layer, "KDA after its projections, one token (fp32)");
  m.def("attn_res_aggregate", &attn_res_aggregate, "Attention-Residual aggregation over depth (fp32)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (fp32)");
  m.def("moe_route", &moe_route, "sigmoid top-k routing with a selection bias (fp32)");
}
