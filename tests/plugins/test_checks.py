"""Checks before TensorRT sees anything: k3 nodes/attributes, precision, profiles, feed shapes, parser
errors; and the plugins / CLI without TensorRT."""

import onnx
import pytest
from onnx import TensorProto, helper

from k3export.converters.tensorrt import checks, prepare_build
from k3export.errors import ExportError
from k3export.ops.spec import ONNX_ATTRIBUTE_TYPE, SPECS
from k3export.plugins import rules

from conftest import contract_nodes, hand_model, k3_node  # noqa: E402  (tests/plugins is on sys.path)


def test_contract_nodes_match_plugin_attributes():
    nodes = checks.inspect_k3_nodes(hand_model(contract_nodes()))
    assert [n.op for n in nodes] == ["kda", "situ_glu", "moe_route"]
    for n in nodes:
        assert sorted(n.attributes) == sorted(SPECS[n.op].attribute_names)
        for name, typ in SPECS[n.op].attributes:
            assert type(n.attributes[name]) is typ


def test_tiny_export_k3_nodes_match_registered_plugins(tiny_export):
    model = checks.load_onnx(tiny_export / "model.onnx")  # the fused ops' bodies: the k3 ops they call are plugins
    nodes = checks.inspect_k3_nodes(model)
    assert {n.op for n in nodes} == set(SPECS)
    raw = {i: n for i, n in enumerate(model.graph.node)}
    for n in nodes:
        attrs = {a.name: a.type for a in raw[n.index].attribute}
        assert attrs.pop("plugin_namespace") == onnx.AttributeProto.STRING
        expected = {name: getattr(onnx.AttributeProto, ONNX_ATTRIBUTE_TYPE[t]) for name, t in SPECS[n.op].attributes}
        assert {k: v for k, v in attrs.items() if k not in rules.PARSER_CONTROL_ATTRS} == expected
    plan = prepare_build(tiny_export, "bf16", max_batch=2, max_seq=32, max_context=64)
    assert plan["dtype"] == "bfloat16"
    prefill, decode = plan["profiles"]
    assert prefill.shapes["input_ids"] == ((1, 1), (2, 16), (2, 32))
    assert decode.shapes["input_ids"] == ((1, 1), (2, 1), (2, 1))
    key = [n for n in prefill.shapes if n.endswith(".key")][0]  # MLA latent half [batch, 1, past, W]
    assert prefill.shapes[key][0][2] == 0 and prefill.shapes[key][2][2] == 64
    with pytest.raises(ExportError, match="exported in bfloat16"):
        prepare_build(tiny_export, "fp32")


def test_unknown_k3_op_is_named():
    m = hand_model([k3_node("rope", ["a"], ["b"], name="layers.3/rope")])
    with pytest.raises(ExportError, match=r"node 0 'layers.3/rope' \(k3::rope\): unknown k3 op"):
        checks.inspect_k3_nodes(m)


def test_k3_node_without_plugin_namespace():
    n = helper.make_node("situ_glu", ["g", "u"], ["o"], name="mlp", domain="k3", beta1=4.0, beta2=25.0)
    with pytest.raises(ExportError, match="plugin_namespace is None"):
        checks.inspect_k3_nodes(hand_model([n]))


def test_attribute_type_and_name_mismatch():
    bad_type = k3_node("kda", ["q", "k", "v", "g", "b", "s"], ["o", "s1"], scale=1)  # INT, plugin wants FLOAT
    with pytest.raises(ExportError, match="'scale' is int 1; the plugin expects FLOAT"):
        checks.inspect_k3_nodes(hand_model([bad_type]))
    bad_name = k3_node("moe_route", ["l", "b"], ["w", "i"], top_k=2, renorm=1, scale=1.0)
    with pytest.raises(ExportError, match=r"missing \['renormalize'\]; unknown \['renorm'\]"):
        checks.inspect_k3_nodes(hand_model([bad_name]))
    bad_arity = k3_node("situ_glu", ["g"], ["o"], beta1=4.0, beta2=25.0)
    with pytest.raises(ExportError, match="1 inputs / 1 outputs; the plugin takes 2"):
        checks.inspect_k3_nodes(hand_model([bad_arity]))


