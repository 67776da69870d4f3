// The k3 ops' CPU kernels on raw fp32 buffers (row-major, contiguous), shared by the runtime bindings (ort_k3.cpp:
// ONNX Runtime; ov_k3.cpp: OpenVINO). The maths is the contract of k3export/ops/spec.py and the naive references in
// ops/naive.py.
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

// ------------------------------------------------------------------------------------- what each kernel takes
// The shapes and values each kernel takes, checked here for both bindings before they call it: "" when they fit,
// else what was expected, in one line (the binding says "k3::" before it). MXFP4 weights are given by their element
// counts, [E, I, D] and [E, D, I], whatever their packing.
using Dims = std::vector<int64_t>;

inline std::string kda_takes(const Dims& q, const Dims& k, const Dims& v, const Dims& g, const Dims& beta,
                             const Dims& s0) {
  if (q.size() != 4 || k != q || g != q || v.size() != 4) return "kda: q, k, g [B, T, H, K] and v [B, T, H, V] expected";
  if (v[0] != q[0] || v[1] != q[1] || v[2] != q[2] || beta != Dims{q[0], q[1], q[2]} ||
      s0 != Dims{q[0], q[2], q[3], v[3]})
    return "kda: v [B, T, H, V], beta [B, T, H] and initial_state [B, H, K, V] expected";
  return "";
}

inline std::string situ_glu_takes(const Dims& gate, const Dims& up) {
  return gate == up ? "" : "situ_glu: inputs 'gate' and 'up' of one shape expected";
}

inline std::string moe_route_takes(const Dims& logits, const Dims& bias, int64_t top_k) {
  const bool ok = logits.size() == 2 && bias == Dims{logits[1]} && top_k >= 1 && top_k <= logits[1];
  return ok ? "" : "moe_route: logits [N, E], bias [E] and 1 <= top_k <= E expected";
}

// `op`: the name the binding runs the kernel under. idx: indices' values (n of them); scales: none (dense) or the
// three E8M0 scales' shapes.
inline std::string moe_experts_takes(const char* op, const Dims& z, const Dims& weights, const Dims& indices,
                                     const Dims& w1, const Dims& w3, const Dims& w2, const int64_t* idx,
                                     const std::vector<Dims>& scales = {}) {
  const std::string name(op);
  if (z.size() != 2 || weights.size() != 2 || indices != weights || weights[0] != z[0] || w1.size() != 3 ||
      w3 != w1 || w1[2] != z[1] || w2 != Dims{w1[0], z[1], w1[1]})
    return name + ": z [N, D], weights / indices [N, top_k], w1 / w3 [E, I, D], w2 [E, D, I] expected";
  const int64_t E = w1[0], I = w1[1], D = w1[2];
  if (!scales.empty() && (D % 32 || I % 32 || scales.size() != 3 || scales[0] != Dims{E, I, D / 32} ||
                          scales[1] != scales[0] || scales[2] != Dims{E, D, I / 32}))
    return name + ": w1 / w3 [E, I, D] with scales [E, I, D/32], w2 [E, D, I] with scales [E, D, I/32], D and I "
                  "multiples of 32 expected";
  for (int64_t i = 0; i < weights[0] * weights[1]; ++i)
    if (idx[i] < 0 || idx[i] >= E) return name + ": input 'indices' out of [0, E)";
  return "";
}

// moe_route_experts (the router's, then the experts' checks on its slots): logits [N, E] of z's N and w1's E
inline std::string moe_route_experts_takes(const Dims& logits, const Dims& bias, int64_t top_k, const Dims& z,
                                           const Dims& w1) {
  if (auto why = moe_route_takes(logits, bias, top_k); !why.empty()) return why;
  if (z.size() != 2 || z[0] != logits[0] || w1.size() != 3 || w1[0] != logits[1])
    return "moe_route_experts: logits [N, E], z [N, D] and w1 [E, I, D] of one N and one E expected";
  return "";
}

// sources: the S sources' shapes (S >= 1)
inline std::string attn_res_aggregate_takes(const Dims& weight, const std::vector<Dims>& sources) {
  const bool ok = weight.size() == 1 && !sources.empty() && !sources[0].empty() && sources[0].back() == weight[0];
  if (!ok) return "attn_res_aggregate: weight [D] and at least one source [..., D] expected";
  for (const Dims& s : sources)
    if (s != sources[0]) return "attn_res_aggregate: sources of one shape expected";
  return "";
}

