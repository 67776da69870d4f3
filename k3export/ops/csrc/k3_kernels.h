// The k3 ops' CPU kernels on raw fp32 buffers (row-major, contiguous), shared by the runtime bindings (ort_k3.cpp:
// ONNX Runtime). The maths is the contract of k3export/ops/spec.py and the naive references in ops/naive.py.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace k3 {

using Par = void (*)(void*, int64_t, const std::function<void(int64_t, int64_t)>&);

// A runtime's parallel-for: body(lo, hi) over a split of [0, n) on its thread pool (`run(ctx, n, body)`); no
// `run`: serial.
struct Parallel {
  Par run = nullptr;
  void* ctx = nullptr;
  void operator()(int64_t n, const std::function<void(int64_t, int64_t)>& body) const {
    if (run == nullptr || n < 2) body(0, n); else run(ctx, n, body);
  }
};

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// SiTU-GLU: beta1 tanh(g / beta1) sigmoid(g) * beta2 tanh(u / beta2), elementwise over n values.
inline void situ_glu(const float* g, const float* u, float* out, int64_t n, float beta1, float beta2) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = beta1 * std::tanh(g[i] / beta1) * sigmoid(g[i]) * (beta2 * std::tanh(u[i] / beta2));
}

// KDA token by token: S = exp(g_t) S; S += beta_t k_t (v_t - k_t^T S)^T; o_t = (scale q_t)^T S.
// q, k, g [B, T, H, K]; v, o [B, T, H, V]; beta [B, T, H]; s0, s1 [B, H, K, V] (s1 may not alias s0).
inline void kda(const float* q, const float* k, const float* v, const float* g, const float* beta, const float* s0,
                float* o, float* s1, int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, float scale,
                const Parallel& par = {}) {
  std::memcpy(s1, s0, sizeof(float) * B * H * K * V);
  par(B * H, [&](int64_t lo, int64_t hi) {  // each (batch, head) its own state
    std::vector<float> kv(V);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float* S = s1 + bh * K * V;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = (b * T + t) * H + h;
        const float *qt = q + row * K, *kt = k + row * K, *vt = v + row * V, *gt = g + row * K;
        const float bt = beta[row];
        std::fill(kv.begin(), kv.end(), 0.f);
        for (int64_t i = 0; i < K; ++i) {  // decay the rows, and k^T S
          const float e = std::exp(gt[i]), ki = kt[i];
          float* Si = S + i * V;
          for (int64_t j = 0; j < V; ++j) {
            Si[j] *= e;
            kv[j] += ki * Si[j];
          }
        }
        for (int64_t j = 0; j < V; ++j) kv[j] = (vt[j] - kv[j]) * bt;  // the delta
        float* ot = o + row * V;
        std::fill(ot, ot + V, 0.f);
        for (int64_t i = 0; i < K; ++i) {  // the write, and (scale q)^T S after it
          const float ki = kt[i], qi = qt[i] * scale;
          float* Si = S + i * V;
          for (int64_t j = 0; j < V; ++j) {
            Si[j] += ki * kv[j];
            ot[j] += qi * Si[j];
          }
        }
      }
    }
  });
}

// Sigmoid router: the top_k experts by sigmoid(logits) + bias (ties: lower index first), weighed by the unbiased
// sigmoid, / (sum + 1e-20) when renormalize, times scale. logits [N, E], bias [E]; weights, indices [N, top_k].
inline void moe_route(const float* logits, const float* bias, float* weights, int64_t* indices, int64_t N, int64_t E,
                      int64_t top_k, bool renormalize, float scale) {
  std::vector<float> s(E), key(E);
  std::vector<int64_t> order(E);
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits + n * E;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = sigmoid(l[e]);
      key[e] = s[e] + bias[e];
      order[e] = e;
    }
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return key[a] > key[b] || (key[a] == key[b] && a < b); });
    float* w = weights + n * top_k;
    int64_t* idx = indices + n * top_k;
    float sum = 0.f;
    for (int64_t j = 0; j < top_k; ++j) {
      idx[j] = order[j];
      w[j] = s[order[j]];
      sum += w[j];
    }
    for (int64_t j = 0; j < top_k; ++j) w[j] = (renormalize ? w[j] / (sum + 1e-20f) : w[j]) * scale;
  }
}

// Routed experts, dense fp32: u[n] = sum_j weights[n, j] W2[e] act(W1[e] z[n], W3[e] z[n]), e = indices[n, j];
// act situ = SiTU-GLU(beta1, beta2), else silu(gate) * up. z [N, D]; w1, w3 [E, I, D]; w2 [E, D, I]; u [N, D].
// Expert by expert over the token-slots that chose it, each weight row read once for all of them (prefill reads
// every selected expert once, not once per token); only the selected experts' rows are read, never copied.
// indices must lie in [0, E) (the binding checks).
inline void moe_experts(const float* z, const float* weights, const int64_t* indices, const float* w1,
                        const float* w3, const float* w2, float* u, int64_t N, int64_t top_k, int64_t E, int64_t D,
                        int64_t I, bool situ, float beta1, float beta2, const Parallel& par = {}) {
  std::fill(u, u + N * D, 0.f);
  std::vector<std::vector<int64_t>> slots(E);  // expert -> its token-slots n * top_k + j, in order
  for (int64_t s = 0; s < N * top_k; ++s) slots[indices[s]].push_back(s);
  std::vector<float> g, up;
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int64_t>& sl = slots[e];
    const int64_t S = static_cast<int64_t>(sl.size());
    if (S == 0) continue;
    g.assign(S * I, 0.f);
    up.assign(S * I, 0.f);
    const float *a = w1 + e * I * D, *c = w3 + e * I * D, *b = w2 + e * D * I;
    par(I, [&](int64_t lo, int64_t hi) {  // rows of w1 / w3
    for (int64_t i = lo; i < hi; ++i) {
      const float *ar = a + i * D, *cr = c + i * D;
      for (int64_t t = 0; t < S; ++t) {
        const float* x = z + (sl[t] / top_k) * D;
        float gi = 0.f, ui = 0.f;
#pragma omp simd reduction(+ : gi, ui)
        for (int64_t d = 0; d < D; ++d) {
          gi += ar[d] * x[d];
          ui += cr[d] * x[d];
        }
        g[t * I + i] = gi;
        up[t * I + i] = ui;
      }
    }
    });
    for (int64_t t = 0; t < S; ++t) {
      float* h = g.data() + t * I;
      const float* ut = up.data() + t * I;
      for (int64_t i = 0; i < I; ++i)
        h[i] = situ ? beta1 * std::tanh(h[i] / beta1) * sigmoid(h[i]) * (beta2 * std::tanh(ut[i] / beta2))
                    : h[i] * sigmoid(h[i]) * ut[i];
    }
    par(D, [&](int64_t lo, int64_t hi) {  // rows of w2: each writes its own column of u
    for (int64_t d = lo; d < hi; ++d) {
      const float* br = b + d * I;
      for (int64_t t = 0; t < S; ++t) {
        const float* h = g.data() + t * I;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < I; ++i) acc += br[i] * h[i];
        u[(sl[t] / top_k) * D + d] += weights[sl[t]] * acc;
      }
    }
    });
  }
}

}  // namespace k3
