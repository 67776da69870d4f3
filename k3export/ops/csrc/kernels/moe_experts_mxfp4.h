// k3::moe_experts_mxfp4: the routed experts on MXFP4 weights, as the checkpoint stores them.
#pragma once

#include "moe_experts.h"

namespace k3 {

// E2M1 code (bit 3 the sign) -> value; E8M0 byte -> 2^(byte - 127), byte 0 -> 2^-127 and 255 -> inf, as
// compressed-tensors and ops/naive.py decode them.
constexpr float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
inline float e8m0(uint8_t b) {
  if (b == 0) return 0x1p-127f;
  uint32_t bits = static_cast<uint32_t>(b) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// e8m0 of every byte: one load instead of a branch in each block's decode
inline const std::array<float, 256> kE8M0 = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[b] = e8m0(static_cast<uint8_t>(b));
  return t;
}();

// An MXFP4 row as the checkpoint stores it: 16 bytes of packed E2M1 per 32 features (element 2j in the low nibble
// of byte j) and one E8M0 scale. Decoded into registers chunk by chunk, inside the products: the weights stay at
// 4.25 bits in memory, with no 8-bit or fp32 copy. A chunk comes out as its even features, then its odd ones (the
// low nibbles, then the high ones), and the activations it meets are laid out the same way (`deinterleave`): the
// decode, which bounds these products, then needs no shuffle to interleave the nibbles (bench/experts_cpu.py
// --baseline: 0.81x the decode call of the kernel that did). AVX-512 looks a code up in the 16-entry table in one
// register; AVX2's permute takes 8 entries, so it looks the magnitude up and sets the sign from bit 3 (a decode
// call 0.92 ms against AVX-512's 0.54 and the one-value-at-a-time decode's 3.63, bench/experts_cpu.py --arch).
struct Mxfp4Row {
  static constexpr bool kDeinterleaved = true;
  const uint8_t* packed;
  const uint8_t* scale;
  void chunk(int64_t c, vf* out) const {
#if defined(__AVX512F__)
    // the 16-entry table is one register; permutexvar looks 16 codes up at once, from the low 4 bits of each index
    const __m512 table = _mm512_mul_ps(_mm512_loadu_ps(kE2M1), _mm512_set1_ps(kE8M0[scale[c]]));
    const __m128i block = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + c * (kChunk / 2)));
    const __m512i bytes = _mm512_cvtepu8_epi32(block);  // byte j in lane j: its low nibble feature 2j, high 2j + 1
    out[0] = (vf)_mm512_permutexvar_ps(bytes, table);                        // low nibbles: features 0, 2, .. 30
    out[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);  // high nibbles: 1, 3, .. 31
#elif defined(__AVX2__)
    // permutevar8x32 reads an index's low 3 bits: a nibble's magnitude (codes 0-7, the table's first half); its
    // bit 3, shifted to bit 31, the sign
    const __m256 table = _mm256_mul_ps(_mm256_loadu_ps(kE2M1), _mm256_set1_ps(kE8M0[scale[c]]));
    const __m256i sign = _mm256_set1_epi32(INT32_MIN);
    auto signs = [&](__m256i bit31) { return _mm256_castsi256_ps(_mm256_and_si256(bit31, sign)); };
    const __m128i block = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + c * (kChunk / 2)));
    const __m256i halves[2] = {_mm256_cvtepu8_epi32(block), _mm256_cvtepu8_epi32(_mm_srli_si128(block, 8))};
    for (int h = 0; h < 2; ++h) {  // bytes 8h .. 8h + 7: low nibbles features 16h + 0, 2, .., high ones 16h + 1, 3, ..
      const __m256i b = halves[h], hi = _mm256_srli_epi32(b, 4);
      out[h] = (vf)_mm256_xor_ps(_mm256_permutevar8x32_ps(table, b), signs(_mm256_slli_epi32(b, 28)));
      out[2 + h] = (vf)_mm256_xor_ps(_mm256_permutevar8x32_ps(table, hi), signs(_mm256_slli_epi32(b, 24)));
    }
#else
    const float s = kE8M0[scale[c]];
    float w[kChunk];
    const uint8_t* q = packed + c * (kChunk / 2);
    for (int j = 0; j < kChunk / 2; ++j) {
      w[j] = kE2M1[q[j] & 15] * s;
      w[kChunk / 2 + j] = kE2M1[q[j] >> 4] * s;
    }
    for (int v = 0; v < kNV; ++v) out[v] = *reinterpret_cast<const vfu*>(w + v * kVL);
#endif
  }
  float at(int64_t f) const {
    const uint8_t q = packed[f / 2];
    return kE2M1[f % 2 ? q >> 4 : q & 15] * kE8M0[scale[f / kChunk]];
  }
};

// MXFP4 experts, as the checkpoint stores them: packed w1, w3 [E, I, D/2], w2 [E, D, I/2]; E8M0 scales
// [E, I, D/32], [E, D, I/32]. D and I must be multiples of 32 (the binding checks).
inline void moe_experts_mxfp4(const float* z, const float* weights, const int64_t* indices, const uint8_t* w1,
                              const uint8_t* w3, const uint8_t* w2, const uint8_t* s1, const uint8_t* s3,
                              const uint8_t* s2, float* u, int64_t N, int64_t top_k, int64_t E, int64_t D, int64_t I,
                              bool situ, float beta1, float beta2, const Parallel& par = {}) {
  const uint8_t* w[3] = {w1, w3, w2};
  const uint8_t* s[3] = {s1, s3, s2};
  const int64_t cols[3] = {D, D, I}, rows[3] = {I, I, D};
  moe_experts_rows(
      z, weights, indices,
      [&](int m, int64_t e, int64_t r) {
        const int64_t row = e * rows[m] + r;
        return Mxfp4Row{w[m] + row * (cols[m] / 2), s[m] + row * (cols[m] / kChunk)};
      },
      u, N, top_k, E, D, I, situ, beta1, beta2, par);
}

}  // namespace k3