// a, b: lat_t and c, or with `halves` the key and value halves (`MlaCache`); any_key: its shape, or null when not
// given
inline std::string mla_attend_takes(const Dims& q, const Dims& a, const Dims& b, const Dims& visible,
                                    const Dims* any_key, bool halves, int64_t value_dim) {
  if (q.size() != 4 || a.size() != 4 || b.size() != 4 || a[0] != q[0] || a[1] != 1 || b[0] != q[0] || b[1] != 1)
    return "mla_attend: q [B, H, T, R] and latents [B, 1, ., .] expected";
  if (halves ? (b != a || q[3] > 2 * a[3] || value_dim < 1 || value_dim > q[3]) : (a[2] != q[3] || b[2] != a[3]))
    return halves ? "mla_attend: key / value halves [B, 1, S, W] with R <= 2W and 1 <= value_dim <= R expected"
                  : "mla_attend: latents [B, 1, R, S] and [B, 1, S, Dc] expected";
  const int64_t B = q[0], T = q[2], S = halves ? a[2] : a[3];
  const bool vis_ok = visible.size() == 2 ? visible == Dims{T, S}
                                          : visible.size() == 4 && (visible[0] == B || visible[0] == 1) &&
                                                visible[1] == 1 && visible[2] == T && visible[3] == S;
  if (!vis_ok) return "mla_attend: visible [T, S] or [B, 1, T, S] expected";
  if (any_key != nullptr && *any_key != Dims{B, 1, T, 1}) return "mla_attend: any_key [B, 1, T, 1] expected";
  return "";
}

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

// short_conv_kda: the short conv's x [B, T, 2HK + HV] (q | k | v of each token), g [B, T, H, K], initial_state
// [B, H, K, V]; H, K and V are read off g and initial_state
inline std::string short_conv_kda_takes(const Dims& state, const Dims& x, const Dims& taps, const Dims* start_shape,
                                        const int64_t* start, const Dims& g, const Dims& beta, const Dims& s0) {
  if (g.size() != 4 || s0.size() != 4 || x.size() != 3 || x != Dims{g[0], g[1], 2 * g[2] * g[3] + g[2] * s0[3]})
    return "short_conv_kda: g [B, T, H, K], initial_state [B, H, K, V] and x [B, T, 2 H K + H V] expected";
  const std::string conv = short_conv_takes(state, x, taps, start_shape, start);
  return conv.empty() ? kda_takes(g, g, Dims{g[0], g[1], g[2], s0[3]}, g, beta, s0) : conv;
}

inline std::string l2_norm_takes(const Dims& x) { return x.empty() ? "l2_norm: input of rank >= 1 expected" : ""; }

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

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

// moe_route into buffers of its own: the routed slots of moe_route_experts (fusions.fuse_moe_route_experts), which
// hands them to the experts in the same call instead of through two nodes
struct Routed {
  Routed(const float* logits, const float* bias, int64_t N, int64_t E, int64_t top_k, bool renormalize, float scale)
      : shape{N, top_k}, weights(N * top_k), indices(N * top_k) {
    moe_route(logits, bias, weights.data(), indices.data(), N, E, top_k, renormalize, scale);
  }
  Dims shape;  // [N, top_k], of both
  std::vector<float> weights;
  std::vector<int64_t> indices;
};

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

