// k3::mla_attend: MLA attention over the latent cache, weights absorbed.
#pragma once

#include "common.h"

namespace k3 {

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

}  // namespace k3
