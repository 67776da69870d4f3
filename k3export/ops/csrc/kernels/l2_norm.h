// k3::l2_norm: L2 normalisation over the last axis.
#pragma once

#include "common.h"

namespace k3 {

inline std::string l2_norm_takes(const Dims& x) { return x.empty() ? "l2_norm: input of rank >= 1 expected" : ""; }

// L2 normalisation over the last axis (modeling_k3.l2norm): y = x / sqrt(sum(x^2) + eps) for each of `rows` rows
// of n, the sum in fp32 as ReduceSum's. x, y [rows, n]. Split over the pool only when it is large enough to pay for
// the hand-off (a decode step's q and k are 8 rows of 64).
inline void l2_norm(const float* x, float* y, int64_t rows, int64_t n, float eps, const Parallel& par = {}) {
  (rows * n >= (int64_t{1} << 16) ? par : Parallel{})(rows, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = x + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < n; ++j) ss += xr[j] * xr[j];
      const float d = std::sqrt(ss + eps);
      float* yr = y + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = xr[j] / d;
    }
  });
}

}  // namespace k3
