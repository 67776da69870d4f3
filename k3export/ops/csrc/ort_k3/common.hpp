// What every ONNX Runtime kernel of the k3 library shares: errors, the kernels' thread pool on ORT's intra-op
// threads, a node's attributes read through the op table's structs (k3_attributes.h), and optional inputs.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT
#include <onnxruntime_lite_custom_op.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "../kernels/common.h"
#include "k3_attributes.h"

namespace k3ort {

using Ort::Custom::Tensor;

Ort::Status fail(const std::string& msg) { return Ort::Status(("k3::" + msg).c_str(), ORT_INVALID_ARGUMENT); }

// k3::Parallel on ORT's intra-op thread pool: [0, n) in up to 16 ranges, one ParallelFor task each
struct Ranges {
  int64_t n, parts;
  const std::function<void(int64_t, int64_t)>* body;
};

void ort_run(void* ctx, int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  Ranges r{n, std::min<int64_t>(n, 16), &body};
  Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(
      static_cast<const OrtKernelContext*>(ctx),
      [](void* data, size_t i) {
        const auto* r = static_cast<const Ranges*>(data);
        const int64_t i0 = static_cast<int64_t>(i);
        const int64_t lo = r->n * i0 / r->parts, hi = r->n * (i0 + 1) / r->parts;
        (*r->body)(lo, hi);
      },
      static_cast<size_t>(r.parts), 0, &r));
}

k3::Parallel pool(OrtKernelContext* ctx) { return k3::Parallel{&ort_run, ctx}; }

// A node's attributes as the op table declares them (k3::attrs::<Op>, generated from k3export/ops/spec.py): a
// required one the node lacks is ORT's error naming it; an optional one (a library attribute) keeps its zero
template <class Attrs>
Attrs read(const OrtKernelInfo* info) {
  Attrs a{};
  a.visit([info](const char* name, auto& value, bool required) {
    using T = std::decay_t<decltype(value)>;
    try {
      value = Ort::ConstKernelInfo(info).GetAttribute<T>(name);
    } catch (const Ort::Exception&) {
      if (required) throw;
    }
  });
  return a;
}

// What each kernel struct is: its op's attributes (k3::attrs::<Op>, whose `name` it registers under) read once,
// when ORT makes the kernel; the struct adds its typed Compute (ORT's lite custom-op API)
template <class A>
struct Kernel {
  using Attrs = A;
  Kernel(const OrtApi*, const OrtKernelInfo* info) : a(read<A>(info)) {}
  A a;
};

// An optional index input as the kernels take it: its values and shape, or nulls where it is not given
struct OptionalIndex {
  explicit OptionalIndex(std::optional<const Tensor<int64_t>*> t) {
    if (t.has_value() && *t != nullptr) data = (*t)->Data(), shape = (*t)->Shape();
  }
  const k3::Dims* dims_or_null() const { return data ? &shape : nullptr; }
  const int64_t* data = nullptr;
  k3::Dims shape;
};

}  // namespace k3ort
