// k3::short_conv: KDA's causal depthwise convolution plus SiLU, and its new state.
#pragma once

#include "common.h"

namespace k3 {

// start: its shape and values, or nulls when not given
inline std::string short_conv_takes(const Dims& state, const Dims& x, const Dims& taps, const Dims* start_shape,
                                    const int64_t* start) {
  if (state.size() != 3 || x.size() != 3 || taps.size() != 2 || state[0] != x[0] || state[1] != x[2] ||
      taps[1] != x[2] || taps[0] != state[2] + 1)
    return "short_conv: state [B, C, K-1], x [B, T, C] and taps [K, C] expected";
  if (start_shape == nullptr) return "";
  if (*start_shape != Dims{x[0]}) return "short_conv: start [B] expected";
  for (int64_t b = 0; b < x[0]; ++b)
    if (start[b] < 0 || start[b] > x[1]) return "short_conv: input 'start' out of [0, T]";
  return "";
}

// KDA's short convolution (modeling_k3.short_conv): a causal depthwise conv of kernel K plus SiLU over
// full = [conv_state | x] along time, and the new conv state, the K - 1 rows of `full` from row start[b] (the
// window that ends at each row's last real token; start[b] = T without a mask). state, present [B, C, K-1] (the
// contract's layout); x, y [B, T, C]; taps [K, C]; start [B] in [0, T] (the binding checks) or null.
inline void short_conv(const float* state, const float* x, const float* taps, const int64_t* start, float* y,
                       float* present, int64_t B, int64_t T, int64_t C, int64_t K, const Parallel& par = {}) {
  const int64_t km1 = K - 1;
  std::vector<float> head(B * km1 * C);  // the state transposed: row r of `full` for r < K - 1
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t r = 0; r < km1; ++r) head[(b * km1 + r) * C + c] = state[(b * C + c) * km1 + r];
  auto row = [&](int64_t b, int64_t r) { return r < km1 ? &head[(b * km1 + r) * C] : x + (b * T + r - km1) * C; };
  par(B * T, [&](int64_t lo, int64_t hi) {
    std::vector<const float*> rows(K);
    for (int64_t bt = lo; bt < hi; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      for (int64_t j = 0; j < K; ++j) rows[j] = row(b, t + j);
      float* out = y + bt * C;
      for (int64_t c = 0; c < C; c += kVL) {  // a tail of fewer than a vector goes through the same vector code
        const int64_t n = std::min<int64_t>(kVL, C - c);
        vf acc{};
        for (int64_t j = 0; j < K; ++j) {
          if (n == kVL) {
            acc += *reinterpret_cast<const vfu*>(taps + j * C + c) * *reinterpret_cast<const vfu*>(rows[j] + c);
            continue;
          }
          vf w{}, v{};
          for (int64_t i = 0; i < n; ++i) w[i] = taps[j * C + c + i], v[i] = rows[j][c + i];
          acc += w * v;
        }
        const vf a = acc * vsigmoid(acc);
        if (n == kVL) *reinterpret_cast<vfu*>(out + c) = a;
        else for (int64_t i = 0; i < n; ++i) out[c + i] = a[i];
      }
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = start ? start[b] : T;
    for (int64_t r = 0; r < km1; ++r) {
      const float* src = row(b, s + r);
      for (int64_t c = 0; c < C; ++c) present[(b * C + c) * km1 + r] = src[c];
    }
  }
}

}  // namespace k3
