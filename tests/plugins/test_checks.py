"""Checks before TensorRT sees anything: k3 nodes/attributes, precision, profiles, feed shapes, parser
errors; and the plugins / CLI without TensorRT."""

import onnx
import pytest
from onnx import TensorProto, helper

from k3export.converters.tensorrt import checks, prepare_build
from k3export.errors import ExportError
from k3export.plugins import rules

from conftest import contract_nodes, hand_model, k3_node  # noqa: E402  (tests/plugins is on sys.path)


def test_contract_nodes_match_plugin_attributes():
    nodes = checks.inspect_k3_nodes(hand_model(contract_nodes()))
    assert [n.op for n in nodes] == ["kda", "situ_glu", "moe_route"]
    for n in nodes:
        assert sorted(n.attributes) == sorted(name for name, _ in rules.PLUGINS[n.op].attributes)
        for name, typ in rules.PLUGINS[n.op].attributes:
            assert type(n.attributes[name]) is typ


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    export = pytest.importorskip("k3export.converters.onnx", reason="ONNX exporter not available")
    import torch

    from k3export import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("export") / "tiny"
    export.export_onnx(K3ForCausalLM(K3Config.tiny()).eval(), out, dtype="bf16")
    return out


def test_tiny_export_k3_nodes_match_registered_plugins(tiny_export):
    model = onnx.load(str(tiny_export / "model.onnx"), load_external_data=False)
    nodes = checks.inspect_k3_nodes(model)
    assert {n.op for n in nodes} == set(rules.PLUGINS)
    raw = {i: n for i, n in enumerate(model.graph.node)}
    for n in nodes:
        attrs = {a.name: a.type for a in raw[n.index].attribute}
        assert attrs.pop("plugin_namespace") == onnx.AttributeProto.STRING
        expected = {name: getattr(onnx.AttributeProto, rules.ONNX_ATTRIBUTE_TYPE[t])
                    for name, t in rules.PLUGINS[n.op].attributes}
        assert {k: v for k, v in attrs.items() if k not in rules.PARSER_CONTROL_ATTRS} == expected
    plan = prepare_build(tiny_export, "bf16", max_batch=2, max_seq=32, max_context=64)
    assert plan["dtype"] == "bfloat16"
    prefill, decode = plan["profiles"]
    assert prefill.shapes["input_ids"] == ((1, 1), (2, 16), (2, 32))
    assert decode.shapes["input_ids"] == ((1, 1), (2, 1), (2, 1))
    latent = [n for n in prefill.shapes if n.endswith(".latent")][0]
    assert prefill.shapes[latent][0][1] == 0 and prefill.shapes[latent][2][1] == 64
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


def test_export_without_plugins(tmp_path):
    n = helper.make_node("Identity", ["input_ids"], ["out"])
    onnx.save(hand_model([n], TensorProto.FLOAT), str(tmp_path / "model.onnx"))
    with pytest.raises(ExportError, match="has no k3 plugin nodes.*--allow-no-plugins"):
        prepare_build(tmp_path, "fp32")
    assert prepare_build(tmp_path, "fp32", allow_no_plugins=True)["k3_nodes"] == []


def test_precision_checks():
    assert checks.check_precision("bf16", "bfloat16", (9, 0)) == "bfloat16"
    with pytest.raises(ExportError, match="compute capability >= 8.0; Tesla T4 is sm_75"):
        checks.check_precision("bf16", "bfloat16", (7, 5), "Tesla T4")
    with pytest.raises(ExportError, match="expected one of bf16, fp16, fp32"):
        checks.check_precision("int8", None)
    with pytest.raises(ExportError, match="exported in float32.*--dtype bf16"):
        checks.check_precision("bf16", "float32")


def test_find_model_errors(tmp_path):
    with pytest.raises(ExportError, match="no such ONNX export folder"):
        checks.find_onnx_model(tmp_path / "missing")
    with pytest.raises(ExportError, match="no .onnx file"):
        checks.find_onnx_model(tmp_path)
    (tmp_path / "a.onnx").write_bytes(b"not onnx")
    with pytest.raises(ExportError, match="not a readable ONNX model"):
        checks.load_onnx(checks.find_onnx_model(tmp_path))


def test_profiles_and_feed_shape_errors():
    inputs = checks.graph_inputs(hand_model(contract_nodes()))
    roles = checks.dim_roles(inputs)
    assert roles["past_key_values.1.latent"] == ["batch", "past", "static"]
    prefill, decode = checks.make_profiles(inputs, max_batch=2, max_seq=16, max_context=32)
    ok = {"input_ids": (2, 16), "past_key_values.0.conv_state_q": (2, 64, 3),
          "past_key_values.0.recurrent_state": (2, 4, 16, 16), "past_key_values.1.latent": (2, 0, 40)}
    checks.check_feed_shapes(ok, prefill, roles)
    assert checks.select_profile([prefill, decode], 1) == 1 and checks.select_profile([prefill, decode], 5) == 0
    with pytest.raises(checks.ProfileError, match=r"'input_ids' axis 1 is 17, outside the prefill profile range \[1, 16\].*--max-seq"):
        checks.check_feed_shapes({**ok, "input_ids": (2, 17)}, prefill, roles)
    with pytest.raises(checks.ProfileError, match="axis 1 is 33.*--max-context"):
        checks.check_feed_shapes({**ok, "past_key_values.1.latent": (2, 33, 40)}, prefill, roles)
    with pytest.raises(checks.ProfileError, match="axis 0 is 3.*--max-batch"):
        checks.check_feed_shapes({**ok, "input_ids": (3, 4)}, prefill, roles)
    with pytest.raises(checks.ProfileError, match="built for exactly 40"):
        checks.check_feed_shapes({**ok, "past_key_values.1.latent": (2, 0, 41)}, prefill, roles)
    with pytest.raises(checks.ProfileError, match="missing engine inputs"):
        checks.check_feed_shapes({"input_ids": (1, 1)}, decode, roles)
    with pytest.raises(checks.ProfileError, match="max_seq=0"):
        checks.make_profiles(inputs, 1, 0, 8)


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
