// k3::situ_glu: the SiTU-GLU gate, and the experts' activation vectorised (`vact`).
#pragma once

#include "common.h"

namespace k3 {

inline std::string situ_glu_takes(const Dims& gate, const Dims& up) {
  return gate == up ? "" : "situ_glu: inputs 'gate' and 'up' of one shape expected";
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

}  // namespace k3