// ---------------------------------------------------------------------------------------------- routed experts
// The experts' products are C[t, r] = sum_f x_t[f] W[r, f] with W stored [rows, features] (the checkpoint's
// layout). A tile runs kR rows, each against up to kTT token-slots with one vector accumulator per slot, so each
// loaded weight vector serves kTT slots (a GEMM micro-kernel, without packing: the weights are the runtime's, read
// in place). Features go in chunks of 32, one MXFP4 block.
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
#else
typedef float vf __attribute__((vector_size(32)));
typedef float vfu __attribute__((vector_size(32), aligned(4)));
#endif
constexpr int kR = 4;  // rows per tile: the gate and up projections' rows in pairs (`moe_experts_rows`)
constexpr int kVL = sizeof(vf) / sizeof(float);
constexpr int kChunk = 32;  // features per step: one MXFP4 scale block
constexpr int kNV = kChunk / kVL;
constexpr int kTT = 4;  // token-slots per tile
// A work item on the runtime's pool is a span of kSpan rows of one selected expert's matrix: a decode step reads
// each as one stream from memory, whichever thread takes it (items that each took a 32-row block of every expert
// read 32 KB streams, and ran at ~0.7x the pace). Items own disjoint outputs: no locks, and the sums run in one
// order whatever the thread count. Inside an item, blocks of kRowBlock rows keep their sums in registers.
constexpr int64_t kSpan = 128;
constexpr int64_t kRowBlock = 32;
static_assert(kSpan % kRowBlock == 0, "a span is whole blocks");

// Bound of each per-slot buffer, the hidden activations [slots, I] and the outputs [slots, D] (the rest is the
// runtime's): longer inputs go in chunks of tokens, each reading the selected experts again (top-8 at a width of
// 2048: 1024 tokens a chunk).
constexpr int64_t kHiddenBytes = int64_t{64} << 20;

// A dense fp32 row: its chunk c as kNV vectors, its features in order.
struct DenseRow {
  static constexpr bool kDeinterleaved = false;
  const float* p;
  void chunk(int64_t c, vf* out) const {
    for (int v = 0; v < kNV; ++v) out[v] = *reinterpret_cast<const vfu*>(p + c * kChunk + v * kVL);
  }
  float at(int64_t f) const { return p[f]; }
};

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

// Position of feature j of a 32-feature chunk in the order `Mxfp4Row::chunk` decodes it: evens, then odds.
constexpr int64_t deinterleaved(int64_t j) { return j % 2 ? kChunk / 2 + j / 2 : j / 2; }

// rows x [rows, n] (n a multiple of kChunk) with each chunk's features in `deinterleaved` order, into out
inline void deinterleave(const float* x, int64_t rows, int64_t n, float* out) {
  for (int64_t i = 0; i < rows * n; i += kChunk)
    for (int64_t j = 0; j < kChunk; ++j) out[i + deinterleaved(j)] = x[i + j];
}

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

// h = act(g, up) over one vector: SiTU-GLU(beta1, beta2), or silu(g) * up
inline vf vact(vf g, vf up, bool situ, float beta1, float beta2) {
  if (situ) return beta1 * vtanh(g * (1.f / beta1)) * vsigmoid(g) * (beta2 * vtanh(up * (1.f / beta2)));
  return g * vsigmoid(g) * up;
}

// SiTU-GLU: beta1 tanh(g / beta1) sigmoid(g) * beta2 tanh(u / beta2), elementwise over n values, vectorised as the
// experts' gate (libm's tanh and exp one value at a time took 65 ms of a 512-token big_cfg prefill); a tail of
// fewer than a vector goes through the same vector code, so every element gets the same formula.
inline void situ_glu(const float* g, const float* u, float* out, int64_t n, float beta1, float beta2) {
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL)
    *reinterpret_cast<vfu*>(out + i) =
        vact(*reinterpret_cast<const vfu*>(g + i), *reinterpret_cast<const vfu*>(u + i), true, beta1, beta2);
  if (i < n) {
    vf gt{}, ut{};
    for (int64_t j = i; j < n; ++j) gt[j - i] = g[j], ut[j - i] = u[j];
    const vf a = vact(gt, ut, true, beta1, beta2);
    for (int64_t j = i; j < n; ++j) out[j] = a[j - i];
  }
}

// out[r] = sum_f x[f] * rows[r][f], f < n, for one token-slot and R dense rows in 256-bit vectors, whatever the
// build's width: such a product (a decode step's) is bound by its reads on any CPU, and on AMD Zen 4, whose
// 512-bit operations run as two 256-bit halves, a decode step's dense experts took 1.67 against 2.01 ms a call
// at 512 bits (bench/experts_cpu.py --baseline, 2 threads, 9 rounds).
template <int R>
inline void dense_rows_x1(const DenseRow* rows, const float* x, int64_t n, float* out) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v8u __attribute__((vector_size(32), aligned(4)));
  const int64_t whole = n / 8 * 8;
  for (int r = 0; r < R; ++r) {
    const float* p = rows[r].p;
    v8 acc = {};
    for (int64_t f = 0; f < whole; f += 8)
      acc += *reinterpret_cast<const v8u*>(p + f) * *reinterpret_cast<const v8u*>(x + f);
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += acc[i];
    for (int64_t f = whole; f < n; ++f) s += p[f] * x[f];
    out[r] = s;
  }
}

