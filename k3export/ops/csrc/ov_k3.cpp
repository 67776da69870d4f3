// OpenVINO binding of the k3 ops (fp32, CPU): OpenVINO operations whose names, inputs, outputs and attributes are
// the ONNX functions' (k3export/ops/spec.py), and ONNX frontend conversions that map the nodes of domain "k3" of an
// export's functions form (its fused ops included) onto them, so OpenVINO runs one kernel where its frontend
// has no function to expand. The kernels, and the shapes each takes, are kernels/<op>.h; this file only maps OpenVINO
// tensors onto them. Loaded with core.add_extension(path).
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/frontend/onnx/extension/conversion.hpp>
#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/attn_res_aggregate.h"
#include "kernels/kda.h"
#include "kernels/l2_norm.h"
#include "kernels/mla_attend.h"
#include "kernels/moe_experts.h"
#include "kernels/moe_experts_mxfp4.h"
#include "kernels/moe_route.h"
#include "kernels/moe_route_experts.h"
#include "kernels/short_conv.h"
#include "kernels/kda_layer.h"
#include "kernels/situ_glu.h"

namespace {

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

// A kernel's check (`<op>_takes`): "" passes, anything else is OpenVINO's error
void check(const std::string& why) { OPENVINO_ASSERT(why.empty(), "k3::", why); }

// ------------------------------------------------------------------------------------------------------ kda
class Kda : public ov::op::Op {
 public:
  OPENVINO_OP("kda", "k3");
  Kda() = default;
  Kda(const ov::OutputVector& args, float scale) : Op(args), scale_(scale) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 6, "k3::kda: 6 inputs expected");
    for (size_t i = 0; i < 6; ++i) want(this, i, Type_t::f32, "fp32");
    set_output_type(0, ov::element::f32, get_input_partial_shape(2));  // o: v's shape
    set_output_type(1, ov::element::f32, get_input_partial_shape(5));  // final state: initial_state's
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<Kda>(args, scale_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    v.on_attribute("scale", scale_);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto qs = dims(in[0]), vs = dims(in[2]);
    check(k3::kda_takes(qs, dims(in[1]), vs, dims(in[3]), dims(in[4]), dims(in[5])));
    const int64_t B = qs[0], T = qs[1], H = qs[2], K = qs[3], V = vs[3];
    out[0].set_shape(in[2].get_shape());
    out[1].set_shape(in[5].get_shape());
    k3::kda(in[0].data<const float>(), in[1].data<const float>(), in[2].data<const float>(),
            in[3].data<const float>(), in[4].data<const float>(), in[5].data<const float>(), out[0].data<float>(),
            out[1].data<float>(), B, T, H, K, V, scale_, kPool);
    return true;
  }

 private:
  float scale_ = 1.f;
};

// ------------------------------------------------------------------------------------------------- situ_glu
class SituGlu : public ov::op::Op {
 public:
  OPENVINO_OP("situ_glu", "k3");
  SituGlu() = default;
  SituGlu(const ov::OutputVector& args, float beta1, float beta2) : Op(args), beta1_(beta1), beta2_(beta2) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 2, "k3::situ_glu: 2 inputs expected");
    want(this, 0, Type_t::f32, "gate");
    want(this, 1, Type_t::f32, "up");
    set_output_type(0, ov::element::f32, get_input_partial_shape(0));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<SituGlu>(args, beta1_, beta2_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    v.on_attribute("beta1", beta1_);
    v.on_attribute("beta2", beta2_);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    check(k3::situ_glu_takes(dims(in[0]), dims(in[1])));
    out[0].set_shape(in[0].get_shape());
    k3::situ_glu(in[0].data<const float>(), in[1].data<const float>(), out[0].data<float>(),
                 static_cast<int64_t>(in[0].get_size()), beta1_, beta2_);
    return true;
  }

 private:
  float beta1_ = 1.f, beta2_ = 1.f;
};

