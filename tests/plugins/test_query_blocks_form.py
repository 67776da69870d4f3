"""MLA as TensorRT parses it: the export attends a long prompt in blocks of queries (an ``If`` over a ``Loop``);
`plugin_forms.one_call_attention` gives TensorRT the one-call branch, so its parser sees no control flow outside
the k3 plugins. ONNX Runtime runs both graphs here, and they must agree over a left-padded prompt longer than a
block (query rows that see no key) and decode steps."""

import numpy as np
import onnx
import onnxruntime as ort

from k3export.converters.onnx import export_onnx, graph
from k3export.converters.tensorrt import checks, plugin_model
from k3export.modeling import tiny_model
from k3export.runtime import OrtRunner


def test_the_one_call_form_equals_the_query_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(graph, "MLA_QUERY_BLOCK", 4)
    model = tiny_model(seed=0)
    folder = tmp_path / "x"
    export_onnx(model, folder, dtype="fp32")
    raw = checks.load_onnx(folder / "model.onnx")  # TensorRT's view: the fused ops' bodies, mla_attend's blocks
    form = plugin_model(raw)
    ops = [n.op_type for n in raw.graph.node]
    assert ops.count("If") == model.config.attn_types.count("mla") > 0
    assert not {"If", "Loop"} & {n.op_type for n in form.graph.node}
    onnx.save(form, folder / "one_call.onnx")  # same folder: the external data resolves alike

    sessions = [ort.InferenceSession(str(folder / f), providers=["CPUExecutionProvider"])
                for f in ("model.onnx", "one_call.onnx")]
    names = [o.name for o in sessions[0].get_outputs()]
    assert names == [o.name for o in sessions[1].get_outputs()]
    rng = np.random.default_rng(5)
    ids = rng.integers(3, model.config.vocab_size, (2, 11))
    mask = np.ones((2, 11), np.int64)
    mask[1, :3] = 0  # row 1 left-padded: its first three queries see no key
    states = [OrtRunner(folder).initial_state(2)] * 2
    for step in range(3):
        outs = [dict(zip(names, sess.run(None, {"input_ids": ids, "attention_mask": mask, **states[i]})))
                for i, sess in enumerate(sessions)]
        assert not np.isnan(outs[0]["logits"]).any()
        for name in names:
            np.testing.assert_allclose(outs[1][name], outs[0][name], rtol=0, atol=2e-5, err_msg=f"step {step}: {name}")
        states = [{k.replace("present", "past_key_values"): v for k, v in o.items() if k != "logits"} for o in outs]
        ids = rng.integers(3, model.config.vocab_size, (2, 1))
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
