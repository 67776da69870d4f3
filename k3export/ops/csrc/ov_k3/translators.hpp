// The ONNX frontend's k3 nodes: each node of domain "k3" (its inputs and attributes as the export writes them,
// k3export/ops/spec.py) converted to the OpenVINO operation of the same name.
#pragma once

#include <openvino/frontend/onnx/extension/conversion.hpp>

#include <type_traits>

#include "common.hpp"

namespace k3ov {

using ov::frontend::NodeContext;

// An ONNX node's attributes as the op table declares them (k3::attrs::<Op>): a required one the node lacks is the
// frontend's error naming it, an optional one keeps its zero
template <class Attrs>
Attrs read(const NodeContext& node) {
  Attrs a{};
  a.visit([&node](const char* name, auto& value, bool required) {
    using T = std::decay_t<decltype(value)>;
    value = required ? node.get_attribute<T>(name) : node.get_attribute<T>(name, value);
  });
  return a;
}

// The conversion of the k3 nodes named as operation `Op`'s entry in the op table (`Op::Attrs::name`) into `Op`
template <class Op>
ov::Extension::Ptr onnx_node() {
  return std::make_shared<ov::frontend::onnx::ConversionExtension>(
      Op::Attrs::name, "k3", [](const NodeContext& node) {
        ov::OutputVector args;
        for (size_t i = 0; i < node.get_input_size(); ++i) args.push_back(node.get_input(static_cast<int>(i)));
        return std::make_shared<Op>(args, read<typename Op::Attrs>(node))->outputs();
      });
}

}  // namespace k3ov