// ------------------------------------------------------------------------------------------------ moe_route
// The router's attributes, held by moe_route and by the fused moe_route_experts
struct RouteAttrs {
  int64_t top_k = 1;
  bool renormalize = true;
  float scale = 1.f;
  void visit(ov::AttributeVisitor& v) {
    v.on_attribute("top_k", top_k);
    v.on_attribute("renormalize", renormalize);
    v.on_attribute("scale", scale);
  }
};

class MoeRoute : public ov::op::Op {
 public:
  OPENVINO_OP("moe_route", "k3");
  MoeRoute() = default;
  MoeRoute(const ov::OutputVector& args, RouteAttrs r) : Op(args), r_(r) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 2, "k3::moe_route: 2 inputs expected");
    want(this, 0, Type_t::f32, "logits");
    want(this, 1, Type_t::f32, "bias");
    const auto ls = get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(this, ls.rank().is_dynamic() || ls.size() == 2, "k3::moe_route: logits [N, E] expected");
    const ov::PartialShape os{ls.rank().is_static() ? ls[0] : ov::Dimension::dynamic(), r_.top_k};
    set_output_type(0, ov::element::f32, os);
    set_output_type(1, ov::element::i64, os);
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<MoeRoute>(args, r_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    r_.visit(v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto ls = in[0].get_shape();
    check(k3::moe_route_takes(dims(in[0]), dims(in[1]), r_.top_k));
    const ov::Shape os{ls[0], static_cast<size_t>(r_.top_k)};
    out[0].set_shape(os);
    out[1].set_shape(os);
    k3::moe_route(in[0].data<const float>(), in[1].data<const float>(), out[0].data<float>(),
                  out[1].data<int64_t>(), ls[0], ls[1], r_.top_k, r_.renormalize, r_.scale);
    return true;
  }

 private:
  RouteAttrs r_;
};

// ---------------------------------------------------------------------------------------------- moe_experts
// Dense (6 inputs: w1, w3 [E, I, D], w2 [E, D, I] fp32) or MXFP4 (9 inputs, k3export/ops/spec.py's
// MOE_EXPERTS_MXFP4: the export's FLOAT4E2M1 w1, w3 [E, I, D], w2 [E, D, I] and their FLOAT8E8M0 scales
// [E, I, D/32], [E, D, I/32], read as OpenVINO holds them: two E2M1 codes a byte, element 2j in the low nibble, the
// layout k3::moe_experts_mxfp4 takes). The MXFP4 form is the same op with the scales: the frontend reads the
// export's node as it is, and the weights stay at 4.25 bits (OpenVINO's constants of f4e2m1 / f8e8m0).

// The experts' inputs from 3 on (w1, w3, w2, and the MXFP4 scales after them), in moe_experts and in the fused
// moe_route_experts alike: their types, and MXFP4's D and I
void want_experts(const ov::Node* node, bool mxfp4) {
  for (size_t i = 3; i < 6; ++i) want(node, i, mxfp4 ? Type_t::f4e2m1 : Type_t::f32, mxfp4 ? "MXFP4" : "fp32");
  for (size_t i = 6; i < node->get_input_size(); ++i) want(node, i, Type_t::f8e8m0, "E8M0 scale");
  if (mxfp4 && known(node, 3) && known(node, 5)) {
    const auto s1 = node->get_input_shape(3), s2 = node->get_input_shape(5);
    NODE_VALIDATION_CHECK(node, s1.size() == 3 && s2.size() == 3 && s1[1] % 32 == 0 && s1[2] % 32 == 0, "k3::",
                          node->get_type_info().name,
                          ": MXFP4 w1 [E, I, D] with D and I multiples of 32 expected");
  }
}

// The experts' attributes, held by moe_experts and by the fused moe_route_experts
struct ExpertsAttrs {
  bool situ = true;
  float beta1 = 1.f, beta2 = 1.f;
  void visit(ov::AttributeVisitor& v) {
    v.on_attribute("situ", situ);
    v.on_attribute("beta1", beta1);
    v.on_attribute("beta2", beta2);
  }
};

