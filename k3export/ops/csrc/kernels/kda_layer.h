// k3::kda_layer: KDA's short convolution, the L2 normalisation of q and k, and the recurrence in one call.
#pragma once

#include "short_conv.h"
#include "l2_norm.h"
#include "kda.h"

namespace k3 {

// kda_layer: the short conv's x [B, T, 2HK + HV] (q | k | v of each token), g [B, T, H, K], initial_state
// [B, H, K, V]; H, K and V are read off g and initial_state
inline std::string kda_layer_takes(const Dims& state, const Dims& x, const Dims& taps, const Dims* start_shape,
                                        const int64_t* start, const Dims& g, const Dims& beta, const Dims& s0) {
  if (g.size() != 4 || s0.size() != 4 || x.size() != 3 || x != Dims{g[0], g[1], 2 * g[2] * g[3] + g[2] * s0[3]})
    return "kda_layer: g [B, T, H, K], initial_state [B, H, K, V] and x [B, T, 2 H K + H V] expected";
  const std::string conv = short_conv_takes(state, x, taps, start_shape, start);
  return conv.empty() ? kda_takes(g, g, Dims{g[0], g[1], g[2], s0[3]}, g, beta, s0) : conv;
}

// KDA's short convolution, the L2 normalisation of q and k, and the recurrence in one call
// (fusions.fuse_kda_layer): what three nodes and the split between them did. x [B, T, C = 2HK + HV] is each
// token's q | k | v before the conv; state, present [B, C, W-1]; taps [W, C]; g [B, T, H, K]; beta [B, T, H];
// s0, s1 [B, H, K, V]; o [B, T, H, V].
inline void kda_layer(const float* state, const float* x, const float* taps, const int64_t* start,
                           const float* g, const float* beta, const float* s0, float* o, float* present, float* s1,
                           int64_t B, int64_t T, int64_t W, int64_t H, int64_t K, int64_t V, float scale, float eps,
                           const Parallel& par = {}) {
  const int64_t HK = H * K, HV = H * V, C = 2 * HK + HV, rows = B * T;
  std::vector<float> y(rows * C), q(rows * HK), k(rows * HK), v(rows * HV);
  short_conv(state, x, taps, start, y.data(), present, B, T, C, W, par);
  for (int64_t r = 0; r < rows; ++r) {  // a token's q and k: H rows of K each, normalised as they are split off
    const float* yr = y.data() + r * C;
    l2_norm(yr, q.data() + r * HK, H, K, eps);
    l2_norm(yr + HK, k.data() + r * HK, H, K, eps);
    std::copy(yr + 2 * HK, yr + C, v.data() + r * HV);
  }
  kda(q.data(), k.data(), v.data(), g, beta, s0, o, s1, B, T, H, K, V, scale, par);
}

}  // namespace k3
