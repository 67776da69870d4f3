// k3::moe_experts: the routed experts on dense fp32 weights, and the tiled products that its 4-bit forms
// (moe_experts_mxfp4.h, moe_experts_nvfp4.h) run on rows of their own.
#pragma once

#include "situ_glu.h"

namespace k3 {

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

// The experts' products are C[t, r] = sum_f x_t[f] W[r, f] with W stored [rows, features] (the checkpoint's
// layout). A tile runs kR rows, each against up to kTT token-slots with one vector accumulator per slot, so each
// loaded weight vector serves kTT slots (a GEMM micro-kernel, without packing: the weights are the runtime's, read
// in place). Features go in chunks of 32, one MXFP4 block.
constexpr int kR = 4;  // rows per tile: the gate and up projections' rows in pairs (`moe_experts_rows`)
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

// Position of feature j of a 32-feature chunk in the order `Mxfp4Row::chunk` decodes it: evens, then odds.
constexpr int64_t deinterleaved(int64_t j) { return j % 2 ? kChunk / 2 + j / 2 : j / 2; }

// rows x [rows, n] (n a multiple of kChunk) with each chunk's features in `deinterleaved` order, into out
inline void deinterleave(const float* x, int64_t rows, int64_t n, float* out) {
  for (int64_t i = 0; i < rows * n; i += kChunk)
    for (int64_t j = 0; j < kChunk; ++j) out[i + deinterleaved(j)] = x[i + j];
}

// A 32-feature block of activations rounded to int8 (k3export/ops/spec.py MOE_EXPERTS_MXFP4, its
// `quantize_activations`): x ~ d q, d = max|x| / 127, q = round(x / d) (half to even, ONNX QuantizeLinear's
// rounding) in [-127, 127]; an all-zero block has d = 0 and zero codes. The codes lie in the order of x.
struct Q8Block {
  float d;
  int8_t q[kChunk];
};

// x [blocks * 32] into blocks (the features in place: x rearranged by `deinterleave` keeps that order)
inline void quantize_q8(const float* x, int64_t blocks, Q8Block* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kChunk;
    float amax = 0.f;
    for (int j = 0; j < kChunk; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f;
    out[b].d = d;
    for (int j = 0; j < kChunk; ++j)  // x / d, not x * (1 / d): QuantizeLinear's quotient
      out[b].q[j] = d == 0.f ? 0 : static_cast<int8_t>(std::nearbyint(xb[j] / d));
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
template <int R, class Row, class X>
inline void tile_n(int tt, const Row* rows, const X* const* x, int64_t n, float* out) {
  switch (tt) {
    case 4: tile<R, 4>(rows, x, n, out); break;
    case 3: tile<R, 3>(rows, x, n, out); break;
    case 2: tile<R, 2>(rows, x, n, out); break;
    default: tile<R, 1>(rows, x, n, out); break;
  }
}
static_assert(kTT == 4, "tile_n dispatches 1 to 4 slots");

// Routed experts: u[n] = sum_j weights[n, j] W2[e] act(W1[e] z[n], W3[e] z[n]), e = indices[n, j]; act situ =
// SiTU-GLU(beta1, beta2), else silu(gate) * up. z [N, D]; u [N, D]; `rows(m, e, r)`: row r of matrix m (0: w1,
// 1: w3 [E, I, D]; 2: w2 [E, D, I]) of expert e. Each selected expert runs once on all its token-slots (a prefill
// reads it once, not once per token); experts no slot chose are not read. indices must lie in [0, E). Q8: z and h
// rounded per 32-feature block (`quantize_q8`) and the products on their codes (rows of a `tile` that takes
// `Q8Block`s: MXFP4's).
template <bool Q8 = false, class Rows>
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
  // the products' activations: rows of z and h as floats, or (Q8) as blocks, one per chunk of a row
  using X = std::conditional_t<Q8, Q8Block, float>;
  auto act_row = [](const X* base, int64_t row, int64_t n) { return base + row * (Q8 ? n / kChunk : n); };
  std::vector<Q8Block> zq, hq;
  const X* zx;
  if constexpr (Q8) {
    zq.resize(N * D / kChunk);
    par(N, [&](int64_t lo, int64_t hi) { quantize_q8(z + lo * D, (hi - lo) * D / kChunk, zq.data() + lo * D / kChunk); });
    zx = zq.data();
  } else {
    zx = z;
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
      const X* x[kTT];
      float out[kTT * kR];
      Row rw[kR];
      vf gate[kTT][kRowBlock / kVL] = {}, up[kTT][kRowBlock / kVL] = {};  // the block's sums, then activated
      for (int64_t it = lo; it < hi; ++it) {
        const auto [e, span] = items[it];
        for (int64_t r0 = span; r0 < std::min(I, span + kSpan); r0 += kRowBlock) {
          const int64_t r1 = std::min(I, r0 + kRowBlock);
          for (int64_t p = start[e]; p < start[e + 1]; p += kTT) {
            const int tt = static_cast<int>(std::min<int64_t>(kTT, start[e + 1] - p));
            for (int t = 0; t < tt; ++t) x[t] = act_row(zx, slot[p + t] / top_k, D);
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
    const X* hx;
    if constexpr (Q8) {
      hq.resize(S * I / kChunk);
      par(S, [&](int64_t lo, int64_t hi) {
        quantize_q8(h.data() + lo * I, (hi - lo) * I / kChunk, hq.data() + lo * I / kChunk);
      });
      hx = hq.data();
    } else {
      hx = h.data();
    }
    // w2: an item computes its columns of y for every slot of its expert
    par(spans(D), [&](int64_t lo, int64_t hi) {
      const X* x[kTT];
      float out[kTT * kR];
      Row rw[kR];
      for (int64_t it = lo; it < hi; ++it) {
        const auto [e, span] = items[it];
        for (int64_t p = start[e]; p < start[e + 1]; p += kTT) {
          const int tt = static_cast<int>(std::min<int64_t>(kTT, start[e + 1] - p));
          for (int t = 0; t < tt; ++t) x[t] = act_row(hx, p + t, I);
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

}  // namespace k3