def test_export_without_plugins():
    nodes = checks.inspect_k3_nodes(hand_model([helper.make_node("Identity", ["input_ids"], ["out"])], TensorProto.FLOAT))
    assert nodes == []
    with pytest.raises(ExportError, match="has no k3 plugin nodes.*--allow-no-plugins"):
        checks.require_plugins(nodes)


def test_precision_checks():
    assert checks.check_precision("bf16", "bfloat16", (9, 0)) == "bfloat16"
    with pytest.raises(ExportError, match="compute capability >= 8.0; Tesla T4 is sm_75"):
        checks.check_precision("bf16", "bfloat16", (7, 5), "Tesla T4")
    with pytest.raises(ExportError, match="expected one of bf16, fp16, fp32"):
        checks.check_precision("int8", None)
    with pytest.raises(ExportError, match="exported in float32.*--dtype bf16"):
        checks.check_precision("bf16", "float32")


def test_unreadable_model(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"not onnx")
    with pytest.raises(ExportError, match="not a readable ONNX model"):
        checks.load_onnx(tmp_path / "model.onnx")


def test_feed_shapes_against_a_profile():
    key = "past_key_values.1.key"
    roles = {"input_ids": ["batch", "seq"], key: ["batch", "static", "past", "static"]}
    prefill = checks.ProfileSpec("prefill", {"input_ids": ((1, 1), (2, 8), (2, 16)),
                                             key: ((1, 1, 0, 20), (2, 1, 0, 20), (2, 1, 32, 20))})
    decode = checks.ProfileSpec("decode", {"input_ids": ((1, 1), (2, 1), (2, 1)),
                                           key: ((1, 1, 0, 20), (2, 1, 16, 20), (2, 1, 32, 20))})
    ok = {"input_ids": (2, 16), key: (2, 1, 0, 20)}
    checks.check_feed_shapes(ok, prefill, roles)
    assert checks.select_profile([prefill, decode], 1) == 1 and checks.select_profile([prefill, decode], 5) == 0
    with pytest.raises(checks.ProfileError, match=r"'input_ids' axis 1 is 17, outside the prefill profile range \[1, 16\].*--max-seq"):
        checks.check_feed_shapes({**ok, "input_ids": (2, 17)}, prefill, roles)
    with pytest.raises(checks.ProfileError, match="axis 2 is 33.*--max-context"):
        checks.check_feed_shapes({**ok, key: (2, 1, 33, 20)}, prefill, roles)
    with pytest.raises(checks.ProfileError, match="axis 0 is 3.*--max-batch"):
        checks.check_feed_shapes({**ok, "input_ids": (3, 4)}, prefill, roles)
    with pytest.raises(checks.ProfileError, match="built for exactly 20"):
        checks.check_feed_shapes({**ok, key: (2, 1, 0, 21)}, prefill, roles)
    with pytest.raises(checks.ProfileError, match="missing engine inputs"):
        checks.check_feed_shapes({"input_ids": (1, 1)}, decode, roles)


def test_parser_errors_name_node_index_name_and_op():
    model = hand_model(contract_nodes())

    class FakeErr:  # the shape of tensorrt.ParserError
        def desc(self):
            return "Plugin not found, are the plugin name, version, and namespace correct?"

        def code(self):
            return "ErrorCode.UNSUPPORTED_NODE"

        def node(self):
            return 0

    msg = checks.format_parser_errors([checks.parser_error_info(FakeErr())], model, "x/model.onnx")
    assert "rejected x/model.onnx (1 error)" in msg
    assert "node 0 'n_kda' (k3::kda): Plugin not found" in msg
    assert "register_plugins()" in msg
