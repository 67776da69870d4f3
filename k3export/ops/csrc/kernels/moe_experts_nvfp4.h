// k3::moe_experts_nvfp4: the routed experts on NVFP4 weights (MXFP4's E2M1 codes, E4M3 block scales and a
// global scale).
#pragma once

#include "moe_experts_mxfp4.h"

namespace k3 {

// float8_e4m3fn byte -> value (bias 7; exponent field 0 subnormal: m * 2^-9; 0x7f / 0xff NaN)
inline const std::array<float, 256> kE4M3 = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int ex = (b >> 3) & 15, m = b & 7;
    float v = ex == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.f + m / 8.f, ex - 7);
    if (ex == 15 && m == 7) v = NAN;
    t[b] = b & 0x80 ? -v : v;
  }
  return t;
}();

// An NVFP4 row as NVIDIA's checkpoint stores it (k3export/ops/spec.py MOE_EXPERTS_NVFP4): the packed E2M1 bytes of
// MXFP4, one E4M3 scale per 16 features and the matrix's fp32 global scale `g`: e2m1 x e4m3 (exact), then x g (one
// rounding, as decode_nvfp4). A chunk of 32 is two scale blocks, bytes 0-7 and 8-15; it comes out deinterleaved as
// an MXFP4 chunk does (even features, then odd): with AVX2 by table lookups as Mxfp4Row's, else (AVX-512 builds too:
// no decode of their own yet) one value at a time. The weights stay at 4.5 bits in memory.
struct Nvfp4Row {
  static constexpr bool kDeinterleaved = true;
  const uint8_t* packed;
  const uint8_t* scale;
  float g;
  void chunk(int64_t c, vf* out) const {
    const float s[2] = {kE4M3[scale[2 * c]], kE4M3[scale[2 * c + 1]]};
#if defined(__AVX2__) && !defined(__AVX512F__)  // vf is 8 lanes here; an AVX-512 build takes the loop below
    // as Mxfp4Row's AVX2 decode: permutevar8x32 looks a nibble's magnitude up (codes 0-7) in the table scaled by its
    // block's E4M3 scale (exact), bit 3 sets the sign; bytes 8h .. 8h + 7 are block h. Then x g (one rounding).
    const __m256i sign = _mm256_set1_epi32(INT32_MIN);
    auto signs = [&](__m256i bit31) { return _mm256_castsi256_ps(_mm256_and_si256(bit31, sign)); };
    const __m256 gv = _mm256_set1_ps(g);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + c * (kChunk / 2)));
    const __m256i halves[2] = {_mm256_cvtepu8_epi32(raw), _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))};
    for (int h = 0; h < 2; ++h) {
      const __m256 mag = _mm256_mul_ps(_mm256_loadu_ps(kE2M1), _mm256_set1_ps(s[h]));
      const __m256i lo = halves[h], up = _mm256_srli_epi32(lo, 4);
      out[h] = (vf)_mm256_mul_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(mag, lo), signs(_mm256_slli_epi32(lo, 28))), gv);
      out[2 + h] =
          (vf)_mm256_mul_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(mag, up), signs(_mm256_slli_epi32(lo, 24))), gv);
    }
#else
    float w[kChunk];
    const uint8_t* q = packed + c * (kChunk / 2);
    for (int j = 0; j < kChunk / 2; ++j) {  // byte j: features 2j (low nibble) and 2j + 1, of scale block j / 8
      const uint8_t byte = q[j];
      const float sj = s[j / 8];
      w[j] = kE2M1[byte & 15] * sj * g;
      w[kChunk / 2 + j] = kE2M1[byte >> 4] * sj * g;
    }
    for (int v = 0; v < kNV; ++v) out[v] = *reinterpret_cast<const vfu*>(w + v * kVL);
#endif
  }
  float at(int64_t f) const {
    const uint8_t q = packed[f / 2];
    return kE2M1[f % 2 ? q >> 4 : q & 15] * kE4M3[scale[f / 16]] * g;
  }
};

// NVFP4 experts, as NVIDIA's checkpoint stores them: packed w1, w3 [E, I, D/2], w2 [E, D, I/2]; E4M3 scale bytes
// [E, I, D/16], [E, D, I/16]; fp32 global scales g1, g3, g2 [E]. D and I must be multiples of 32 (the binding checks).
inline void moe_experts_nvfp4(const float* z, const float* weights, const int64_t* indices, const uint8_t* w1,
                              const uint8_t* w3, const uint8_t* w2, const uint8_t* s1, const uint8_t* s3,
                              const uint8_t* s2, const float* g1, const float* g3, const float* g2, float* u,
                              int64_t N, int64_t top_k, int64_t E, int64_t D, int64_t I, bool situ, float beta1,
                              float beta2, const Parallel& par = {}) {
  const uint8_t* w[3] = {w1, w3, w2};
  const uint8_t* s[3] = {s1, s3, s2};
  const float* g[3] = {g1, g3, g2};
  const int64_t cols[3] = {D, D, I}, rows[3] = {I, I, D};
  moe_experts_rows(
      z, weights, indices,
      [&](int m, int64_t e, int64_t r) {
        const int64_t row = e * rows[m] + r;
        return Nvfp4Row{w[m] + row * (cols[m] / 2), s[m] + row * (cols[m] / 16), g[m][e]};
      },
      u, N, top_k, E, D, I, situ, beta1, beta2, par);
}

}  // namespace k3
