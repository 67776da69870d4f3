# Copyright 2026 the k3export authors. Apache-2.0.
"""Graph forms: the same K3 decoder written for different ONNX consumers, and which consumer reads which.

The facts the exporter and the runtimes share, below both (a runtime opens an export and never imports the
exporter): the forms, the branch names the builder writes, which consumer reads which form, and the check that
refuses a consumer in one line. The exporter's edits of a graph of a form (`apply_form`) stay in
`k3export.converters.onnx.forms`.

``functions`` (the default): the k3 ops stay ``k3``-domain nodes with ``plugin_namespace="k3"`` and model-local
FunctionProto bodies, and the bodies choose fast paths at run time with ``If`` (one KDA token: the recurrence;
decode: per-slot experts; a long prompt: MLA in blocks of queries) and collect the routed experts' rows in a tensor
sequence. ONNX Runtime inlines the bodies and runs this form fastest; TensorRT binds each k3 node to its plugin.

``standard``: the standard ops of opset 27 that carry K3's pieces, ``ai.onnx`` domain only: each KDA layer's
recurrence is one ``LinearAttention-27`` (``update_rule='gated_delta'``, decay per key dimension) and its short
convs one ``CausalConvWithState-27``, whose state layouts are the contract's own ([B, H, K, V]; [B, C, kernel-1]),
so nothing is transposed at the boundary and the state manifest is that of every form. Each MLA layer attends in
one ``Attention`` (opset 24) in its absorbed form: every query head over the one shared latent row
(``kv_num_heads=1``, keys the whole latent, values its ``kv_lora_rank`` part), the cache still the contract's
latent halves, joined in the graph. The other k3 functions are inlined as in ``inlined``. Any opset-27 consumer reads it: ONNX Runtime (>= 1.32, through the ops' function
bodies) and the ONNX reference evaluator (onnx >= 1.23); OpenVINO 2026.4 reads neither op.

``ort``: ONNX Runtime's own ops where they carry K3's pieces, for a plain ``onnxruntime.InferenceSession`` with no
library of ours, on any provider with their kernels (CPU, CUDA, WebGPU): each KDA layer's core in a one-token call
(decode) is one ``com.microsoft::GatedDeltaNet`` (``gate_activation='kda'`` with ``gate_lower_bound``: K3's gate from
f_b_proj's output, ``A_log`` and ``dt_bias`` in fp32; q/k L2 norm and beta's sigmoid fused; q, k, v packed as the conv
gives them), in a longer one the k3 ``kda`` op's chunked body (an ``If`` on the length: ONNX Runtime 1.32's CPU
``GatedDeltaNet`` prefills 1.3-2x slower, docs/speed.md), its short convs one ``com.microsoft::CausalConvWithState`` and
its output norm and gate one ``GatedRMSNorm``, each Attention Residuals aggregate ``BranchwiseRMSNorm`` +
``HyperConnectionPreMix`` over the sources side by side, MLA one ``Attention`` as in ``standard``, the other k3 ops kept
with their bodies and ``If`` fast paths as in ``functions``, a decode call's routed experts in a path of few nodes (ONNX
Runtime inlines them; with the k3 library, `OrtRunner` runs them natively). GatedDeltaNet keeps its state V-major [B, H,
V, K], and so does the export: the state manifest says so (``"axes": [0, 1, 3, 2]`` on each recurrent state,
`GraphForm.recurrent_axes`), decode feeds the state to GatedDeltaNet as it is, and only a longer call's chunked body
transposes it in and out (a transpose each way cost a decode step ~10% on big_cfg). Saved states, ``cache`` and
``chat`` carry the state as the export keeps it; whatever compares it with PyTorch reads it through the manifest
(`StateEntry.to_contract`). A state-window export's KDA stays the k3 ``kda`` op (GatedDeltaNet gives no state per
position), in the contract's order. Written at opset 24 unless the export names
another: ONNX Runtime 1.32's CPU ``Attention`` kernel is registered for ``Attention-23`` and ``-24`` only, so at opset
>= 25 (``Attention-25``) it runs the op's function body, ~30 nodes a layer (what the standard form, at opset 27 for
``LinearAttention-27``, gets). The ONNX reference evaluator and OpenVINO read no ``com.microsoft`` op.

``inlined``: every k3 function inlined into standard ops (no custom domain), KDA as its chunked body, with no
``If`` (KDA always chunked, the routed experts always sorted, MLA in one call), no tensor sequence (the experts'
loop carries its rows in a tensor) and no ``Unique`` (the slots of each expert are counted against every expert
id). For consumers that do not expand model-local functions and lack the opset-27 ops (OpenVINO), or mis-run
``If`` (OpenVINO 2026.4's CPU plugin: values downstream of an ``If`` whose output is dynamically shaped come out
wrong, often NaN, and differ from run to run, unless that output is also a graph output). Slower than the default
in ONNX Runtime. TensorRT-RTX 1.7's parser reads this form (it has neither sequences nor ``Unique``), but its
builder stops on the whole graph with an internal error (``makeScopeNodesContiguous``), so TensorRT builds the
functions form, through the k3 plugins, with any op that needs it built from its standard-op body
(`k3export.converters.tensorrt.plugin_forms.standard_op_bodies`).

Every form has what every consumer needs: each ``Loop`` is given its ``cond`` (the reference evaluator runs no
iteration without one; TensorRT's parser fails on the empty input name), a ``Loop``'s scan output is reshaped to
its stacked shape (the reference evaluator concatenates them), axes are non-negative where the reference evaluator
mis-handles negative ones, and an MXFP4 expert cropped from its 4-bit stack gets a static shape (OpenVINO
dequantises no dynamically shaped blocks).

The form is recorded in ``runtime_config.json`` (``graph_form``); `check_reader` refuses a consumer that cannot read
an export's form with one line naming the form it needs. What each consumer reads is measured by the tests
(tests/converters/test_onnx_forms.py; TensorRT's builds: tests/engines; OpenVINO on MXFP4 experts:
tests/runtime/test_openvino_reference.py; every reader of NVFP4 experts: tests/converters/test_onnx_nvfp4_readers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .runtime_config import GRAPH_FORMS
from k3export.errors import K3ExportError


@dataclass(frozen=True)
class GraphForm:
    """How the graph of one form is written."""

    name: str
    #: k3 ops as ``k3``-domain nodes with model-local bodies (else inlined into standard ops)
    functions: bool
    #: ``If`` nodes pick fast paths at run time (else one path that serves every length)
    branches: bool
    #: the routed experts' loop collects its rows in a tensor sequence (else in a carried tensor)
    sequences: bool
    #: the routed experts are grouped with ``Unique`` (else by counting the slots of every expert id)
    unique: bool
    summary: str
    #: KDA as ``LinearAttention-27`` and ``CausalConvWithState-27`` (else the k3 ``kda`` op and the conv's taps)
    kda_ops: bool = False
    #: MLA's absorbed attention as one ``Attention`` (opset 23/24, ``kv_num_heads=1`` over the latent; else
    #: MatMul / Softmax / MatMul)
    mla_attention: bool = False
    #: KDA's core in a one-token call as ``com.microsoft::GatedDeltaNet`` (K3's gate, q/k L2 norm and beta's
    #: sigmoid fused; the export keeps its recurrent state V-major, `recurrent_axes`), else the k3 ``kda`` op
    gated_delta_net: bool = False
    #: KDA's short conv as ``com.microsoft::CausalConvWithState`` and its output norm and gate as
    #: ``com.microsoft::GatedRMSNorm``; the k3 function bodies take a call of at most `bodies.FEW_TOKENS` tokens
    #: through a path of few nodes (a plain ONNX Runtime session runs every node of an inlined body)
    ort_contrib: bool = False
    #: the opset the form is written at unless the export names one
    opset: int = 27

    def recurrent_axes(self, state_window: int = 0) -> tuple[int, ...] | None:
        """The order an export of this form keeps each KDA recurrent state in (`StateEntry.axes`): GatedDeltaNet's
        V-major [B, H, V, K] where it runs (a state-window export's KDA is the k3 ``kda`` op); None: the
        contract's [B, H, K, V]."""
        return V_MAJOR if self.gated_delta_net and not state_window else None


#: the contract's recurrent state [B, H, K, V] as GatedDeltaNet keeps it, [B, H, V, K]
V_MAJOR = (0, 1, 3, 2)


FUNCTIONS = GraphForm("functions", functions=True, branches=True, sequences=True, unique=True,
                      summary="k3 functions kept (ONNX Runtime, fastest; TensorRT with the k3 plugins)")
STANDARD = GraphForm("standard", functions=False, branches=False, sequences=False, unique=False, kda_ops=True,
                     mla_attention=True,
                     summary="opset-27 standard ops: KDA as LinearAttention and CausalConvWithState, MLA as "
                             "Attention, the other k3 functions inlined (ONNX Runtime with no k3 library, the ONNX "
                             "reference evaluator)")
INLINED = GraphForm("inlined", functions=False, branches=False, sequences=False, unique=False,
                    summary="k3 functions inlined into standard ops, no If, no sequences, no Unique (OpenVINO, "
                            "the ONNX reference evaluator)")
ORT = GraphForm("ort", functions=True, branches=True, sequences=True, unique=True, mla_attention=True,
                gated_delta_net=True, ort_contrib=True, opset=24,
                summary="ONNX Runtime's own ops: KDA as com.microsoft::GatedDeltaNet, MLA as Attention, the other "
                        "k3 functions kept with their bodies (a plain onnxruntime.InferenceSession, any provider "
                        "with a GatedDeltaNet kernel: CPU, CUDA, WebGPU)")
FORMS: dict[str, GraphForm] = {f.name: f for f in (FUNCTIONS, STANDARD, INLINED, ORT)}
DEFAULT_FORM = FUNCTIONS.name
assert tuple(FORMS) == GRAPH_FORMS  # runtime_config.json's vocabulary, default first

#: selected experts per iteration of the routed experts' loop in a k3 function body (gathered together, one batched
#: MatMul each), at most
EXPERT_BLOCK = 8
#: and only as many as fit this many bytes of fp32 weights (at K3's size one expert takes 132 MB: one per iteration)
EXPERT_BLOCK_BYTES = 64 << 20


def expert_block(inter: int, dim: int) -> int:
    """Selected experts per iteration of the routed experts' loop, for experts of intermediate size `inter` on
    inputs of `dim` (w1, w3 [inter, dim], w2 [dim, inter]: 3 inter dim weights): up to `EXPERT_BLOCK`, within
    `EXPERT_BLOCK_BYTES` once dequantised to fp32, at least one."""
    return max(1, min(EXPERT_BLOCK, EXPERT_BLOCK_BYTES // (4 * 3 * inter * dim)))


def check_sequence_loop(consumer: str, export: Any) -> None:
    """OpenVINO 2026.x's CPU plugin corrupts its heap when the experts' ``Loop`` carries a tensor sequence through
    more than one iteration (a call that selects more experts than one block: `expert_block`), so it may read a
    form that carries one (`GraphForm.sequences`, inlined by OpenVINO itself) only where no call can: at most one
    block of experts in the model. Refused in one line otherwise, naming the form that reads."""
    form = FORMS[export.runtime.graph_form]
    if not form.sequences:
        return
    cfg = export.runtime.config
    dim = cfg.get("routed_expert_hidden_size") or cfg["hidden_size"]
    block = expert_block(cfg["moe_intermediate_size"], dim)
    if cfg["num_experts"] > block:
        raise K3ExportError(
            f"{export.root}: {consumer} cannot run the {form.name} form of a model with {cfg['num_experts']} routed "
            f"experts (its experts' loop carries a tensor sequence over blocks of {block}, which OpenVINO's CPU "
            f"plugin corrupts memory on); export with --form {INLINED.name}, or let the k3 extension build")


#: a ``Slice`` end past any length: to the end (what `graph.K3GraphBuilder` writes, and `fusions` matches)
INT64_MAX = 2**63 - 1
#: name (before its counter) of the ``If`` branch that loops over MLA's query blocks (`graph.K3GraphBuilder`);
#: TensorRT's form of the graph takes the other branch (`converters.tensorrt.plugin_forms.one_branch`), and ONNX
#: Runtime with the k3 ops library replaces the ``If`` by one kernel (`fusions.fuse_mla_attend`)
MLA_QUERY_BLOCKS = "mla_query_blocks"
#: name (before its counter) of the ``If`` branch that runs a one-token call of a state-window export's KDA with one
#: kda op (its window is the input state W times); TensorRT's form takes the other, general branch
KDA_ONE_TOKEN = "kda_one_token"
#: the ``If`` branches TensorRT's form of the graph replaces by the other branch (`plugin_forms.one_branch`); every
#: ``If`` the builder writes has the computation valid at every length in its else branch (OpenVINO's form relies
#: on it: `runtime.ov_ext.general_branches`)
TRT_SKIPPED_BRANCHES = (MLA_QUERY_BLOCKS, KDA_ONE_TOKEN)

_F, _S, _I, _O = FUNCTIONS.name, STANDARD.name, INLINED.name, ORT.name
#: the routed experts' formats of an export (`expert_format`), in the order of `READERS`' entries
EXPERT_FORMATS = ("dense", "mxfp4", "nvfp4")
#: consumer -> (the forms it reads with dense routed experts, with MXFP4 experts, with NVFP4 experts), as the tests
#: measure them. MXFP4 and NVFP4: ONNX Runtime (and genai) rewrite the k3 ``moe_experts`` function into their 8-bit
#: form (`expert_views.q8_view`; the CPU ``DequantizeLinear`` takes neither E8M0 scales nor FLOAT4E2M1), TensorRT binds
#: it to the ``moe_experts_mxfp4`` / ``moe_experts_nvfp4`` plugin (its parser imports no E8M0 initializer), and the
#: reference evaluator's ``Pad`` rejects the negative pads that crop one expert out of a 4-bit stack. OpenVINO
#: 2026.4 reads no ``LinearAttention-27`` or ``CausalConvWithState-27`` (no conversion rule, and the ops' own
#: function bodies, a ``Scan``, fail to compile on its CPU plugin), so it reads the inlined form (NVFP4's two
#: ``DequantizeLinear``, E4M3 scales and E2M1 values, included: tests/converters/test_onnx_nvfp4_readers.py).
#: TensorRT builds the functions form through the k3 plugins (`k3export build` registers them; `--standard-ops`
#: builds an op from its standard-op body); the inlined form is parsed by TensorRT-RTX 1.7 but not built (an
#: internal builder error, ``makeScopeNodesContiguous``,
#: tests/engines/test_engine_builds.py::test_tensorrt_builds_the_forms_it_is_said_to_read).
#: OpenVINO with the k3 extension library (``openvino-k3ext``: `OpenVinoRunner` where the library builds) reads the
#: functions form too, its k3 nodes converted to the library's operations, MXFP4 experts on their 4-bit bytes
#: (tests/runtime/test_ov_ext.py; it converts no NVFP4 node); without it (``openvino-inlined``), a functions form
#: with dense experts, its function bodies inlined (`openvino_session.read_inlined`; not with MXFP4 experts, whose
#: crop there is dynamically shaped, nor NVFP4 ones: the CPU plugin's ScatterNDUpdate shape check fails, seen).
#: The ort form (``com.microsoft`` ``GatedDeltaNet`` and ``Attention``) is ONNX Runtime's alone, and genai's.
READERS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "ort": ((_F, _S, _I, _O), (_F,), (_F,)),
    "ort-cuda": ((_F, _S, _I), (_F,), (_F,)),
    "genai": ((_F, _S, _I, _O), (_F,), (_F,)),
    "trt": ((_F,), (_F,), (_F,)),
    "openvino": ((_I,), (_I,), (_I,)),
    "openvino-stateless": ((_I,), (_I,), (_I,)),
    "openvino-decode-graph": ((_I,), (_I,), (_I,)),
    "openvino-k3ext": ((_F, _I), (_F, _I), (_I,)),  # OpenVINO with the k3 extension library (`runtime.ov_ext`)
    "openvino-inlined": ((_F, _I), (_I,), (_I,)),  # OpenVINO without it: a functions form's bodies inlined
    "onnx-reference": ((_F, _S, _I), (), ()),
    # ONNX Runtime's WebGPU EP (`runtime.webgpu_runner`): what tests/validate/test_webgpu.py runs
    "ort-webgpu": ((_F,), (), ()),
}


def graph_form(name: str | GraphForm | None) -> GraphForm:
    """The `GraphForm` called `name` (None: the default); `K3ExportError` naming the choices otherwise."""
    if isinstance(name, GraphForm):
        return name
    if name is None:
        return FORMS[DEFAULT_FORM]
    if name not in FORMS:
        raise K3ExportError(f"unknown graph form {name!r}; choose one of {', '.join(FORMS)}")
    return FORMS[name]


def readable(consumer: str, experts: str = "dense") -> tuple[str, ...]:
    """The graph forms `consumer` reads for an export whose routed experts are `experts` (`EXPERT_FORMATS`); every
    form for a consumer this table does not know (torch, triton, pipelines: they check their own inputs)."""
    if consumer not in READERS:
        return tuple(FORMS)
    return READERS[consumer][EXPERT_FORMATS.index(experts)]


def check_reader(consumer: str, form: str, experts: str = "dense", where: object = "the export") -> None:
    """Refuse `consumer` on a graph of `form` it cannot read: one line naming the form it needs and how to get it."""
    reads = readable(consumer, experts)
    if form in reads:
        return
    quantized = experts != "dense"
    what = f"{where} (graph form {form!r}{f', {experts.upper()} experts' if quantized else ''})"
    if not reads:
        raise K3ExportError(f"{consumer} cannot read {what}: it reads {experts.upper()} experts in no graph form; "
                            "export with --experts dense")
    raise K3ExportError(f"{consumer} cannot read {what}: it needs graph form {reads[0]!r}; export again with "
                        f"--form {reads[0]}")


def inline_fused(model: Any) -> Any:
    """`model` (an ``onnx.ModelProto``) with every node of a fused k3 op (`k3export.ops.spec.FUSED_SPECS`, which the
    exporter writes for the k3 libraries) replaced by its function's body (``onnx.inliner``; the k3 ops a body calls
    that are no fused op stay nodes): for a consumer with no kernel of theirs that binds k3 nodes by name alone or
    reads no function ``overload`` (TensorRT's parser, the ONNX reference evaluator). `model` itself when it has
    none."""
    from k3export.ops.spec import FUSED_SPECS, NAMESPACE

    if not any(f.domain == NAMESPACE and f.name in FUSED_SPECS for f in model.functions):
        return model
    from onnx import inliner

    return inliner.inline_selected_functions(model, [(NAMESPACE, name) for name in FUSED_SPECS], exclude=False)


def has_mxfp4(model: Any) -> bool:
    """Whether `model` (weights not loaded) keeps 4-bit experts, MXFP4 or NVFP4 (FLOAT4E2M1 initializers;
    `converters.onnx.mxfp4` writes them). Here, below the exporter and the runtimes, because the consumer checks
    need it."""
    import onnx

    return any(t.data_type == onnx.TensorProto.FLOAT4E2M1 for t in model.graph.initializer)


def expert_format(model: Any) -> str:
    """The routed experts' format of `model` (weights not loaded), one of `EXPERT_FORMATS`: FLOAT4E2M1 values with
    FLOAT8E8M0 block scales are MXFP4, without them NVFP4 (FLOAT8E4M3FN scales, which FP8 projections share)."""
    import onnx

    types = {t.data_type for t in model.graph.initializer}
    if onnx.TensorProto.FLOAT4E2M1 not in types:
        return "dense"
    return "mxfp4" if onnx.TensorProto.FLOAT8E8M0 in types else "nvfp4"


#: the consumers that read block-FP8 weights kept FP8 (``export --projections fp8``: ``DequantizeLinear`` of a
#: FLOAT8E4M3FN initializer, ``block_size`` along the input axis, `converters.onnx.fp8`), as the tests measure them:
#: ONNX Runtime's CPU provider (and genai on it), OpenVINO 2026.4 (its blocked DequantizeLinear needs the block to
#: divide the axis, which the exporter makes so) and the reference evaluator, each bit for bit; TensorRT by its
#: flavour and target, checked at build (`converters.tensorrt.checks.check_fp8`). ONNX Runtime's CUDA and WebGPU
#: providers were not measured.
FP8_READERS = frozenset({"ort", "genai", "openvino", "openvino-stateless", "openvino-decode-graph", "openvino-k3ext",
                         "openvino-inlined", "onnx-reference", "trt"})


def fp8_projections(model: Any) -> list[str]:
    """The initializers of `model` (weights not loaded) its graph dequantises from FLOAT8E4M3FN: the block-FP8
    weights the exporter kept (the NVFP4 experts' E4M3 scales are read inside function bodies, not here)."""
    import onnx

    fp8 = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN}
    return [n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in fp8]


def check_fp8(consumer: str, model: Any, where: object = "the export") -> None:
    """Refuse `consumer` (one of `READERS`, not of `FP8_READERS`) on a graph that keeps FP8 projections."""
    if consumer not in READERS or consumer in FP8_READERS:
        return
    kept = fp8_projections(model)
    if kept:
        raise K3ExportError(f"{consumer} cannot read {where}: {len(kept)} projections are kept in block FP8 "
                            f"(DequantizeLinear on FLOAT8E4M3FN, e.g. {kept[0]!r}), which it is not known to read; "
                            "export with --projections dense")


def check_export(consumer: str, export: Any) -> None:
    """`check_reader` and `check_fp8` for a checked export folder (`k3export.artifacts.ExportFolder`): its form from
    ``runtime_config.json``; its graph (`ExportFolder.graph`, as `load_export` parsed it) only where the experts'
    format or FP8 projections decide."""
    form = export.runtime.graph_form
    experts = "dense"
    if len({form in readable(consumer, e) for e in EXPERT_FORMATS}) > 1:
        experts = expert_format(export.graph)
    check_reader(consumer, form, experts, where=export.root)
    if consumer == "openvino-inlined":
        check_sequence_loop(consumer, export)
    if consumer in READERS and consumer not in FP8_READERS:
        check_fp8(consumer, export.graph, export.root)


__all__ = ["DEFAULT_FORM", "EXPERT_BLOCK", "EXPERT_BLOCK_BYTES", "EXPERT_FORMATS", "FORMS", "FP8_READERS",
           "FUNCTIONS", "GraphForm", "INLINED", "INT64_MAX", "KDA_ONE_TOKEN", "MLA_QUERY_BLOCKS", "ORT", "READERS",
           "STANDARD", "TRT_SKIPPED_BRANCHES", "V_MAJOR", "check_export", "check_fp8", "check_reader",
           "check_sequence_loop", "expert_block", "expert_format", "fp8_projections", "graph_form", "has_mxfp4",
           "inline_fused", "readable"]
