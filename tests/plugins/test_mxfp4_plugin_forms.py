"""An MXFP4 export as TensorRT builds it (issue 14): `plugin_forms.plugin_model` turns each 9-input
``k3::moe_experts`` into ``k3::moe_experts_mxfp4`` over int8 views of the same external bytes (the spec's uint8 bytes
as TensorRT holds them: its parser widens UINT8 initializers to INT32); the checks take it and name what is broken;
the plugin's reference maths on those bytes equals ONNX Runtime on the export."""

import hashlib
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from k3export.converters.checkpoints.synthetic import released_tiny_config, write_checkpoint
from k3export.converters.onnx import export_onnx
from k3export.converters.tensorrt import build, checks, plugin_model, prepare_build
from k3export.plugins.flavour import Flavour
from k3export.dtypes import dtype
from k3export.errors import ExportError
from k3export.ops.naive import moe_experts_mxfp4_naive
from k3export.ops.spec import MOE_EXPERTS, MOE_EXPERTS_MXFP4, NAMESPACE

SPEC = MOE_EXPERTS_MXFP4


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    """The released-layout fixture (random valid MXFP4 experts) exported in fp32 with MXFP4 experts."""
    root = tmp_path_factory.mktemp("mxfp4_trt")
    src = write_checkpoint(root / "ckpt", released_tiny_config(), layout="kimi_k3", expert_mode="random")
    export_onnx(src, root / "onnx", dtype="fp32", experts="mxfp4")
    return root / "onnx"


@pytest.fixture(scope="module")
def models(export_dir):
    """(the file's graph, the graph TensorRT parses), weights not loaded."""
    raw = checks.load_onnx(export_dir / "model.onnx")
    return raw, plugin_model(raw)


def _expert_nodes(model, op: str) -> list[tuple[int, onnx.NodeProto]]:
    return [(i, n) for i, n in enumerate(model.graph.node) if n.domain == NAMESPACE and n.op_type == op]


def _beside_query_blocks(raw, rw) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """The nodes of each graph other than MLA's query-blocks ``If`` (raw) and its one-call branch (rewritten), which
    `test_query_blocks_form` checks."""
    ifs = [n for n in raw.graph.node if n.op_type == "If"]
    made = {o for n in ifs for a in n.attribute if a.name == "else_branch" for m in a.g.node for o in m.output}
    made |= {o for n in ifs for o in n.output}
    assert ifs and not [n for n in rw.graph.node if n.op_type == "If"]
    return ([n for n in raw.graph.node if n.op_type != "If"],
            [n for n in rw.graph.node if not set(n.output) & made])


