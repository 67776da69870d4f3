// k3::attn_res_aggregate: Attention Residuals over depth.
#pragma once

#include "common.h"

namespace k3 {

// sources: the S sources' shapes (S >= 1)
inline std::string attn_res_aggregate_takes(const Dims& weight, const std::vector<Dims>& sources) {
  const bool ok = weight.size() == 1 && !sources.empty() && !sources[0].empty() && sources[0].back() == weight[0];
  if (!ok) return "attn_res_aggregate: weight [D] and at least one source [..., D] expected";
  for (const Dims& s : sources)
    if (s != sources[0]) return "attn_res_aggregate: sources of one shape expected";
  return "";
}

// Attention Residuals over depth (modeling_k3.attn_res_aggregate): per row, softmax over the S sources of
// (gw . v_s) / rms(v_s), rms = sqrt(mean(v_s^2) + eps), then the weighted sum of the raw v_s. src: S pointers to
// [rows, D]; gw [D] (the key norm's gain times the pseudo-query, gamma * w); out [rows, D].
inline void attn_res_aggregate(const float* const* src, int64_t S, const float* gw, float* out, int64_t rows,
                               int64_t D, float eps, const Parallel& par = {}) {
  par(rows, [&](int64_t lo, int64_t hi) {
    std::vector<float> logit(S);
    for (int64_t r = lo; r < hi; ++r) {
      float m = -INFINITY;
      for (int64_t s = 0; s < S; ++s) {
        const float* v = src[s] + r * D;
        float dot = 0.f, ss = 0.f;
#pragma omp simd reduction(+ : dot, ss)
        for (int64_t j = 0; j < D; ++j) {
          dot += v[j] * gw[j];
          ss += v[j] * v[j];
        }
        logit[s] = dot / std::sqrt(ss / static_cast<float>(D) + eps);
        m = std::max(m, logit[s]);
      }
      float z = 0.f;
      for (int64_t s = 0; s < S; ++s) z += (logit[s] = std::exp(logit[s] - m));
      float* o = out + r * D;
      std::fill(o, o + D, 0.f);
      for (int64_t s = 0; s < S; ++s) {
        const float a = logit[s] / z, *v = src[s] + r * D;
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) o[j] += a * v[j];
      }
    }
  });
}

}  // namespace k3