// The experts on routed slots (weights, indices [N, top_k]: `ws`, `is` their shapes): z is in[2] of the fused node
// (in[0] of moe_experts), the weights in[3..5] and the MXFP4 scales in[6..8] of both
void run_experts(const char* op, const ExpertsAttrs& a, const ov::TensorVector& in, size_t z, const float* weights,
                 const int64_t* idx, const k3::Dims& ws, const k3::Dims& is, ov::Tensor& out) {
  const auto zs = dims(in[z]), s1 = dims(in[3]);
  std::vector<k3::Dims> scales;
  for (size_t i = 6; i < in.size(); ++i) scales.push_back(dims(in[i]));
  check(k3::moe_experts_takes(op, zs, ws, is, s1, dims(in[4]), dims(in[5]), idx, scales));
  const int64_t N = zs[0], top_k = ws[1], E = s1[0], I = s1[1], D = zs[1];
  out.set_shape(in[z].get_shape());
  const float* x = in[z].data<const float>();
  float* u = out.data<float>();
  if (scales.empty()) {
    k3::moe_experts(x, weights, idx, in[3].data<const float>(), in[4].data<const float>(), in[5].data<const float>(),
                    u, N, top_k, E, D, I, a.situ, a.beta1, a.beta2, kPool);
    return;
  }
  auto bytes = [&](size_t i) { return static_cast<const uint8_t*>(in[i].data()); };
  k3::moe_experts_mxfp4(x, weights, idx, bytes(3), bytes(4), bytes(5), bytes(6), bytes(7), bytes(8), u, N, top_k, E, D,
                        I, a.situ, a.beta1, a.beta2, kPool);
}

class MoeExperts : public ov::op::Op {
 public:
  OPENVINO_OP("moe_experts", "k3");
  MoeExperts() = default;
  MoeExperts(const ov::OutputVector& args, ExpertsAttrs a) : Op(args), a_(a) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 6 || get_input_size() == 9,
                          "k3::moe_experts: 6 inputs (dense) or 9 (MXFP4) expected");
    want(this, 0, Type_t::f32, "z");
    want(this, 1, Type_t::f32, "weights");
    want_index(this, 2, "indices");
    want_experts(this, get_input_size() == 9);
    set_output_type(0, ov::element::f32, get_input_partial_shape(0));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<MoeExperts>(args, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    a_.visit(v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    std::vector<int64_t> wide;
    run_experts("moe_experts", a_, in, 0, in[1].data<const float>(), as_i64(in[2], wide), dims(in[1]), dims(in[2]),
                out[0]);
    return true;
  }

 private:
  ExpertsAttrs a_;
};

// ------------------------------------------------------------------------------------------ the fused nodes
// The exporter writes them (`k3export.converters.onnx.fusions`) in place of the standard-op subgraphs it knows
// (ort_k3.cpp binds the same kernels), each with its standard-op body; OpenVinoSession reads the file as it is.

// attn_res_aggregate(weight [D], *sources [..., D]; epsilon) -> [..., D]
class AttnResAggregate : public ov::op::Op {
 public:
  OPENVINO_OP("attn_res_aggregate", "k3");
  AttnResAggregate() = default;
  AttnResAggregate(const ov::OutputVector& args, float eps) : Op(args), eps_(eps) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() >= 2, "k3::attn_res_aggregate: a weight and sources expected");
    for (size_t i = 0; i < get_input_size(); ++i) want(this, i, Type_t::f32, i ? "source" : "weight");
    set_output_type(0, ov::element::f32, get_input_partial_shape(1));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<AttnResAggregate>(args, eps_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    v.on_attribute("epsilon", eps_);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    std::vector<k3::Dims> shapes;
    std::vector<const float*> src;
    for (size_t s = 1; s < in.size(); ++s) {
      shapes.push_back(dims(in[s]));
      src.push_back(in[s].data<const float>());
    }
    check(k3::attn_res_aggregate_takes(dims(in[0]), shapes));
    const int64_t S = static_cast<int64_t>(src.size()), D = shapes[0].back();
    out[0].set_shape(in[1].get_shape());
    const int64_t rows = D == 0 ? 0 : static_cast<int64_t>(in[1].get_size()) / D;
    k3::attn_res_aggregate(src.data(), S, in[0].data<const float>(), out[0].data<float>(), rows, D, eps_, kPool);
    return true;
  }

 private:
  float eps_ = 1e-5f;
};

