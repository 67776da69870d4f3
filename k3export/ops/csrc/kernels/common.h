// What every k3 kernel shares: the runtime's parallel-for, shapes as the checks take them, and the vector type and
// vector maths of the build's width. One header per op beside it holds that op's kernel and the shapes it takes
// (`<op>_takes`, checked by each binding before it calls the kernel); the maths is the contract of
// k3export/ops/spec.py and the naive references in ops/naive.py.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

// Each op's `<op>_takes` gets the shapes and values its kernel takes, checked for every binding before it calls
// the kernel: "" when they fit, else what was expected, in one line (the binding says "k3::" before it). MXFP4
// weights are given by their element counts, [E, I, D] and [E, D, I], whatever their packing.
using Dims = std::vector<int64_t>;

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// The vector of the build's width: 16 floats with AVX-512, else 8 (AVX2 or the compiler's portable vector code).
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
#else
typedef float vf __attribute__((vector_size(32)));
typedef float vfu __attribute__((vector_size(32), aligned(4)));
#endif

constexpr int kVL = sizeof(vf) / sizeof(float);

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.f;
  for (int i = 0; i < kVL; ++i) s += v[i];
  return s;
#endif
}

// The gate's activation vectorised: libm's tanh and exp one value at a time took a fifth of a prefill's experts.
typedef int32_t vi __attribute__((vector_size(sizeof(vf))));

// e^x, |relative error| < 2e-7 (Cephes' expf polynomial on x - n ln 2, times 2^n built in the exponent bits);
// x clamped to [-87, 88], where e^x is a normal float.
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.f, hi = vf{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = vf{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * (vf)e;  // the same bits read as floats (a vector cast reinterprets)
}

inline vf vsigmoid(vf x) { return 1.f / (1.f + vexp(-x)); }

// tanh: 1 - 2 / (e^2x + 1), and its Taylor series below |x| = 1/4, where that difference would cancel
inline vf vtanh(vf x) {
  const vf x2 = x * x;
  const vf small = x * (1.f + x2 * (-1.f / 3 + x2 * (2.f / 15 + x2 * (-17.f / 315))));
  const vf big = 1.f - 2.f / (vexp(x + x) + 1.f);
  return x2 < 0.0625f ? small : big;
}

}  // namespace k3
