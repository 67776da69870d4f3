"""`export --opset N` below the opset the graph is built against (23..26, for an older ONNX Runtime): accepted where
every op means the same there and takes the types the graph gives it, else refused in one line naming the op."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from k3export.converters.onnx.opsets import BUILT_AT, check_graph_opset
from k3export.errors import ExportError
from k3export_cli.main import app


def _one_node(node: onnx.NodeProto, opset: int, dtype: int = TensorProto.INT64) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(n, dtype, []) for n in node.input]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(node.output[0], dtype, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_an_op_that_only_gained_types_or_unset_attributes_is_accepted_older():
    # Range-27 added `stash_type` (optional); a node that leaves it unset means at 26 what it means at 27
    check_graph_opset(_one_node(helper.make_node("Range", ["a", "b", "c"], ["y"]), 26), 26)


def test_an_attribute_the_older_opset_lacks_is_refused_naming_the_op():
    node = helper.make_node("Range", ["a", "b", "c"], ["y"], name="r", stash_type=1)
    check_graph_opset(_one_node(node, BUILT_AT), BUILT_AT)
    with pytest.raises(ExportError, match=r"^opset 26 cannot express this graph: op Range \(node 'r'\) means "
                                          r"something else there .*export at opset 27 or newer$"):
        check_graph_opset(_one_node(node, 26), 26)


def test_an_op_the_older_opset_lacks_is_refused():
    node = helper.make_node("RMSNormalization", ["x", "s"], ["y"], name="n")
    with pytest.raises(ExportError, match="op RMSNormalization .* does not exist there .* opset 23 or newer"):
        check_graph_opset(_one_node(node, 22, TensorProto.FLOAT), 22)


def test_a_type_the_older_opset_does_not_take_is_refused_with_the_opset_that_does(tmp_path):
    """MXFP4 experts read float8e8m0 scales through Shape (Shape-24 takes it): refused at 23, on the CLI in one
    line, nothing written."""
    out = tmp_path / "o23"
    r = CliRunner().invoke(app, ["export", "--config", "tiny", "--no-weights", "--experts", "mxfp4", "--opset", "23",
                                 str(out)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: opset 23 cannot express this graph: op Shape takes no "
                                                   "tensor(float8e8m0)") and "opset 24 or newer" in lines[0], r.output
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_the_tiny_graph_with_dense_experts_exports_at_opset_23(tmp_path, dtype):
    """What runtime ort-webgpu runs (tests/validate/test_webgpu.py runs it there against PyTorch)."""
    out = tmp_path / "o23"
    r = CliRunner().invoke(app, ["export", "--config", "tiny", "--no-weights", "--opset", "23", "--dtype", dtype,
                                 str(out)])
    assert r.exit_code == 0, r.output
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[""] == 23
    assert all({o.domain: o.version for o in f.opset_import}[""] == 23 for f in model.functions)
