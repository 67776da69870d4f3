// ONNX Runtime binding of the k3 ops (fp32, CPU): custom ops of domain "k3" whose names, inputs, outputs and
// attributes are the ONNX functions' (k3export/ops/spec.py), so ORT runs one kernel where it would otherwise expand
// the node's function body, the fused ops the exporter writes included (spec.py's FUSED_SPECS).
//
// One file per op under ort_k3/ (its kernel struct, over kernels/<op>.h, which holds the kernel and the shapes it
// takes), what they share in ort_k3/common.hpp, each node's attributes read through the op table's structs
// (k3_attributes.h, generated from spec.py by the build); this file is the entry point: the registrations.
#include <memory>
#include <mutex>
#include <vector>

#include "ort_k3/attn_res_aggregate.hpp"
#include "ort_k3/kda.hpp"
#include "ort_k3/kda_layer.hpp"
#include "ort_k3/l2_norm.hpp"
#include "ort_k3/mla_attend.hpp"
#include "ort_k3/moe_experts.hpp"
#include "ort_k3/moe_route.hpp"
#include "ort_k3/moe_route_experts.hpp"
#include "ort_k3/short_conv.hpp"
#include "ort_k3/situ_glu.hpp"

using namespace k3ort;

// The custom op of `Kernel`, under its op's name in the table (k3::attrs::<Op>::name)
template <class Kernel>
std::unique_ptr<OrtCustomOp> op() {
  return std::unique_ptr<OrtCustomOp>(
      Ort::Custom::CreateLiteCustomOp<Kernel>(Kernel::Attrs::name, "CPUExecutionProvider"));
}

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  // the ops and their domain live as long as the process: ORT keeps pointers to them in every session
  static std::vector<std::unique_ptr<OrtCustomOp>> ops;
  static Ort::CustomOpDomain domain{nullptr};
  static std::once_flag once;
  try {
    std::call_once(once, [] {
      domain = Ort::CustomOpDomain("k3");
      ops.push_back(op<SituGlu>());
      ops.push_back(op<Kda>());
      ops.push_back(op<MoeRoute>());
      ops.push_back(op<MoeExperts>());
      ops.push_back(op<MoeExpertsMxfp4>());
      ops.push_back(op<MoeExpertsNvfp4>());
      ops.push_back(op<AttnResAggregate>());
      ops.push_back(op<MlaAttend>());
      ops.push_back(op<ShortConv>());
      ops.push_back(op<L2Norm>());
      ops.push_back(op<KdaLayer>());
      ops.push_back(op<MoeRouteExperts>());
      ops.push_back(op<MoeRouteExpertsMxfp4>());
      for (auto& o : ops) domain.Add(o.get());
    });
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