// out[t * R + r] = sum_f x[t][f] * rows[r][f], f < n, for TT slots and R rows. A tile reads its rows one after
// the other, each whole: a decode step streams its experts from memory, and R rows read a chunk at a time (R
// streams a row apart) with software prefetch ran a decode step's experts at ~0.7x the pace on one thread
// (bench/experts_cpu.py); the activations stay in L1 either way.
template <int R, int TT, class Row>
inline void tile(const Row* rows, const float* const* x, int64_t n, float* out) {
  if constexpr (TT == 1 && kVL > 8 && std::is_same_v<Row, DenseRow>) {
    dense_rows_x1<R>(rows, x[0], n, out);
    return;
  }
  const int64_t chunks = n / kChunk;
  for (int r = 0; r < R; ++r) {
    vf acc[TT] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      vf w[kNV];
      rows[r].chunk(c, w);
      for (int v = 0; v < kNV; ++v)
        for (int t = 0; t < TT; ++t) acc[t] += w[v] * *reinterpret_cast<const vfu*>(x[t] + c * kChunk + v * kVL);
    }
    for (int t = 0; t < TT; ++t) {
      float s = hsum(acc[t]);
      for (int64_t f = chunks * kChunk; f < n; ++f) s += rows[r].at(f) * x[t][f];  // a dense tail (n % 32)
      out[t * R + r] = s;
    }
  }
}

// `tile` for tt <= kTT slots (a tail of an expert's slots: decode has one)
template <int R, class Row>
inline void tile_n(int tt, const Row* rows, const float* const* x, int64_t n, float* out) {
  switch (tt) {
    case 4: tile<R, 4>(rows, x, n, out); break;
    case 3: tile<R, 3>(rows, x, n, out); break;
    case 2: tile<R, 2>(rows, x, n, out); break;
    default: tile<R, 1>(rows, x, n, out); break;
  }
}
static_assert(kTT == 4, "tile_n dispatches 1 to 4 slots");

// The cached latents an MLA attention reads, in either of two layouts. `lat_t` [B, R, S] (the latents transposed)
// with `c` [B, S, Dc] (their first Dc features): what the graph's own attention reads, copied out of the cache at
// every call. Or the contract's key / value halves themselves, `key` and `value` [B, S, W] with latent_s = key_s ++
// value_s, R <= 2W (graph.py's `latent_cache`): read in place, no copy of the cache.
struct MlaCache {
  const float* lat_t = nullptr;
  const float* c = nullptr;
  const float* key = nullptr;
  const float* value = nullptr;
  int64_t W = 0;
};

// mla_attend's inputs 1 and 2 as its bindings hand them over, a [B, 1, ., .] and b (`mla_attend_takes`): the cache
// they hold, its length S and the output's width Dc.
struct MlaInputs {
  MlaCache cache;
  int64_t S, Dc;
};
inline MlaInputs mla_inputs(bool halves, int64_t value_dim, const float* a, const Dims& as, const float* b,
                            const Dims& bs) {
  if (halves) return {{nullptr, nullptr, a, b, as[3]}, as[2], value_dim};
  return {{a, b, nullptr, nullptr, 0}, as[3], bs[3]};
}

