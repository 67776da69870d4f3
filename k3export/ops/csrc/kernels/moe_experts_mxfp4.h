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

// Twice each E2M1 code's value, an integer in [-12, 12]: the int8 weights of the products on int8 activations
constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// half of each E8M0 scale (the codes above are twice the values)
inline const std::array<float, 256> kE8M0Half = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[b] = e8m0(static_cast<uint8_t>(b)) / 2;
  return t;
}();

// Products of MXFP4 rows with activations rounded to int8 per 32-feature block (`Q8Block`, the contract's
// `quantize_activations`): the codes as int8 (a 16-byte table lookup, exact) times the activations' codes in
// integer sums, one float multiply-add per block by the two scales, as llama.cpp's MXFP4 / Q4_0 dot products do.
// The AVX2 E2M1 decode to fp32 bounded the fp32 product (~10 GB/s of packed bytes); this one reads at memory pace.
template <int R, int TT>
inline void tile(const Mxfp4Row* rows, const Q8Block* const* x, int64_t n, float* out) {
  const int64_t chunks = n / kChunk;
  for (int r = 0; r < R; ++r) {
    const uint8_t* packed = rows[r].packed;
    const uint8_t* scale = rows[r].scale;
#if defined(__AVX2__)
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1x2)));
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m128i block = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + c * (kChunk / 2)));
      // low nibbles (features 0, 2, .. 30) in the low half, high nibbles (1, 3, .. 31) in the high half: the
      // `deinterleaved` order the activations' codes lie in
      const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(block, 4), block), low4);
      const __m256i w = _mm256_shuffle_epi8(table, nib);
      const __m256i wabs = _mm256_sign_epi8(w, w);  // maddubs multiplies unsigned by signed: |w| by sign(w) a
      const float ws = kE8M0Half[scale[c]];
      for (int t = 0; t < TT; ++t) {
        const Q8Block& b = x[t][c];
        const __m256i a = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.q)), w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        const __m256i sum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, a);
#else
        // |w| <= 12, |a| <= 127: a pair's sum fits int16 without saturating
        const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, a), ones);
#endif
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(ws * b.d), acc[t]);
      }
    }
    for (int t = 0; t < TT; ++t) {
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
      const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
      out[t * R + r] = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
    }
#else
    float acc[TT] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      int8_t w[kChunk];
      const uint8_t* q = packed + c * (kChunk / 2);
      for (int j = 0; j < kChunk / 2; ++j) {
        w[j] = kE2M1x2[q[j] & 15];
        w[kChunk / 2 + j] = kE2M1x2[q[j] >> 4];
      }
      const float ws = kE8M0Half[scale[c]];
      for (int t = 0; t < TT; ++t) {
        int32_t sum = 0;
        for (int j = 0; j < kChunk; ++j) sum += int32_t{w[j]} * x[t][c].q[j];
        acc[t] += static_cast<float>(sum) * (ws * x[t][c].d);
      }
    }
    for (int t = 0; t < TT; ++t) out[t * R + r] = acc[t];
#endif
  }
}

// MXFP4 experts, as the checkpoint stores them: packed w1, w3 [E, I, D/2], w2 [E, D, I/2]; E8M0 scales
// [E, I, D/32], [E, D, I/32]. D and I must be multiples of 32 (the binding checks). `quantize_activations`: z and
// the hidden activations rounded to int8 per 32-feature block first (`quantize_q8`), the products in integers.
inline void moe_experts_mxfp4(const float* z, const float* weights, const int64_t* indices, const uint8_t* w1,
                              const uint8_t* w3, const uint8_t* w2, const uint8_t* s1, const uint8_t* s3,
                              const uint8_t* s2, float* u, int64_t N, int64_t top_k, int64_t E, int64_t D, int64_t I,
                              bool situ, float beta1, float beta2, const Parallel& par = {},
                              bool quantize_activations = false) {
  const uint8_t* w[3] = {w1, w3, w2};
  const uint8_t* s[3] = {s1, s3, s2};
  const int64_t cols[3] = {D, D, I}, rows[3] = {I, I, D};
  auto row = [&](int m, int64_t e, int64_t r) {
    const int64_t at = e * rows[m] + r;
    return Mxfp4Row{w[m] + at * (cols[m] / 2), s[m] + at * (cols[m] / kChunk)};
  };
  if (quantize_activations)
    moe_experts_rows<true>(z, weights, indices, row, u, N, top_k, E, D, I, situ, beta1, beta2, par);
  else
    moe_experts_rows<false>(z, weights, indices, row, u, N, top_k, E, D, I, situ, beta1, beta2, par);
}

}  // namespace k3