// mla_attend(q [B, H, T, R], lat_t [B, 1, R, S] and c [B, 1, S, Dc], or (halves) the cache's key and value
// [B, 1, S, W], visible [T, S] or [B|1, 1, T, S] bool, [any_key [B, 1, T, 1]]; scale, fill, halves, value_dim)
// -> [B, H, T, Dc]
class MlaAttend : public ov::op::Op {
 public:
  OPENVINO_OP("mla_attend", "k3");
  MlaAttend() = default;
  MlaAttend(const ov::OutputVector& args, float scale, float fill, int64_t halves, int64_t value_dim)
      : Op(args), scale_(scale), fill_(fill), halves_(halves), value_dim_(value_dim) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 4 || get_input_size() == 5, "k3::mla_attend: 4 or 5 inputs expected");
    want(this, 0, Type_t::f32, "q");
    want(this, 1, Type_t::f32, halves_ ? "key" : "lat_t");
    want(this, 2, Type_t::f32, halves_ ? "value" : "c");
    const auto vt = get_input_element_type(3);
    NODE_VALIDATION_CHECK(this, vt == ov::element::boolean || vt == ov::element::u8 || vt.is_dynamic(),
                          "k3::mla_attend: input 3 (visible) of type boolean expected, got ", vt);
    if (get_input_size() == 5) want(this, 4, Type_t::f32, "any_key");
    const auto qs = get_input_partial_shape(0), cs = get_input_partial_shape(2);
    ov::PartialShape os = ov::PartialShape::dynamic(4);
    if (qs.rank().is_static() && qs.size() == 4 && (halves_ || (cs.rank().is_static() && cs.size() == 4)))
      os = ov::PartialShape{qs[0], qs[1], qs[2], halves_ ? ov::Dimension(value_dim_) : cs[3]};
    set_output_type(0, ov::element::f32, os);
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<MlaAttend>(args, scale_, fill_, halves_, value_dim_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    v.on_attribute("scale", scale_);
    v.on_attribute("fill", fill_);
    v.on_attribute("halves", halves_);
    v.on_attribute("value_dim", value_dim_);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto qs = dims(in[0]), as = dims(in[1]), bs = dims(in[2]), vs = dims(in[3]);
    const k3::Dims ak_shape = in.size() == 5 ? dims(in[4]) : k3::Dims{};
    check(k3::mla_attend_takes(qs, as, bs, vs, in.size() == 5 ? &ak_shape : nullptr, halves_, value_dim_));
    const int64_t B = qs[0], H = qs[1], T = qs[2];
    const auto [cache, S, Dc] =
        k3::mla_inputs(halves_, value_dim_, in[1].data<const float>(), as, in[2].data<const float>(), bs);
    out[0].set_shape({static_cast<size_t>(B), static_cast<size_t>(H), static_cast<size_t>(T),
                      static_cast<size_t>(Dc)});
    // boolean and u8 are one byte of 0 / 1 each
    k3::mla_attend(in[0].data<const float>(), cache, static_cast<const bool*>(in[3].data()),
                   vs.size() == 4 && vs[0] == B && B > 1, in.size() == 5 ? in[4].data<const float>() : nullptr,
                   out[0].data<float>(), B, H, T, qs[3], S, Dc, scale_, fill_, kPool);
    return true;
  }

 private:
  float scale_ = 1.f, fill_ = 0.f;
  int64_t halves_ = 0, value_dim_ = 0;
};

