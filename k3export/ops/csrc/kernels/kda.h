// k3::kda: Kimi Delta Attention's recurrence, token by token.
#pragma once

#include "common.h"

namespace k3 {

inline std::string kda_takes(const Dims& q, const Dims& k, const Dims& v, const Dims& g, const Dims& beta,
                             const Dims& s0) {
  if (q.size() != 4 || k != q || g != q || v.size() != 4) return "kda: q, k, g [B, T, H, K] and v [B, T, H, V] expected";
  if (v[0] != q[0] || v[1] != q[1] || v[2] != q[2] || beta != Dims{q[0], q[1], q[2]} ||
      s0 != Dims{q[0], q[2], q[3], v[3]})
    return "kda: v [B, T, H, V], beta [B, T, H] and initial_state [B, H, K, V] expected";
  return "";
}

// KDA token by token: S = exp(g_t) S; S += beta_t k_t (v_t - k_t^T S)^T; o_t = (scale q_t)^T S.
// q, k, g [B, T, H, K]; v, o [B, T, H, V]; beta [B, T, H]; s0, s1 [B, H, K, V] (s1 may not alias s0). The first
// token's decay reads s0 and writes s1, so a decode step makes no separate copy of the state.
inline void kda(const float* q, const float* k, const float* v, const float* g, const float* beta, const float* s0,
                float* o, float* s1, int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, float scale,
                const Parallel& par = {}) {
  if (T == 0) std::memcpy(s1, s0, sizeof(float) * B * H * K * V);
  par(B * H, [&](int64_t lo, int64_t hi) {  // each (batch, head) its own state
    std::vector<float> kv(V);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float* S = s1 + bh * K * V;
      for (int64_t t = 0; t < T; ++t) {
        const float* from = t == 0 ? s0 + bh * K * V : S;  // the state before token t
        const int64_t row = (b * T + t) * H + h;
        const float *qt = q + row * K, *kt = k + row * K, *vt = v + row * V, *gt = g + row * K;
        const float bt = beta[row];
        std::fill(kv.begin(), kv.end(), 0.f);
        for (int64_t i = 0; i < K; ++i) {  // decay the rows, and k^T S
          const float e = std::exp(gt[i]), ki = kt[i];
          float* Si = S + i * V;
          const float* Fi = from + i * V;
          for (int64_t j = 0; j < V; ++j) {
            Si[j] = Fi[j] * e;
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

}  // namespace k3
