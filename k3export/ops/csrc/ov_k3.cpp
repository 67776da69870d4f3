// OpenVINO binding of the k3 ops (fp32, CPU): OpenVINO operations whose names, inputs, outputs and attributes are
// the ONNX functions' (k3export/ops/spec.py), and ONNX frontend conversions that map the nodes of domain "k3" of an
// export's functions form (its fused ops included) onto them, so OpenVINO runs one kernel where its frontend
// has no function to expand. The kernels, and the shapes each takes, are kernels/<op>.h; this file only maps OpenVINO
// tensors onto them. Loaded with core.add_extension(path).
//
// One file per operation under ov_k3/ (its class, over kernels/<op>.h), the ONNX frontend's translators in
// ov_k3/translators.hpp, each node's attributes read through the op table's structs (k3_attributes.h, generated from
// spec.py by the build); this file is the entry point: the extensions OpenVINO loads.
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>

#include "ov_k3/attn_res_aggregate.hpp"
#include "ov_k3/kda.hpp"
#include "ov_k3/kda_layer.hpp"
#include "ov_k3/l2_norm.hpp"
#include "ov_k3/mla_attend.hpp"
#include "ov_k3/moe_experts.hpp"
#include "ov_k3/moe_route.hpp"
#include "ov_k3/moe_route_experts.hpp"
#include "ov_k3/short_conv.hpp"
#include "ov_k3/situ_glu.hpp"
#include "ov_k3/translators.hpp"

using namespace k3ov;

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<Kda>>(),
    std::make_shared<ov::OpExtension<SituGlu>>(),
    std::make_shared<ov::OpExtension<MoeRoute>>(),
    std::make_shared<ov::OpExtension<MoeExperts>>(),
    std::make_shared<ov::OpExtension<AttnResAggregate>>(),
    std::make_shared<ov::OpExtension<MlaAttend>>(),
    std::make_shared<ov::OpExtension<ShortConv>>(),
    std::make_shared<ov::OpExtension<L2Norm>>(),
    std::make_shared<ov::OpExtension<KdaLayer>>(),
    std::make_shared<ov::OpExtension<MoeRouteExperts>>(),
    onnx_node<Kda>(),
    onnx_node<SituGlu>(),
    onnx_node<MoeRoute>(),
    onnx_node<MoeExperts>(),
    onnx_node<AttnResAggregate>(),
    onnx_node<MlaAttend>(),
    onnx_node<ShortConv>(),
    onnx_node<L2Norm>(),
    onnx_node<KdaLayer>(),
    onnx_node<MoeRouteExperts>(),
}));