// MLA attention over the latent cache, weights absorbed (graph.py's `mla` -> `attend`): for each query row (b, h, t),
// scores over the S cached latents, scale * (q . latent_s) where visible and `fill` elsewhere, softmax, times
// any_key[b, t] when given, and out = sum_s p_s c_s (c_s: latent_s's first Dc features). q [B, H, T, R]; `cache`
// (`MlaCache`); visible [B or 1, T, S]; any_key [B, T] or null; out [B, H, T, Dc]. One query position at a time: no
// [B, H, T, S] tensor at any length.
// The heads share the latents: a work item takes kMlaHeads heads of one (b, t), and its products run in register
// tiles of those heads by kMlaTile keys (or output features), so each latent is read once for all of them (a row
// at a time read the cache once per head and its sums from memory, ~4x slower at a 512-token prefill); the tiles'
// score and output sums run in the row-at-a-time loop's order. Keys past the last visible one (a causal prefill's tail) are
// skipped: their weights are exactly 0 once any key is visible. The key tiles read the latents transposed: from
// the halves, a call of more than kMlaRowQueries queries transposes them once into a buffer of its own, and a
// decode step's few queries take each key's row in place instead, its dot products summed across the vector (in
// another order: the scores differ in the last bits).
constexpr int64_t kMlaHeads = 4;
constexpr int64_t kMlaTile = 2 * kVL;
constexpr int64_t kMlaRowQueries = 4;
inline void mla_attend(const float* q, const MlaCache& cache, const bool* visible, bool visible_per_batch,
                       const float* any_key, float* out, int64_t B, int64_t H, int64_t T, int64_t R, int64_t S,
                       int64_t Dc, float scale, float fill, const Parallel& par = {}) {
  constexpr int NV = kMlaTile / kVL;
  const int64_t blocks = (H + kMlaHeads - 1) / kMlaHeads, W = cache.W;
  const float* lat_t = cache.lat_t;
  std::vector<float> transposed;
  if (lat_t == nullptr && T > kMlaRowQueries) {
    transposed.resize(B * R * S);
    par(B * R, [&](int64_t lo, int64_t hi) {
      for (int64_t bf = lo; bf < hi; ++bf) {
        const int64_t b = bf / R, f = bf % R;
        const float* src = (f < W ? cache.key + f : cache.value + f - W) + b * S * W;
        float* dst = transposed.data() + bf * S;
        for (int64_t s = 0; s < S; ++s) dst[s] = src[s * W];
      }
    });
    lat_t = transposed.data();
  }
  par(B * T * blocks, [&](int64_t lo, int64_t hi) {
    std::vector<float> p(kMlaHeads * S);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / (T * blocks), t = item / blocks % T, h0 = item % blocks * kMlaHeads;
      const int64_t nh = std::min(kMlaHeads, H - h0);
      const bool* vis = visible + ((visible_per_batch ? b * T : 0) + t) * S;
      const float* qk[kMlaHeads];
      float* ok[kMlaHeads];
      for (int64_t k = 0; k < kMlaHeads; ++k) {  // heads past H repeat the last, their sums unused
        const int64_t row = (b * H + h0 + std::min(k, nh - 1)) * T + t;
        qk[k] = q + row * R;
        ok[k] = out + row * Dc;
      }
      int64_t end = S;
      while (end > 0 && !vis[end - 1]) --end;
      if (end == 0) end = S;  // no key visible: every weight is the fill's, as the full softmax gives
      if (lat_t != nullptr) {
        // scores p[k][s] = q_k . latent_s, tiles of kMlaTile keys, the sum over i in registers (a tile that crosses
        // `end` computes keys it does not need rather than run them one by one: each reads R strided floats)
        const float* lt = lat_t + b * R * S;
        int64_t s0 = 0;
        for (; s0 < end && s0 + kMlaTile <= S; s0 += kMlaTile) {
          vf acc[kMlaHeads][NV] = {};
          for (int64_t i = 0; i < R; ++i) {
            vf l[NV];
            for (int v = 0; v < NV; ++v) l[v] = *reinterpret_cast<const vfu*>(lt + i * S + s0 + v * kVL);
            for (int64_t k = 0; k < kMlaHeads; ++k)
              for (int v = 0; v < NV; ++v) acc[k][v] += qk[k][i] * l[v];
          }
          for (int64_t k = 0; k < nh; ++k)
            for (int v = 0; v < NV; ++v) *reinterpret_cast<vfu*>(&p[k * S + s0 + v * kVL]) = acc[k][v];
        }
        if (s0 < end) {  // the cache's last keys, fewer than a tile
          for (int64_t k = 0; k < nh; ++k) std::fill(&p[k * S + s0], &p[k * S + end], 0.f);
          for (int64_t i = 0; i < R; ++i)
            for (int64_t k = 0; k < nh; ++k)
              for (int64_t s = s0; s < end; ++s) p[k * S + s] += qk[k][i] * lt[i * S + s];
        }
      } else {  // the halves' rows in place: each key's features in vectors, one sum across the vector a head
        for (int64_t s = 0; s < end; ++s) {
          vf acc[kMlaHeads] = {};
          float rest[kMlaHeads] = {};
          for (int64_t half = 0; half < 2 && half * W < R; ++half) {
            const float* row = (half ? cache.value : cache.key) + (b * S + s) * W;
            const int64_t f0 = half * W, n = std::min(W, R - f0);
            int64_t i = 0;
            for (; i + kVL <= n; i += kVL) {
              const vf l = *reinterpret_cast<const vfu*>(row + i);
              for (int64_t k = 0; k < kMlaHeads; ++k) acc[k] += *reinterpret_cast<const vfu*>(qk[k] + f0 + i) * l;
            }
            for (; i < n; ++i)
              for (int64_t k = 0; k < kMlaHeads; ++k) rest[k] += qk[k][f0 + i] * row[i];
          }
          for (int64_t k = 0; k < nh; ++k) p[k * S + s] = hsum(acc[k]) + rest[k];
        }
      }
      for (int64_t k = 0; k < nh; ++k) {  // softmax, vectorised (scalar exp took most of a prefill's attention)
        float* pk = p.data() + k * S;
        float m = -INFINITY;
        for (int64_t s = 0; s < end; ++s) m = std::max(m, pk[s] = vis[s] ? pk[s] * scale : fill);
        vf zv{};
        int64_t s = 0;
        for (; s + kVL <= end; s += kVL) {  // below e^-87 a weight is 0, as a masked key's (e^-inf) is
          const vf d = *reinterpret_cast<const vfu*>(pk + s) - m;
          const vf e = d < -87.f ? vf{} : vexp(d);
          *reinterpret_cast<vfu*>(pk + s) = e;
          zv += e;
        }
        float z = hsum(zv);
        for (; s < end; ++s) z += (pk[s] = std::exp(pk[s] - m));
        const float w = (any_key ? any_key[b * T + t] : 1.f) / z;
        for (s = 0; s < end; ++s) pk[s] *= w;
      }
      // out[k][j] = sum_s p[k][s] c_s[j], tiles of kMlaTile features (then of one vector), the sum over s in
      // registers; c_s's features [0, n) are row s of `base` (row stride `stride`), written from out feature `at`
      auto tiles = [&](auto nv, const float* base, int64_t stride, int64_t j0, int64_t at) {
        constexpr int V = decltype(nv)::value;
        vf acc[kMlaHeads][V] = {};
        for (int64_t s = 0; s < end; ++s) {
          vf cv[V];
          for (int v = 0; v < V; ++v) cv[v] = *reinterpret_cast<const vfu*>(base + s * stride + j0 + v * kVL);
          for (int64_t k = 0; k < kMlaHeads; ++k) {
            const float a = p[std::min(k, nh - 1) * S + s];
            for (int v = 0; v < V; ++v) acc[k][v] += a * cv[v];
          }
        }
        for (int64_t k = 0; k < nh; ++k)
          for (int v = 0; v < V; ++v) *reinterpret_cast<vfu*>(ok[k] + at + j0 + v * kVL) = acc[k][v];
      };
      auto values = [&](const float* base, int64_t stride, int64_t n, int64_t at) {
        int64_t j0 = 0;
        for (; j0 + kMlaTile <= n; j0 += kMlaTile) tiles(std::integral_constant<int, NV>{}, base, stride, j0, at);
        for (; j0 + kVL <= n; j0 += kVL) tiles(std::integral_constant<int, 1>{}, base, stride, j0, at);
        for (int64_t k = 0; k < nh; ++k)
          for (int64_t j = j0; j < n; ++j) {
            float acc = 0.f;
            for (int64_t s = 0; s < end; ++s) acc += p[k * S + s] * base[s * stride + j];
            ok[k][at + j] = acc;
          }
      };
      if (cache.c != nullptr) {
        values(cache.c + b * S * Dc, Dc, Dc, 0);
      } else {
        values(cache.key + b * S * W, W, std::min(W, Dc), 0);
        if (Dc > W) values(cache.value + b * S * W, W, Dc - W, W);
      }
    }
  });
}

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

