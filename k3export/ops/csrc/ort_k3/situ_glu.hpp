// ONNX Runtime kernel k3::situ_glu over kernels/situ_glu.h (ort_k3.cpp registers it).
#pragma once

#include "common.hpp"
#include "../kernels/situ_glu.h"

namespace k3ort {

struct SituGlu : Kernel<k3::attrs::SituGlu> {
  using Kernel::Kernel;
  Ort::Status Compute(const Tensor<float>& gate, const Tensor<float>& up, Tensor<float>& out) {
    if (auto why = k3::situ_glu_takes(gate.Shape(), up.Shape()); !why.empty()) return fail(why);
    k3::situ_glu(gate.Data(), up.Data(), out.Allocate(gate.Shape()), gate.NumberOfElement(), a.beta1, a.beta2);
    return Ort::Status{nullptr};
  }
};

}  // namespace k3ort