// short_conv(state [B, C, K-1], x [B, T, C], taps [K, C], [start [B] int64]) -> (y [B, T, C], present)
class ShortConv : public ov::op::Op {
 public:
  OPENVINO_OP("short_conv", "k3");
  ShortConv() = default;
  explicit ShortConv(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 3 || get_input_size() == 4, "k3::short_conv: 3 or 4 inputs expected");
    want(this, 0, Type_t::f32, "state");
    want(this, 1, Type_t::f32, "x");
    want(this, 2, Type_t::f32, "taps");
    if (get_input_size() == 4) want_index(this, 3, "start");
    set_output_type(0, ov::element::f32, get_input_partial_shape(1));
    set_output_type(1, ov::element::f32, get_input_partial_shape(0));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<ShortConv>(args);
  }
  bool visit_attributes(ov::AttributeVisitor&) override { return true; }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto xs = dims(in[1]), ts = dims(in[2]);
    const OptionalIndex st(in, 3);
    check(k3::short_conv_takes(dims(in[0]), xs, ts, st.dims_or_null(), st.data));
    out[0].set_shape(in[1].get_shape());
    out[1].set_shape(in[0].get_shape());
    k3::short_conv(in[0].data<const float>(), in[1].data<const float>(), in[2].data<const float>(), st.data,
                   out[0].data<float>(), out[1].data<float>(), xs[0], xs[1], xs[2], ts[0], kPool);
    return true;
  }
};

// kda_layer(state [B, C, W-1], x [B, T, C = 2HK + HV], taps [W, C], g [B, T, H, K], beta [B, T, H],
// initial_state [B, H, K, V], [start [B] int64]; scale, epsilon) -> (o [B, T, H, V], present, final_state)
class KdaLayer : public ov::op::Op {
 public:
  OPENVINO_OP("kda_layer", "k3");
  KdaLayer() = default;
  KdaLayer(const ov::OutputVector& args, float scale, float eps) : Op(args), scale_(scale), eps_(eps) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 6 || get_input_size() == 7,
                          "k3::kda_layer: 6 or 7 inputs expected");
    const char* names[] = {"state", "x", "taps", "g", "beta", "initial_state"};
    for (size_t i = 0; i < 6; ++i) want(this, i, Type_t::f32, names[i]);
    if (get_input_size() == 7) want_index(this, 6, "start");
    const auto g = get_input_partial_shape(3), s0 = get_input_partial_shape(5);
    const bool ranked = g.rank().is_static() && g.rank().get_length() == 4 && s0.rank().is_static() &&
                        s0.rank().get_length() == 4;
    set_output_type(0, ov::element::f32,
                    ranked ? ov::PartialShape{g[0], g[1], g[2], s0[3]} : ov::PartialShape::dynamic());
    set_output_type(1, ov::element::f32, get_input_partial_shape(0));
    set_output_type(2, ov::element::f32, s0);
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<KdaLayer>(args, scale_, eps_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    v.on_attribute("scale", scale_);
    v.on_attribute("epsilon", eps_);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto ss = dims(in[0]), gs = dims(in[3]), s0s = dims(in[5]);
    const OptionalIndex st(in, 6);
    check(k3::kda_layer_takes(ss, dims(in[1]), dims(in[2]), st.dims_or_null(), st.data, gs, dims(in[4]), s0s));
    const int64_t B = gs[0], T = gs[1], H = gs[2], K = gs[3], V = s0s[3];
    out[0].set_shape(ov::Shape{size_t(B), size_t(T), size_t(H), size_t(V)});
    out[1].set_shape(in[0].get_shape());
    out[2].set_shape(in[5].get_shape());
    k3::kda_layer(in[0].data<const float>(), in[1].data<const float>(), in[2].data<const float>(), st.data,
                       in[3].data<const float>(), in[4].data<const float>(), in[5].data<const float>(),
                       out[0].data<float>(), out[1].data<float>(), out[2].data<float>(), B, T, ss[2] + 1, H, K, V,
                       scale_, eps_, kPool);
    return true;
  }

 private:
  float scale_ = 1.f, eps_ = 1e-6f;
};