// KDA's short convolution, the L2 normalisation of q and k, and the recurrence in one call
// (fusions.fuse_short_conv_kda): what three nodes and the split between them did. x [B, T, C = 2HK + HV] is each
// token's q | k | v before the conv; state, present [B, C, W-1]; taps [W, C]; g [B, T, H, K]; beta [B, T, H];
// s0, s1 [B, H, K, V]; o [B, T, H, V].
inline void short_conv_kda(const float* state, const float* x, const float* taps, const int64_t* start,
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

// Routed experts: u[n] = sum_j weights[n, j] W2[e] act(W1[e] z[n], W3[e] z[n]), e = indices[n, j]; act situ =
// SiTU-GLU(beta1, beta2), else silu(gate) * up. z [N, D]; u [N, D]; `rows(m, e, r)`: row r of matrix m (0: w1,
// 1: w3 [E, I, D]; 2: w2 [E, D, I]) of expert e. Each selected expert runs once on all its token-slots (a prefill
// reads it once, not once per token); experts no slot chose are not read. indices must lie in [0, E).
template <class Rows>
inline void moe_experts_rows(const float* z, const float* weights, const int64_t* indices, const Rows& rows, float* u,
                             int64_t N, int64_t top_k, int64_t E, int64_t D, int64_t I, bool situ, float beta1,
                             float beta2, const Parallel& par) {
  using Row = decltype(rows(0, 0, 0));
  // MXFP4 rows take their activations chunk by chunk in `deinterleaved` order (D and I are whole chunks there):
  // z rearranged once a call, h written so
  constexpr bool deint = Row::kDeinterleaved;
  static_assert(kRowBlock == kChunk, "a block of h's rows is one chunk of w2's features");
  std::vector<float> zd;
  if constexpr (deint) {
    zd.resize(N * D);
    deinterleave(z, N, D, zd.data());
    z = zd.data();
  }
  std::fill(u, u + N * D, 0.f);
  const int64_t chunk = std::max<int64_t>(1, kHiddenBytes / (int64_t(sizeof(float)) * top_k * std::max(I, D)));
  std::vector<int64_t> start(E + 1), slot;
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first row)
  std::vector<float> h, y;
  // items of every selected expert's `n_rows` rows, kSpan at a time, expert by expert
  auto spans = [&](int64_t n_rows) {
    items.clear();
    for (int64_t e = 0; e < E; ++e)
      if (start[e] < start[e + 1])
        for (int64_t r = 0; r < n_rows; r += kSpan) items.emplace_back(e, r);
    return static_cast<int64_t>(items.size());
  };
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n1 = std::min(N, n0 + chunk), S = (n1 - n0) * top_k;
    // the chunk's token-slots grouped by expert (a counting sort, stable): expert e's are slot[start[e]:start[e+1]]
    std::fill(start.begin(), start.end(), 0);
    for (int64_t s = n0 * top_k; s < n1 * top_k; ++s) ++start[indices[s] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    slot.resize(S);
    {
      std::vector<int64_t> at(start.begin(), start.end() - 1);
      for (int64_t s = n0 * top_k; s < n1 * top_k; ++s) slot[at[indices[s]]++] = s;
    }
    h.resize(S * I);  // h[p]: slot[p]'s hidden activation
    y.resize(S * D);  // y[p]: slot[p]'s expert output, before its routing weight
    // w1, w3: an item computes its rows of h for every slot of its expert
    par(spans(I), [&](int64_t lo, int64_t hi) {
      constexpr int H = kR / 2;  // rows of w1 and as many of w3
      static_assert(kRowBlock % kVL == 0, "a block's activations are whole vectors");
      const float* x[kTT];
      float out[kTT * kR];
      Row rw[kR];
      vf gate[kTT][kRowBlock / kVL] = {}, up[kTT][kRowBlock / kVL] = {};  // the block's sums, then activated
      for (int64_t it = lo; it < hi; ++it) {
        const auto [e, span] = items[it];
        for (int64_t r0 = span; r0 < std::min(I, span + kSpan); r0 += kRowBlock) {
          const int64_t r1 = std::min(I, r0 + kRowBlock);
          for (int64_t p = start[e]; p < start[e + 1]; p += kTT) {
            const int tt = static_cast<int>(std::min<int64_t>(kTT, start[e + 1] - p));
            for (int t = 0; t < tt; ++t) x[t] = z + (slot[p + t] / top_k) * D;
            for (int64_t r = r0; r < r1; r += H) {
              const int rt = static_cast<int>(std::min<int64_t>(H, r1 - r));
              for (int k = 0; k < H; ++k) {  // rows past the end repeat the last, their sums unused
                rw[k] = rows(0, e, r + std::min(k, rt - 1));
                rw[H + k] = rows(1, e, r + std::min(k, rt - 1));
              }
              tile_n<kR>(tt, rw, x, D, out);
              for (int t = 0; t < tt; ++t)
                for (int k = 0; k < rt; ++k) {
                  reinterpret_cast<float*>(gate[t])[r - r0 + k] = out[t * kR + k];
                  reinterpret_cast<float*>(up[t])[r - r0 + k] = out[t * kR + H + k];
                }
            }
            for (int t = 0; t < tt; ++t) {
              float* ht = h.data() + (p + t) * I + r0;
              for (int v = 0; v < kRowBlock / kVL; ++v) {
                const vf a = vact(gate[t][v], up[t][v], situ, beta1, beta2);
                for (int k = 0; k < kVL && v * kVL + k < r1 - r0; ++k)
                  ht[deint ? deinterleaved(v * kVL + k) : v * kVL + k] = a[k];  // a block of rows is a chunk of h
              }
            }
          }
        }
      }
    });
    // w2: an item computes its columns of y for every slot of its expert
    par(spans(D), [&](int64_t lo, int64_t hi) {
      const float* x[kTT];
      float out[kTT * kR];
      Row rw[kR];
      for (int64_t it = lo; it < hi; ++it) {
        const auto [e, span] = items[it];
        for (int64_t p = start[e]; p < start[e + 1]; p += kTT) {
          const int tt = static_cast<int>(std::min<int64_t>(kTT, start[e + 1] - p));
          for (int t = 0; t < tt; ++t) x[t] = h.data() + (p + t) * I;
          for (int64_t r = span; r < std::min(D, span + kSpan); r += kR) {
            const int rt = static_cast<int>(std::min<int64_t>(kR, D - r));
            for (int k = 0; k < kR; ++k) rw[k] = rows(2, e, r + std::min(k, rt - 1));
            tile_n<kR>(tt, rw, x, I, out);
            for (int t = 0; t < tt; ++t)
              for (int k = 0; k < rt; ++k) y[(p + t) * D + r + k] = out[t * kR + k];
          }
        }
      }
    });
    // u[token] += weight * y, the slots in expert order (as sorted), by blocks of columns
    par((D + kRowBlock - 1) / kRowBlock, [&](int64_t lo, int64_t hi) {
      const int64_t c0 = lo * kRowBlock, c1 = std::min(D, hi * kRowBlock);
      for (int64_t p = 0; p < S; ++p) {
        const int64_t s = slot[p];
        const float w = weights[s], *yp = y.data() + p * D;
        float* ut = u + (s / top_k) * D;
        for (int64_t c = c0; c < c1; ++c) ut[c] += w * yp[c];
      }
    });
  }
}

// Dense fp32 experts: w1, w3 [E, I, D]; w2 [E, D, I].
inline void moe_experts(const float* z, const float* weights, const int64_t* indices, const float* w1,
                        const float* w3, const float* w2, float* u, int64_t N, int64_t top_k, int64_t E, int64_t D,
                        int64_t I, bool situ, float beta1, float beta2, const Parallel& par = {}) {
  const float* w[3] = {w1, w3, w2};
  const int64_t cols[3] = {D, D, I}, rows[3] = {I, I, D};
  moe_experts_rows(
      z, weights, indices,
      [&](int m, int64_t e, int64_t r) { return DenseRow{w[m] + (e * rows[m] + r) * cols[m]}; }, u, N, top_k, E, D,
      I, situ, beta1, beta2, par);
}

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
