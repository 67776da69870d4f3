"""``export --quantize int8|int4``: the stored blocks dequantized independently (float64 numpy) times an input equal
ONNX Runtime's MatMulNBits output on the export's own node, the codes stand for the checkpoint's weights, and
the options' user errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

ort = pytest.importorskip("onnxruntime")

from k3export.converters.onnx import export_onnx  # noqa: E402
from k3export.errors import ExportError  # noqa: E402


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request, tiny_k3, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantize") / request.param
    export_onnx(tiny_k3, out, dtype="fp32", quantize=request.param, block_size=32)
    return request.param, out, onnx.load(str(out / "model.onnx"))


def _dequantize64(blocks: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """MatMulNBits' documented layout, read here without k3export: codes low-first along K (4-bit: low nibble, then
    high), value = (code - 2**(bits-1)) * the block's scale."""
    n, kb, blob = blocks.shape
    if bits == 8:
        codes = blocks.astype(np.float64)
    else:
        codes = np.empty((n, kb, blob * 2))
        codes[..., 0::2] = blocks & 0x0F
        codes[..., 1::2] = blocks >> 4
    w = (codes - 2.0 ** (bits - 1)) * scales.reshape(n, kb, 1).astype(np.float64)
    return w.reshape(n, -1)[:, :k]


def test_runtime_config_records_the_quantization(quantized, tiny_k3):
    import json

    name, out, model = quantized
    rc = json.loads((out / "runtime_config.json").read_text())
    assert rc["quantize"] == name and rc["quantize_block_size"] == 32 and rc["quantize_accuracy_level"] == 4
    ops = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert len(ops) >= 20 and all(n.domain == "com.microsoft" for n in ops)
    # the routers only, each in a product of its own and in fp32 (a joined one would have been quantized with the rest)
    assert sorted(n.input[1] for n in gemms) == sorted(
        f"model.layers.{i}.block_sparse_moe.gate.weight" for i, t in enumerate(tiny_k3.config.mlp_types) if t == "moe")


def test_stored_blocks_times_input_equal_ort_matmulnbits(quantized, tiny_k3):
    """Every quantized projection's stored blocks, dequantized in float64 here, times a random input equal ORT
    running the export's own MatMulNBits node to fp32 rounding at accuracy_level 0 (fp32 inputs), and within the
    int8 rounding of its input at the export's level 4; and they stand for the model's weights (int8 within
    half a code step of the weight it stores; int4 within one: Q4_0's code 7 clips a weight near +8 steps, where the
    parts are single weights)."""
    name, _, model = quantized
    inits = {t.name: t for t in model.graph.initializer}
    params = dict(tiny_k3.named_parameters())
    rng = np.random.default_rng(0)
    checked = 0
    for node in (n for n in model.graph.node if n.op_type == "MatMulNBits"):
        attrs = {a.name: a.i for a in node.attribute}
        bits, k, n = attrs["bits"], attrs["K"], attrs["N"]
        assert bits == {"int8": 8, "int4": 4}[name] and attrs["block_size"] == 32
        blocks, scales = (numpy_helper.to_array(inits[i]) for i in node.input[1:3])
        w = _dequantize64(blocks, scales, bits, k)
        assert attrs["accuracy_level"] == 4
        x = rng.standard_normal((3, k)).astype(np.float32)
        want = x.astype(np.float64) @ w.T
        for level, tol in ((0, 1e-5), (4, 3e-2)):
            one = helper.make_model(
                helper.make_graph([helper.make_node("MatMulNBits", ["x", *node.input[1:3]], ["y"],
                                                    domain="com.microsoft", **{**attrs, "accuracy_level": level})],
                                  "one", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, k])],
                                  [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, n])],
                                  [inits[i] for i in node.input[1:3]]),
                opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
            sess = ort.InferenceSession(one.SerializeToString(), providers=["CPUExecutionProvider"])
            y = sess.run(None, {"x": x})[0]
            assert np.abs(y - want).max() <= tol * np.abs(want).max(), (node.input[1], level)
        source = node.input[1].rsplit(f".{name}", 1)[0]
        if source in params:  # not a joined projection: compare the codes with the weight they store
            orig = params[source].detach().double().numpy()
            step = np.repeat(np.abs(scales.astype(np.float64)), 32, axis=1)[:, :k]
            assert np.all(np.abs(w - orig) <= (0.5 if bits == 8 else 1.0) * step + 1e-7), source
            checked += 1
    assert checked >= 4


def test_quantize_user_errors(tiny_k3, tmp_path):
    with pytest.raises(ExportError, match="--quantize 'int3': choose one of int8, int4"):
        export_onnx(tiny_k3, tmp_path / "a", quantize="int3")
    with pytest.raises(ExportError, match="--block-size 24: MatMulNBits takes a power of two >= 16"):
        export_onnx(tiny_k3, tmp_path / "b", quantize="int8", block_size=24)
    with pytest.raises(ExportError, match="export with --dtype fp32, not bfloat16"):
        export_onnx(tiny_k3, tmp_path / "c", quantize="int4", dtype="bf16")
    with pytest.raises(ExportError, match=r"accuracy_level 2: MatMulNBits exports use one of \(0, 4\)"):
        export_onnx(tiny_k3, tmp_path / "d", quantize="int4", accuracy_level=2)
    assert not any(tmp_path.iterdir())


def test_bits_by_part_agree_with_the_export(quantized, tiny_k3):
    """`info` / `plan`'s per-part figures (from the config) name the same projections, by weight count, as the
    export stores quantized; the export's own bits per weight are the codes plus an fp32 scale a block (more where a
    K of 16 is padded to a block of 32); the card shows them."""
    from k3export.hub.card import build_model_card
    from k3export.hub.detect import detect_artifact
    from k3export.converters.onnx.quantize import quantized_param_names
    from k3export.info import PARTS, bits_by_part, export_bits_by_part

    name, out, _ = quantized
    bits = {"int8": 8, "int4": 4}[name]
    planned = {r.part: r for r in bits_by_part(tiny_k3.config, quantized_param_names(tiny_k3.config))}
    stored = {part: (n, b) for part, n, b in export_bits_by_part(out / "model.onnx")}
    n, b = stored[PARTS[0]]
    assert n == planned[PARTS[0]].params > 0
    assert planned[PARTS[0]].bits[f"fp32 --quantize {name}"] == bits + 1.0 <= 8 * b / n < bits + 2.0
    assert stored[PARTS[1]] == (planned[PARTS[1]].params, 4 * planned[PARTS[1]].params)  # fp32 experts
    card = build_model_card(detect_artifact(out), None, None, None)
    assert "## Weights" in card and f"| {PARTS[0]} | {n:,} |" in card


@pytest.mark.parametrize("level", [4, 0])
def test_library_form_rounds_the_experts_inputs_where_the_projections_do(released_random, tmp_path, level):
    """The k3 library's form of an export with MXFP4 experts and int8 projections (`expert_views.packed_view`): its
    experts take int8 activations exactly where the export's MatMulNBits do (accuracy_level 4), never at level 0."""
    from k3export.artifacts.expert_views import packed_view

    export_onnx(released_random, tmp_path / "e", experts="mxfp4", quantize="int8", accuracy_level=level)
    packed = packed_view(onnx.load(str(tmp_path / "e" / "model.onnx"), load_external_data=False))
    experts = [n for n in packed.graph.node if n.domain == "k3" and n.op_type.endswith("mxfp4")]
    assert experts
    for node in experts:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.get("quantize_activations", 0) == (level == 4), node.op_type