def _inits(model) -> dict[str, TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def _external(t: TensorProto) -> list[tuple[str, str]]:
    return [(e.key, e.value) for e in t.external_data]


def _bytes(folder: Path, t: TensorProto) -> bytes:
    ext = dict(_external(t))
    with open(folder / ext["location"], "rb") as fh:
        fh.seek(int(ext.get("offset", 0)))
        return fh.read(int(ext["length"]))


def _uint8(folder: Path, t: TensorProto) -> torch.Tensor:
    """An int8-declared byte initializer as uint8 of its declared shape (read here, not by the code under test)."""
    assert t.data_type == TensorProto.INT8
    return torch.from_numpy(np.frombuffer(_bytes(folder, t), np.uint8).reshape(tuple(t.dims)).copy())


# ---------------------------------------------------------------------------------------------- the rewrite
def test_mxfp4_experts_become_the_plugin_over_the_same_bytes(export_dir, models):
    raw, rw = models
    before, after = _expert_nodes(raw, MOE_EXPERTS.name), _expert_nodes(rw, SPEC.name)
    assert before and [n.output for _, n in before] == [n.output for _, n in after]
    assert not _expert_nodes(rw, MOE_EXPERTS.name)
    assert (NAMESPACE, MOE_EXPERTS.name) not in {(f.domain, f.name) for f in rw.functions}  # no caller left
    rest_raw, rest_rw = _beside_query_blocks(raw, rw)
    assert len(rest_raw) == len(rest_rw)
    assert all(n.op_type == MOE_EXPERTS.name for _, n in _expert_nodes(raw, MOE_EXPERTS.name))  # input untouched
    cfg = released_tiny_config()
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_input_size
    declared = {"w1": (E, I, D // 2), "w3": (E, I, D // 2), "w2": (E, D, I // 2),
                "w1_scale": (E, I, D // 32), "w3_scale": (E, I, D // 32), "w2_scale": (E, D, I // 32)}
    old, new = _inits(raw), _inits(rw)
    for (_, a), (_, b) in zip(before, after):
        assert b.domain == NAMESPACE and list(b.input) == list(a.input) and list(b.output) == list(a.output)
        assert len(b.input) == len(SPEC.inputs)
        assert {x.name: helper.get_attribute_value(x) for x in b.attribute} == \
               {x.name: helper.get_attribute_value(x) for x in a.attribute}  # plugin_namespace and act, betas
        for arg, name in zip(SPEC.inputs[3:], b.input[3:]):
            t, t0 = new[name], old[name]
            assert dtype(arg.dtype).name == "uint8" and t.data_type == TensorProto.INT8  # the spec's bytes, as int8
            assert tuple(t.dims) == declared[arg.name]
            assert t0.data_type == (TensorProto.FLOAT8E8M0 if arg.name.endswith("_scale") else TensorProto.FLOAT4E2M1)
            assert t.data_location == t0.data_location == TensorProto.EXTERNAL
            assert _external(t) == _external(t0)
            assert hashlib.sha256(_bytes(export_dir, t)).digest() == hashlib.sha256(_bytes(export_dir, t0)).digest()
            assert int(np.prod(t.dims)) == int(dict(_external(t))["length"])  # one byte per declared int8
        shapes = [("N", D), ("N", cfg.num_experts_per_token), ("N", cfg.num_experts_per_token)] + \
                 [tuple(new[n].dims) for n in b.input[3:]]
        SPEC.check(shapes, ["float32", "float32", "int64"] + ["uint8"] * 6)
    untouched = [(a, b) for a, b in zip(rest_raw, rest_rw) if a.op_type != MOE_EXPERTS.name]
    assert all(a.SerializeToString() == b.SerializeToString() for a, b in untouched)


def test_a_graph_without_mxfp4_experts_is_parsed_as_it_is(tiny_export):
    """Nodes and initializers as they are, but for MLA's query blocks as their one-call branch; the optional
    logits_to_keep is no longer an input (a constant)."""
    model = checks.load_onnx(tiny_export / "model.onnx")
    parsed = plugin_model(model)
    rest, rest_parsed = _beside_query_blocks(model, parsed)
    assert [n.SerializeToString() for n in rest_parsed] == [n.SerializeToString() for n in rest]
    assert list(parsed.graph.initializer) == list(model.graph.initializer)
    assert [v.name for v in model.graph.input if v not in parsed.graph.input] == ["logits_to_keep"]
    assert plugin_model(parsed) is parsed  # nothing left to change


def test_prepare_build_checks_the_rewritten_graph(export_dir, models):
    plan = prepare_build(export_dir, "fp32", max_batch=1, max_seq=16, max_context=32)
    ops = [n.op for n in plan["k3_nodes"]]
    assert ops.count(SPEC.name) == len(_expert_nodes(models[0], MOE_EXPERTS.name)) and MOE_EXPERTS.name not in ops
    assert plan["model"].SerializeToString() == models[1].SerializeToString()


def test_build_engine_hands_the_parser_the_rewritten_graph_and_its_path(export_dir, models, monkeypatch, tmp_path):
    """Up to the parser with a stand-in TensorRT (no engine is built): it gets the checked graph's bytes and the
    model path its external data is relative to; its error comes back naming the plugin node."""
    seen = {}
    node = _expert_nodes(models[1], SPEC.name)[0][0]

    class Err:
        def desc(self):
            return "stand-in parser: nothing was parsed"

        def node(self):
            return node

    class Parser:
        num_errors = 1

        def __init__(self, network, logger):
            pass

        def parse(self, model, path=None):
            seen["model"], seen["path"] = model, path
            return False

        def get_error(self, i):
            return Err()

    class Logger:
        WARNING = VERBOSE = ERROR = 0

        def __init__(self, level):
            pass

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            return object()

    flags = type("F", (), {"STRONGLY_TYPED": 0, "PREFER_AOT_PYTHON_PLUGINS": 1})
    trt = type("trt", (), {"__version__": "stand-in", "Logger": Logger, "Builder": Builder, "OnnxParser": Parser,
                           "NetworkDefinitionCreationFlag": flags})
    monkeypatch.setattr(build, "load_flavour", lambda: Flavour("tensorrt", "stand-in", trt))
    monkeypatch.setattr(build, "register_plugins", lambda **_: [SPEC.plugin_id])
    monkeypatch.setattr(build, "visible_gpu", lambda: ((9, 0), "stand-in"))
    with pytest.raises(ExportError, match=rf"node {node} .*\(k3::{SPEC.name}\): stand-in parser"):
        build.build_engine(export_dir, tmp_path / "x.engine", "fp32", progress=None)
    assert seen["path"] == str(export_dir / "model.onnx")
    assert seen["model"] == models[1].SerializeToString()


# ---------------------------------------------------------------------------------------------- the checks
def _broken(model, edit) -> onnx.ModelProto:
    """A copy of the rewritten graph with `edit(node, initializers)` applied to its first plugin node."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    edit(_expert_nodes(out, SPEC.name)[0][1], _inits(out))
    return out


def test_checks_name_the_broken_input_in_one_line(models):
    raw, rw = models
    assert sum(n.op == SPEC.name for n in checks.inspect_k3_nodes(rw)) == len(_expert_nodes(rw, SPEC.name))

    def fail(model, match):
        with pytest.raises(ExportError, match=match) as info:
            checks.inspect_k3_nodes(model)
        assert "\n" not in str(info.value)

    fail(raw, r"\(k3::moe_experts\): has 9 inputs / 1 outputs; the plugin takes 6 .*ONNX form of "
              r"k3::moe_experts_mxfp4")

    def float_scale(n, inits):
        inits[n.input[6]].data_type = TensorProto.FLOAT
    fail(_broken(rw, float_scale), r"k3::moe_experts_mxfp4 input 'w1_scale': dtype float32, expected uint8")

    def unpacked_w2(n, inits):
        inits[n.input[5]].dims[-1] *= 2
    fail(_broken(rw, unpacked_w2), r"k3::moe_experts_mxfp4: w2 \[E, D, I/2\].*I/2 = 32")

    def fp4_left(n, inits):  # renamed but not retyped
        inits[n.input[3]].data_type = TensorProto.FLOAT4E2M1
    fail(_broken(rw, fp4_left), r"input 'w1': dtype float4e2m1, expected uint8 \(packed E2M1\)")

    def fp8_weight(n, inits):  # a type k3export has no dtype of (E4M3 it has: NVFP4's scales)
        inits[n.input[4]].data_type = TensorProto.FLOAT8E5M2
    w3 = re.escape(_expert_nodes(rw, SPEC.name)[0][1].input[4])
    fail(_broken(rw, fp8_weight), rf"input 'w3' \({w3}\) has ONNX type FLOAT8E5M2, which k3::moe_experts_mxfp4")

    def eight_inputs(n, inits):
        del n.input[8]
    fail(_broken(rw, eight_inputs), r"has 8 inputs / 1 outputs; the plugin takes 9 \('z', 'weights'")


def test_an_initializer_shared_with_another_node_is_not_retyped(models):
    raw = onnx.ModelProto()
    raw.CopyFrom(models[0])
    w1 = _expert_nodes(raw, MOE_EXPERTS.name)[0][1].input[3]
    raw.graph.node.append(helper.make_node("Identity", [w1], ["w1_copy"]))
    with pytest.raises(ExportError, match=r"initializer '.*w1.weight_packed' also feeds another node"):
        plugin_model(raw)


def test_dense_experts_are_still_checked_as_moe_experts(tiny_export):
    model = checks.load_onnx(tiny_export / "model.onnx")
    n = _expert_nodes(model, MOE_EXPERTS.name)[0][1]
    {t.name: t for t in model.graph.initializer}[n.input[5]].data_type = TensorProto.FLOAT16  # w2, others bf16
    with pytest.raises(ExportError, match=r"k3::moe_experts input 'w2': dtype float16, expected bfloat16 "
                                          r"\(same as z\)"):
        checks.inspect_k3_nodes(model)


# ---------------------------------------------------------------------------------------------- the numbers
def test_plugin_maths_on_the_uint8_inputs_equals_onnx_runtime_on_the_export(export_dir, models):
    """The plugin's reference maths (`moe_experts_mxfp4_naive`) on the uint8 initializers as declared after the
    rewrite, against ONNX Runtime running the export's own MXFP4 ``k3::moe_experts`` on its FP4 / E8M0 initializers
    (`runtime.ort_session`: GatherBlockQuantized on the lossless 8-bit form), for the same z, weights, indices."""
    ort = pytest.importorskip("onnxruntime")
    from k3export.runtime.ort_session import ort_session

    raw, rw = models
    cfg = released_tiny_config()
    N, D, E, k = 7, cfg.expert_input_size, cfg.num_experts, cfg.num_experts_per_token
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(N, D, generator=gen)
    indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=gen) + 0.1
    for (_, a), (_, b) in zip(_expert_nodes(raw, MOE_EXPERTS.name), _expert_nodes(rw, SPEC.name)):
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = 1, 3
        inits = _inits(raw)
        graph = helper.make_graph(
            [a], "one_moe_experts",
            [helper.make_tensor_value_info(n, t, s) for n, t, s in
             ((a.input[0], TensorProto.FLOAT, [N, D]), (a.input[1], TensorProto.FLOAT, [N, k]),
              (a.input[2], TensorProto.INT64, [N, k]))],
            [helper.make_tensor_value_info(a.output[0], TensorProto.FLOAT, None)],
            initializer=[inits[n] for n in a.input[3:]])
        sub = helper.make_model(graph, opset_imports=list(raw.opset_import), functions=list(raw.functions),
                                ir_version=raw.ir_version)
        sess = ort_session(export_dir / "model.onnx", so, model=sub)
        (u_ort,) = sess.run(None, {a.input[0]: z.numpy(), a.input[1]: weights.numpy(), a.input[2]: indices.numpy()})
        attrs = {x.name: helper.get_attribute_value(x) for x in b.attribute}
        ws = [_uint8(export_dir, _inits(rw)[n]) for n in b.input[3:]]
        u = moe_experts_mxfp4_naive(z, weights, indices, *ws, attrs["act"].decode(), attrs["beta1"], attrs["beta2"])
        u_ort = torch.from_numpy(u_ort)
        assert u.shape == u_ort.shape == (N, D) and float(u.abs().max()) > 0
        assert float((u - u_ort).abs().max()) <= 1e-5 * max(1.0, float(u.abs().max()))
