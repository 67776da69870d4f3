// k3::moe_route: the sigmoid router.
#pragma once

#include "common.h"

namespace k3 {

inline std::string moe_route_takes(const Dims& logits, const Dims& bias, int64_t top_k) {
  const bool ok = logits.size() == 2 && bias == Dims{logits[1]} && top_k >= 1 && top_k <= logits[1];
  return ok ? "" : "moe_route: logits [N, E], bias [E] and 1 <= top_k <= E expected";
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

}  // namespace k3
