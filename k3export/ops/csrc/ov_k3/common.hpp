// What every OpenVINO operation of the k3 extension shares: the kernels' thread pool on OpenVINO's TBB arena,
// input checks, and OpenVINO tensors as the kernels take them (kernels/common.h).
#pragma once

#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "../kernels/common.h"
#include "k3_attributes.h"

namespace k3ov {

// k3::Parallel on the TBB arena the CPU plugin runs the node in: [0, n) in up to 16 ranges, one task each
void tbb_run(void*, int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  const int64_t parts = std::min<int64_t>(n, 16);
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, parts, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t i = r.begin(); i < r.end(); ++i) body(n * i / parts, n * (i + 1) / parts);
      },
      tbb::simple_partitioner());
}

const k3::Parallel kPool{&tbb_run, nullptr};

using ov::element::Type_t;

// The shape of input `i` when it is static (the node's checks run in validate_and_infer_types only then)
bool known(const ov::Node* node, size_t i) { return node->get_input_partial_shape(i).is_static(); }

void want(const ov::Node* node, size_t i, Type_t type, const char* what) {
  const auto t = node->get_input_element_type(i);
  NODE_VALIDATION_CHECK(node, t == type || t.is_dynamic(), "k3::", node->get_type_info().name, ": input ", i, " (",
                        what, ") of type ", ov::element::Type(type), " expected, got ", t);
}

// A tensor of indices as int64 values: the CPU plugin narrows i64 tensors to i32 between its nodes (`wide` holds the copy).
const int64_t* as_i64(const ov::Tensor& t, std::vector<int64_t>& wide) {
  if (t.get_element_type() != ov::element::i32) return t.data<const int64_t>();
  const int32_t* narrow = t.data<const int32_t>();
  wide.assign(narrow, narrow + t.get_size());
  return wide.data();
}

// A tensor's shape as the kernels' checks take it (kernels/common.h)
k3::Dims dims(const ov::Tensor& t) {
  const auto s = t.get_shape();
  return k3::Dims(s.begin(), s.end());
}

// Input `i` of indices: i64 as the export writes them, or i32 (the CPU plugin narrows i64 tensors between its nodes)
void want_index(const ov::Node* node, size_t i, const char* what) {
  const auto t = node->get_input_element_type(i);
  NODE_VALIDATION_CHECK(node, t == ov::element::i64 || t == ov::element::i32 || t.is_dynamic(), "k3::",
                        node->get_type_info().name, ": input ", i, " (", what, ") of type i64 or i32 expected, got ",
                        t);
}

// Optional index input `i` as the kernels take it: its int64 values and shape, or nulls where `in` has no input i
struct OptionalIndex {
  OptionalIndex(const ov::TensorVector& in, size_t i) {
    if (in.size() > i) data = as_i64(in[i], wide), shape = dims(in[i]);
  }
  OptionalIndex(const OptionalIndex&) = delete;  // `data` may point into `wide`
  const k3::Dims* dims_or_null() const { return data ? &shape : nullptr; }
  std::vector<int64_t> wide;
  const int64_t* data = nullptr;
  k3::Dims shape;
};

// An operation's attributes (k3::attrs::<Op>, generated from k3export/ops/spec.py) to OpenVINO's visitor
template <class Attrs>
void visit(Attrs& a, ov::AttributeVisitor& v) {
  a.visit([&v](const char* name, auto& value, bool) { v.on_attribute(name, value); });
}

// A node's act attribute as the kernels take it
template <class Attrs>
bool situ(const Attrs& a) { return a.act == "situ"; }

// A kernel's check (`<op>_takes`): "" passes, anything else is OpenVINO's error
void check(const std::string& why) { OPENVINO_ASSERT(why.empty(), "k3::", why); }

}  // namespace k3ov