// moe_route_experts(logits [N, E], bias [E], z [N, D], w1, w3, w2[, w1_scale, w3_scale, w2_scale]; top_k,
// renormalize, scale, situ, beta1, beta2) -> u [N, D]: moe_route, and moe_experts on its slots, dense or MXFP4
class MoeRouteExperts : public ov::op::Op {
 public:
  OPENVINO_OP("moe_route_experts", "k3");
  MoeRouteExperts() = default;
  MoeRouteExperts(const ov::OutputVector& args, RouteAttrs r, ExpertsAttrs a) : Op(args), r_(r), a_(a) {
    constructor_validate_and_infer_types();
  }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 6 || get_input_size() == 9,
                          "k3::moe_route_experts: 6 inputs (dense) or 9 (MXFP4) expected");
    want(this, 0, Type_t::f32, "logits");
    want(this, 1, Type_t::f32, "bias");
    want(this, 2, Type_t::f32, "z");
    want_experts(this, get_input_size() == 9);
    set_output_type(0, ov::element::f32, get_input_partial_shape(2));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<MoeRouteExperts>(args, r_, a_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    r_.visit(v);
    a_.visit(v);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto ls = dims(in[0]);
    check(k3::moe_route_experts_takes(ls, dims(in[1]), r_.top_k, dims(in[2]), dims(in[3])));
    const k3::Routed s(in[0].data<const float>(), in[1].data<const float>(), ls[0], ls[1], r_.top_k, r_.renormalize,
                       r_.scale);
    run_experts("moe_route_experts", a_, in, 2, s.weights.data(), s.indices.data(), s.shape, s.shape, out[0]);
    return true;
  }

 private:
  RouteAttrs r_;
  ExpertsAttrs a_;
};

// l2_norm(x [..., n]; epsilon) -> x's shape
class L2Norm : public ov::op::Op {
 public:
  OPENVINO_OP("l2_norm", "k3");
  L2Norm() = default;
  L2Norm(const ov::OutputVector& args, float eps) : Op(args), eps_(eps) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 1, "k3::l2_norm: 1 input expected");
    want(this, 0, Type_t::f32, "x");
    set_output_type(0, ov::element::f32, get_input_partial_shape(0));
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<L2Norm>(args, eps_);
  }
  bool visit_attributes(ov::AttributeVisitor& v) override {
    v.on_attribute("epsilon", eps_);
    return true;
  }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto xs = in[0].get_shape();
    check(k3::l2_norm_takes(dims(in[0])));
    out[0].set_shape(xs);
    const int64_t n = xs.back(), rows = n == 0 ? 0 : static_cast<int64_t>(in[0].get_size()) / n;
    k3::l2_norm(in[0].data<const float>(), out[0].data<float>(), rows, n, eps_, kPool);
    return true;
  }

 private:
  float eps_ = 1e-6f;
};

// ---------------------------------------------------------------------------- the ONNX frontend's k3 nodes
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

}  // namespace

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
    onnx_node("kda", [](const NodeContext& n) { return make<Kda>(n, n.get_attribute<float>("scale")); }),
    onnx_node("situ_glu",
              [](const NodeContext& n) {
                return make<SituGlu>(n, n.get_attribute<float>("beta1"), n.get_attribute<float>("beta2"));
              }),
    onnx_node("moe_route", [](const NodeContext& n) { return make<MoeRoute>(n, route_attrs(n)); }),
    onnx_node("moe_experts", [](const NodeContext& n) { return make<MoeExperts>(n, experts_attrs(n)); }),
    onnx_node("attn_res_aggregate",
              [](const NodeContext& n) { return make<AttnResAggregate>(n, n.get_attribute<float>("epsilon")); }),
    onnx_node("mla_attend",
              [](const NodeContext& n) {
                return make<MlaAttend>(n, n.get_attribute<float>("scale"), n.get_attribute<float>("fill"),
                                       n.get_attribute<int64_t>("halves"), n.get_attribute<int64_t>("value_dim"));
              }),
    onnx_node("short_conv", [](const NodeContext& n) { return make<ShortConv>(n); }),
    onnx_node("l2_norm", [](const NodeContext& n) { return make<L2Norm>(n, n.get_attribute<float>("epsilon")); }),
    onnx_node("kda_layer",
              [](const NodeContext& n) {
                return make<KdaLayer>(n, n.get_attribute<float>("scale"), n.get_attribute<float>("epsilon"));
              }),
    onnx_node("moe_route_experts",
              [](const NodeContext& n) { return make<MoeRouteExperts>(n, route_attrs(n), experts_attrs(n)); }),
}));
