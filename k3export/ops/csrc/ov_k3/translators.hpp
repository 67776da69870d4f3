// The ONNX frontend's k3 nodes: each node of domain "k3" (its inputs and attributes as the export writes them,
// k3export/ops/spec.py) converted to the OpenVINO operation of the same name.
#pragma once

#include <openvino/frontend/onnx/extension/conversion.hpp>

#include "moe_experts.hpp"
#include "moe_route.hpp"

namespace k3ov {

using ov::frontend::NodeContext;

ov::OutputVector inputs(const NodeContext& node) {
  ov::OutputVector args;
  for (size_t i = 0; i < node.get_input_size(); ++i) args.push_back(node.get_input(static_cast<int>(i)));
  return args;
}

template <class Op, class... A>
ov::OutputVector make(const NodeContext& node, A... attrs) {
  return std::make_shared<Op>(inputs(node), attrs...)->outputs();
}

// moe_route's attributes on an ONNX node (moe_route, moe_route_experts)
RouteAttrs route_attrs(const NodeContext& n) {
  return {n.get_attribute<int64_t>("top_k"), n.get_attribute<int64_t>("renormalize") != 0,
          n.get_attribute<float>("scale")};
}

// moe_experts' attributes on an ONNX node (moe_experts, moe_route_experts)
ExpertsAttrs experts_attrs(const NodeContext& n) {
  return {n.get_attribute<std::string>("act") == "situ", n.get_attribute<float>("beta1"),
          n.get_attribute<float>("beta2")};
}

ov::Extension::Ptr onnx_node(const char* name, ov::frontend::CreatorFunction convert) {
  return std::make_shared<ov::frontend::onnx::ConversionExtension>(name, "k3", convert);
}

}  // namespace k3ov
