"""ONNX export (issue 4): ORT CPU against the PyTorch K3 model, graph structure, manifest, bad input, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

ort = pytest.importorskip("onnxruntime")

from k3export.artifacts import ArtifactError, TensorSpec  # noqa: E402
from k3export.converters.onnx import DOMAIN, OPS, export_onnx, graph, load_export  # noqa: E402
from k3export.converters.onnx.lowp import emulate_low_precision  # noqa: E402
from k3export.errors import ExportError, K3ExportError  # noqa: E402
from k3export.ops.spec import FUSED_SPECS  # noqa: E402
from k3export.modeling import K3Cache, K3Config, tiny_model  # noqa: E402
from k3export.modeling.contract import LOGITS_TO_KEEP  # noqa: E402
from k3export.runtime import OrtRunner  # noqa: E402

PREFILL, DECODE = 16, 8


class OrtDecoder:
    """The export under ONNX Runtime through the shared runtime: `load_export` checks the folder, `OrtRunner` feeds
    every input the manifest declares. `step` takes the full attention mask (default: ones over past + new)."""

    def __init__(self, folder: Path, model_path: Path | None = None) -> None:
        self.runner = OrtRunner(folder, model_path=model_path, threads=2)
        self.export = self.runner.export

    def initial(self, batch: int) -> dict[str, np.ndarray]:
        return self.runner.initial_state(batch)

    def step(self, ids: np.ndarray, state: dict[str, np.ndarray],
             mask: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if mask is None:
            mask = np.ones((ids.shape[0], self.export.manifest.past_length(state) + ids.shape[1]), np.int64)
        out = self.runner.forward(ids, state, mask)
        return out.logits, out.state


def _torch_state(cache: K3Cache) -> dict[str, np.ndarray]:
    """The PyTorch cache, keyed by the contract's state names."""
    return {name: t.detach().float().numpy() for name, t in cache.to_states().items()}


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("onnx") / "fp32"
    export_onnx(model, out, dtype="fp32")
    return out


@pytest.fixture(scope="module")
def decoder(exported) -> OrtDecoder:
    return OrtDecoder(exported)


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max()) if a.size else 0.0


@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_then_decode_matches_torch(model, decoder, batch):
    gen = torch.Generator().manual_seed(100 + batch)
    ids = torch.randint(3, model.config.vocab_size, (batch, PREFILL), generator=gen)
    cache = K3Cache(model.config)
    state = decoder.initial(batch)
    tok_t = tok_o = ids
    worst_logit, worst_state = 0.0, 0.0
    for step in range(1 + DECODE):
        with torch.no_grad():
            ref = model(tok_t, cache=cache).logits.numpy()
        logits, state = decoder.step(tok_o.numpy(), state)
        assert logits.shape == ref.shape
        worst_logit = max(worst_logit, _max_err(logits, ref))
        ref_state = _torch_state(cache)
        for name, value in state.items():
            assert value.shape == ref_state[name].shape, name
            err = _max_err(value, ref_state[name])
            assert err < 1e-4, f"step {step}: {name} differs by {err}"
            worst_state = max(worst_state, err)
        assert np.abs(logits - ref).max() < 1e-4, f"step {step}: logits differ by {_max_err(logits, ref)}"
        next_t = torch.from_numpy(ref[:, -1].argmax(-1))[:, None]
        next_o = torch.from_numpy(logits[:, -1].argmax(-1))[:, None]
        assert torch.equal(next_t, next_o), f"greedy tokens differ at step {step}"
        tok_t, tok_o = next_t, next_o
    assert decoder.export.manifest.past_length(state) == PREFILL + DECODE


def test_chunked_prefill_equals_one_shot(model, decoder):
    ids = torch.randint(3, model.config.vocab_size, (2, PREFILL), generator=torch.Generator().manual_seed(7))
    one_logits, one_state = decoder.step(ids.numpy(), decoder.initial(2))
    state, pieces = decoder.initial(2), []
    for a, b in ((0, 5), (5, 6), (6, 13), (13, 16)):
        logits, state = decoder.step(ids[:, a:b].numpy(), state)
        pieces.append(logits)
    assert _max_err(np.concatenate(pieces, axis=1), one_logits) < 1e-4
    for name in one_state:  # fp32 rounding grows with depth (5e-7 in layer 0, 1.2e-5 in layer 5 at |state| ~3)
        assert _max_err(state[name], one_state[name]) < 1e-5 * max(1.0, np.abs(one_state[name]).max()), name


def test_logits_to_keep_gives_the_last_positions(model, exported):
    """The optional ``logits_to_keep`` input (default 0: every position) against PyTorch's full logits; the carried
    state does not depend on it, and onnxruntime does not list it among the inputs a caller must feed."""
    sess = ort.InferenceSession(str(exported / "model.onnx"), providers=["CPUExecutionProvider"])
    assert LOGITS_TO_KEEP in {i.name for i in sess.get_overridable_initializers()}
    assert LOGITS_TO_KEEP not in {i.name for i in sess.get_inputs()}
    ids = torch.randint(3, model.config.vocab_size, (2, PREFILL), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    state = OrtRunner(exported).initial_state(2)
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((2, PREFILL), np.int64), **state}
    names = [o.name for o in sess.get_outputs()]
    full = dict(zip(names, sess.run(None, feeds)))
    assert full["logits"].shape == ref.shape and _max_err(full["logits"], ref) < 1e-4
    for keep, want in ((1, 1), (5, 5), (PREFILL, PREFILL), (PREFILL + 3, PREFILL)):
        out = dict(zip(names, sess.run(None, {**feeds, LOGITS_TO_KEEP: np.array(keep, np.int64)})))
        assert out["logits"].shape == (2, want, model.config.vocab_size)
        assert _max_err(out["logits"], ref[:, -want:]) < 1e-4
        for name in names[1:]:
            np.testing.assert_array_equal(out[name], full[name], err_msg=name)


def test_left_padded_batch_matches_torch_and_unpadded_rows(model, decoder):
    """Prompts of 9 and 5 tokens, the short one left-padded with 4 pad tokens (mask 0), prefilled then decoded 4
    steps (the mask grows by a column of ones per step): every logit equals PyTorch's on the padded batch, and each
    row's real-token logits and KDA state equal the unpadded single-prompt ORT run of that row."""
    gen = torch.Generator().manual_seed(23)
    lens, width, steps = (9, 5), 9, 4
    pad_id = decoder.export.config.pad_token_id or 0
    ids = torch.full((2, width), pad_id, dtype=torch.int64)
    mask = torch.zeros(2, width, dtype=torch.int64)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in lens]
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = p, 1
    decode = torch.randint(3, model.config.vocab_size, (2, steps), generator=gen)

    cache, state = K3Cache(model.config), decoder.initial(2)
    padded = []  # ORT logits per call on the padded batch
    for step in range(1 + steps):
        tok = ids if step == 0 else decode[:, step - 1:step]
        if step:
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.int64)], dim=1)
        with torch.no_grad():
            ref = model(tok, attention_mask=mask, cache=cache).logits.numpy()
        logits, state = decoder.step(tok.numpy(), state, mask.numpy())
        assert not np.isnan(logits).any()
        assert _max_err(logits, ref) < 1e-4, f"step {step}: padded logits differ from torch by {_max_err(logits, ref)}"
        ref_state = _torch_state(cache)
        for name, value in state.items():
            assert _max_err(value, ref_state[name]) < 1e-4, f"step {step}: {name}"
        padded.append(logits)
    kda_names = [s.name for s in decoder.export.manifest.states if s.role != "latent"]
    for r, p in enumerate(prompts):
        pad = width - len(p)
        one_state = decoder.initial(1)
        for step in range(1 + steps):
            tok = p[None] if step == 0 else decode[r:r + 1, step - 1:step]
            one, one_state = decoder.step(tok.numpy(), one_state)
            got = padded[step][r:r + 1, pad:] if step == 0 else padded[step][r:r + 1]
            assert _max_err(got, one) < 1e-4, f"row {r} step {step}: padded vs unpadded {_max_err(got, one)}"
        for name in kda_names:  # pad tokens left no trace in the constant-size state
            assert _max_err(state[name][r:r + 1], one_state[name]) < 1e-4, f"row {r}: {name}"


def test_long_prompts_attend_in_query_blocks(model, tmp_path, monkeypatch):
    """MLA attends more than `MLA_QUERY_BLOCK` queries in blocks (a ``Loop`` under an ``If``; queries and masks
    padded to equal blocks). Forced to blocks of 4: a left-padded batch of 11 tokens (3 blocks, one padded row, and
    queries that see no key), then 6 more tokens over the cache, then a decode step, all equal PyTorch. The export
    writes each MLA attention as the fused ``k3::mla_attend``, whose function body holds the blocks: run here
    without the k3 library (whose kernel attends a query row at a time)."""
    monkeypatch.setattr(graph, "MLA_QUERY_BLOCK", 4)
    monkeypatch.setenv("K3EXPORT_ORT_OPS", "0")
    export_onnx(model, tmp_path / "blocks", dtype="fp32")
    proto = onnx.load(tmp_path / "blocks" / "model.onnx", load_external_data=False)
    assert [n.op_type for n in proto.graph.node].count("mla_attend") == model.config.attn_types.count("mla") > 0
    body = next(f for f in proto.functions if f.name == "mla_attend")
    ifs = [n for n in body.node if n.op_type == "If" and any(
        m.op_type == "Loop" for a in n.attribute if a.name == "then_branch" for m in a.g.node)]
    assert len(ifs) == 1
    decoder = OrtDecoder(tmp_path / "blocks")
    gen = torch.Generator().manual_seed(31)
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=gen)
    mask = torch.ones(2, 11, dtype=torch.int64)
    mask[1, :5] = 0
    cache, state = K3Cache(model.config), decoder.initial(2)
    for tok in (ids, torch.randint(3, model.config.vocab_size, (2, 6), generator=gen),
                torch.randint(3, model.config.vocab_size, (2, 1), generator=gen)):
        if tok is not ids:
            mask = torch.cat([mask, torch.ones(2, tok.shape[1], dtype=torch.int64)], dim=1)
        with torch.no_grad():
            ref = model(tok, attention_mask=mask, cache=cache).logits.numpy()
        logits, state = decoder.step(tok.numpy(), state, mask.numpy())
        assert _max_err(logits, ref) < 1e-4, f"{tok.shape[1]} tokens: {_max_err(logits, ref)}"
        ref_state = _torch_state(cache)
        for name, value in state.items():
            assert _max_err(value, ref_state[name]) < 1e-4, name
    export_onnx(model, tmp_path / "blocks_nomask", dtype="fp32", attention_mask=False)  # the causal-only form
    decoder, cache = OrtDecoder(tmp_path / "blocks_nomask"), K3Cache(model.config)
    logits, _ = decoder.step(ids.numpy(), decoder.initial(2))
    with torch.no_grad():
        assert _max_err(logits, model(ids, cache=cache).logits.numpy()) < 1e-4


def _unread_initializers(graph: onnx.GraphProto) -> set[str]:
    """Initializers of `graph` that no node reads (nor a node's branches), graph inputs' defaults aside."""
    def read(g: onnx.GraphProto) -> set[str]:
        names = set()
        for n in g.node:
            names.update(n.input)
            for a in n.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    names |= read(sub)
        return names

    return {t.name for t in graph.initializer} - read(graph) - {i.name for i in graph.input}


def test_all_ones_mask_reproduces_mask_free_graph(model, decoder, exported, tmp_path):
    res = export_onnx(model, tmp_path / "nomask", attention_mask=False)
    assert [i["name"] for i in res.manifest["inputs"]] == ["input_ids"]
    for folder in (exported, tmp_path / "nomask"):  # neither form writes a constant that nothing reads
        assert not _unread_initializers(onnx.load(str(folder / "model.onnx"), load_external_data=False).graph)
    plain = OrtDecoder(tmp_path / "nomask")
    assert not plain.export.supports_padding and "attention_mask" not in plain.runner.ort.input_names
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(31))
    s_mask, s_plain = decoder.initial(2), plain.initial(2)
    for tok in (ids, ids[:, :1], ids[:, 3:4]):
        a, s_mask = decoder.step(tok.numpy(), s_mask)  # all-ones mask over past + new
        b, s_plain = plain.step(tok.numpy(), s_plain)
        assert _max_err(a, b) < 1e-6
        for name in s_mask:
            assert _max_err(s_mask[name], s_plain[name]) < 1e-6, name


def test_debug_outputs_match_torch_hidden_states(model, tmp_path):
    export_onnx(model, tmp_path / "dbg", debug_outputs=True)
    runner = OrtRunner(tmp_path / "dbg")
    names = runner.manifest.hidden_outputs
    assert names == [f"hidden_states.{i}" for i in range(model.config.num_hidden_layers)]
    ids = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(2))
    out = runner.prefill(ids.numpy())
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    for i, value in enumerate(out.hidden):
        assert _max_err(value, ref.hidden_states[i].numpy()) < 1e-4, names[i]
    assert _max_err(out.logits, ref.logits.numpy()) < 1e-4


def test_kimi_linear_mode_matches_torch(tmp_path):
    """K3 additions off (softplus gate, plain q_proj, SiLU experts, plain residuals) = Kimi-Linear."""
    torch.manual_seed(0)
    from k3export.modeling import K3ForCausalLM, randomize_weights

    model = K3ForCausalLM(K3Config.tiny_kimi_linear()).eval()
    randomize_weights(model, 3)
    export_onnx(model, tmp_path / "kl")
    _prefill_and_decode_match(model, tmp_path / "kl", seed=3)


def _prefill_and_decode_match(model, folder: Path, seed: int) -> None:
    """The export in `folder` under ORT = `model` over a prefill of 9 tokens and two decode steps (logits and every
    state within 1e-4), batch of 2."""
    dec = OrtDecoder(folder)
    ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(seed))
    cache, state = K3Cache(model.config), dec.initial(2)
    for tok in (ids, ids[:, -1:], ids[:, :1]):
        with torch.no_grad():
            ref = model(tok, cache=cache).logits.numpy()
        logits, state = dec.step(tok.numpy(), state)
        assert _max_err(logits, ref) < 1e-4
        ref_state = _torch_state(cache)
        for name in state:
            assert _max_err(state[name], ref_state[name]) < 1e-4, name


def test_kimi_linear_folder_streams_and_matches_torch(tmp_path, monkeypatch):
    """A Kimi-Linear checkpoint folder (bf16, dense experts) exports streamed from its shard headers, with building
    the PyTorch model forbidden (a 48B checkpoint is ~96 GB of bf16); ONNX Runtime then matches the model
    `from_pretrained` loads from the same folder."""
    from k3export.converters.checkpoints.synthetic import write_checkpoint
    from k3export.modeling import K3ForCausalLM

    folder = write_checkpoint(tmp_path / "ckpt", K3Config.tiny_kimi_linear(), layout="kimi_linear")
    with monkeypatch.context() as mp:
        mp.setattr(K3ForCausalLM, "from_pretrained",
                   classmethod(lambda *a, **k: pytest.fail("the export built the model")))
        export_onnx(folder, tmp_path / "kl")
    _prefill_and_decode_match(K3ForCausalLM.from_pretrained(str(folder)).float().eval(), tmp_path / "kl", seed=4)


def _rms_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b**2).mean()))


def test_bf16_export_close_to_fp32_reference(tmp_path):
    """bf16 (8-bit mantissa, unit roundoff 2^-9) carries ~1e-2 RMS error through a few layers; the yardstick is
    PyTorch's own bf16 run of the same model. Top-k routing is made selection-free (top_k = num_experts) because
    a bf16 perturbation can flip a near-tie selection in either implementation independently, a discrete event
    that says nothing about the export; with that, the ONNX bf16 error must be within 1.5x PyTorch's + 0.01."""
    model = tiny_model(0, num_experts_per_token=8)
    export_onnx(model, tmp_path / "bf16", dtype="bf16")
    exp = load_export(tmp_path / "bf16")
    assert exp.dtype == "bfloat16"
    dtypes = {s.role: s.dtype for s in exp.manifest.states}
    assert dtypes == {"conv": "bfloat16", "recurrent": "float32", "latent": "bfloat16"}
    proto = onnx.load(str(exp.model_path), load_external_data=False)
    emu = tmp_path / "bf16" / "emulated.onnx"
    onnx.save(emulate_low_precision(proto), str(emu))
    dec = OrtDecoder(tmp_path / "bf16", emu)

    ref_model = tiny_model(0, num_experts_per_token=8).to(torch.bfloat16)
    fp32_sd = model.state_dict()
    for name, p in ref_model.named_parameters():  # the fp32-kept parameters, as from_pretrained keeps them
        if name.endswith(("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias")):
            p.data = fp32_sd[name].clone()
    ids = torch.randint(3, 512, (2, PREFILL), generator=torch.Generator().manual_seed(5))
    c32, cbf, state = K3Cache(model.config), K3Cache(ref_model.config), dec.initial(2)
    tok = ids
    for step in range(3):
        with torch.no_grad():
            ref = model(tok, cache=c32).logits.numpy()
            ref_bf = ref_model(tok, cache=cbf).logits.float().numpy()
        logits, state = dec.step(tok.numpy(), state)
        err, err_torch = _rms_rel(logits, ref), _rms_rel(ref_bf, ref)
        assert err < 1.5 * err_torch + 0.01, f"step {step}: bf16 ONNX rms-rel {err:.4f}, bf16 torch {err_torch:.4f}"
        tok = torch.from_numpy(ref[:, -1].argmax(-1))[:, None]


def test_fp16_export_runs_natively_and_opset_28(tmp_path):
    """fp16 runs on ORT CPU as is (11-bit mantissa: ~1e-3 per op); opset 28 is accepted too."""
    model = tiny_model(0, num_experts_per_token=8)
    res = export_onnx(model, tmp_path / "fp16", dtype="fp16", opset=28)
    proto = onnx.load(str(res.model_path), load_external_data=False)
    assert {o.domain: o.version for o in proto.opset_import}[""] == 28
    runner = OrtRunner(tmp_path / "fp16")
    state = runner.initial_state(2)  # manifest dtypes: fp16 conv/latent, fp32 recurrent
    assert state["past_key_values.0.conv_state"].dtype == np.float16
    assert state["past_key_values.0.recurrent_state"].dtype == np.float32
    ids = torch.randint(3, 512, (2, PREFILL), generator=torch.Generator().manual_seed(11))
    logits = runner.prefill(ids.numpy()).logits
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    assert logits.dtype == np.float16
    assert _rms_rel(logits.astype(np.float32), ref) < 2e-2


# ------------------------------------------------------------------------------------------------ structure
def _check_structure(proto: onnx.ModelProto) -> None:
    """The k3 plugin ops' nodes (``plugin_namespace``) and the fused ops' (no plugin: TensorRT builds their bodies),
    each with its function; function bodies in standard ops, but the fused ops', which call the k3 ops they hold."""
    functions = {(f.domain, f.name, f.overload): f for f in proto.functions}
    assert {(DOMAIN, op, "") for op in OPS} <= set(functions)
    k3_nodes = [n for n in proto.graph.node if n.domain == DOMAIN]
    assert {n.op_type for n in k3_nodes} <= set(OPS) | set(FUSED_SPECS)
    for n in k3_nodes:
        attrs = {a.name: a for a in n.attribute}
        assert n.op_type in FUSED_SPECS or attrs["plugin_namespace"].s == b"k3", n.name
        assert (DOMAIN, n.op_type, n.overload) in functions
    for f in proto.functions:
        called = {node.domain for node in f.node} - {"", "ai.onnx"}
        assert not called or (f.name in FUSED_SPECS and called == {DOMAIN}), f"{f.name} body uses a custom domain"
    for n in k3_nodes:  # every attribute the op's model-local function declares
        assert set(functions[(DOMAIN, n.op_type, n.overload)].attribute) <= {a.name for a in n.attribute}, n.name
    all_nodes = list(proto.graph.node) + [x for f in proto.functions for x in f.node]
    for n in all_nodes:
        if n.op_type in ("ScatterND", "ScatterElements"):
            red = [a for a in n.attribute if a.name == "reduction"]
            assert not red or red[0].s == b"none", f"{n.op_type} with reduction"
    for n in proto.graph.node:  # control flow only inside k3 op bodies (TensorRT runs those ops as plugins) and
        # MLA's query blocks (TensorRT takes their one-call branch)
        then = [a.g.name for a in n.attribute if a.name == "then_branch"]
        if n.op_type == "If" and then[0].rsplit("/", 1)[-1].startswith(graph.MLA_QUERY_BLOCKS):
            continue
        assert n.op_type not in ("NonZero", "Loop", "Scan", "If"), n.op_type
    for t in proto.graph.initializer:
        if t.name.startswith("model.") or t.name.startswith("lm_head"):
            assert t.data_location == onnx.TensorProto.EXTERNAL, t.name


def test_graph_checks_and_plugin_nodes(exported):
    onnx.checker.check_model(str(exported / "model.onnx"), full_check=True)
    proto = onnx.load(str(exported / "model.onnx"), load_external_data=False)
    _check_structure(proto)
    opsets = {o.domain: o.version for o in proto.opset_import}
    assert opsets[""] >= 27 and opsets[DOMAIN] == 1
    counts = {op: sum(n.op_type == op for n in proto.graph.node) for op in (*OPS, *FUSED_SPECS)}
    cfg = K3Config.tiny()
    assert counts["kda_layer"] == cfg.attn_types.count("kda")  # the fused ops (`export_onnx(kernels=...)`)
    assert counts["moe_route_experts"] == cfg.mlp_types.count("moe")
    # Graph I/O and manifest agree; every state has a present output.
    exp = load_export(exported)
    inputs = [i.name for i in proto.graph.input]
    outputs = [o.name for o in proto.graph.output]
    assert inputs == ["input_ids", "attention_mask"] + exp.manifest.names() + [LOGITS_TO_KEEP]  # the last: optional
    assert exp.manifest.inputs == [TensorSpec("input_ids", "int64", ("batch", "sequence_length")),
                                   TensorSpec("attention_mask", "int64", ("batch", "total_sequence_length"))]
    assert exp.supports_padding
    assert outputs == ["logits"] + [s.present for s in exp.manifest.states]
    assert all(f.stat().st_size > 0 for f in exported.glob("model.onnx.data.*"))
    assert exp.runtime.data_files == sorted(p.name for p in exported.glob("model.onnx.data.*"))
    assert exp.runtime.weights_materialized is True
    # The stacked expert weights go whole to k3::moe_route_experts, which reads only the selected experts.
    experts = [n for n in proto.graph.node if n.op_type == "moe_route_experts"]
    assert len(experts) == cfg.mlp_types.count("moe")
    assert all(sum("experts" in i for i in n.input) == 3 for n in experts)


def test_projections_of_one_input_are_one_product(model, exported):
    """`GraphBuilder.merge_projections`: each layer's projections of one input are one Gemm over the checkpoint's
    tensors one after the other, split into what each was; a weight read by one product keeps its own."""
    from onnx import numpy_helper

    proto = onnx.load(str(exported / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    gemms = [n for n in proto.graph.node if n.op_type == "Gemm"]
    assert len({n.input[0] for n in gemms}) == len(gemms)  # no two products of one input left
    params = dict(model.named_parameters())

    def members(prefix: str, *names: str) -> tuple[str, list[list[str]]]:
        """The joined weight's name and its members' checkpoint tensors (``q|k|v``: one member of three)."""
        joined = prefix + "+".join(n.replace("q|k|v", "qkv_proj") for n in names) + ".weight"
        return joined, [[prefix + part + ".weight" for part in n.replace("q|k|v", "q_proj|k_proj|v_proj").split("|")]
                        for n in names]

    for i, (attn, mlp) in enumerate(zip(model.config.attn_types, model.config.mlp_types)):
        a, f = f"model.layers.{i}.self_attn.", f"model.layers.{i}." + ("block_sparse_moe." if mlp == "moe" else "mlp.")
        for joined, tensors in (
                members(a, "q|k|v", "f_a_proj", "b_proj", "g_proj") if attn == "kda" else
                members(a, "q_a_proj", "kv_a_proj_with_mqa", "g_proj"),
                members(f, "gate", "routed_expert_down_proj", "shared_experts.gate_proj", "shared_experts.up_proj")
                if mlp == "moe" else members(f, "gate_proj", "up_proj")):
            want = torch.cat([params[t].detach() for m in tensors for t in m]).numpy()
            np.testing.assert_array_equal(inits[joined], want, joined)
            gemm = next(g for g in gemms if g.input[1] == joined)
            split = next(n for n in proto.graph.node if n.op_type == "Split" and n.input[0] == gemm.output[0])
            assert inits[split.input[1]].tolist() == [sum(params[t].shape[0] for t in m) for m in tensors]
    assert {"lm_head.weight", "model.layers.0.self_attn.o_proj.weight"} <= set(inits)


def test_sharding_limits_shard_size(model, tmp_path):
    limit = 256 * 1024
    res = export_onnx(model, tmp_path / "sharded", max_shard_bytes=limit)
    files = sorted((tmp_path / "sharded").glob("model.onnx.data.*"))
    assert [f.name for f in files] == res.data_files and len(files) > 3
    proto = onnx.load(str(res.model_path), load_external_data=False)
    lengths = [int({e.key: e.value for e in t.external_data}["length"]) for t in proto.graph.initializer
               if t.data_location == onnx.TensorProto.EXTERNAL]
    assert max(f.stat().st_size for f in files) <= max(limit, max(lengths))
    dec = OrtDecoder(tmp_path / "sharded")
    ids = np.array([[5, 6, 7]])
    sharded, _ = dec.step(ids, dec.initial(1))
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).logits.numpy()
    assert _max_err(sharded, ref) < 1e-4


def test_released_widths_no_weights_graph(tmp_path):
    """Cheap structural check of the full-size graph: 3 layers (KDA, KDA, MLA) at the released widths."""
    cfg = K3Config.k3(num_hidden_layers=3, linear_attn_config=dict(
        head_dim=128, num_heads=96, short_conv_kernel_size=4, use_full_rank_gate=True, gate_lower_bound=-5.0,
        full_attn_layers=[3], kda_layers=[1, 2]))
    res = export_onnx(cfg, tmp_path / "k3", dtype="bf16", weights=False)
    assert not res.weights_materialized and not list((tmp_path / "k3").glob("model.onnx.data.*"))
    assert res.weight_bytes > 100 * 2**30  # declared, not written
    proto = onnx.load(str(res.model_path), load_external_data=False)
    _check_structure(proto)
    shapes = {t.name: list(t.dims) for t in proto.graph.initializer}
    assert shapes["model.layers.1.block_sparse_moe.experts.w1.weight"] == [896, 3072, 3584]
    assert shapes["model.layers.1.block_sparse_moe.experts.w2.weight"] == [896, 3584, 3072]
    assert shapes["model.layers.2.self_attn.kv_b_proj.weight"] == [96 * 256, 512]
    # full_check over the graph with the (absent) weights turned into typed graph inputs
    g = proto.graph
    for t in list(g.initializer):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
            g.initializer.remove(t)
    onnx.checker.check_model(proto, full_check=True)
    man = json.loads((tmp_path / "k3" / "state_manifest.json").read_text())
    by_kind = {s["kind"]: s for s in man["states"]}
    assert by_kind["key"]["shape"] == ["batch", 1, "past_sequence_length", 288]  # the 576-wide latent's halves
    assert by_kind["value"]["present_shape"] == ["batch", 1, "total_sequence_length", 288]
    assert by_kind["conv_state"]["shape"] == ["batch", 3 * 12288, 3] and by_kind["conv_state"]["dtype"] == "bfloat16"
    assert by_kind["recurrent_state"]["shape"] == ["batch", 96, 128, 128]
    assert by_kind["recurrent_state"]["dtype"] == "float32"
    assert len(man["states"]) == 2 * 2 + 2
    assert load_export(tmp_path / "k3").manifest.to_json() == man


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_have_clear_errors(model, tmp_path):
    not_k3 = tmp_path / "llama"
    not_k3.mkdir()
    (not_k3 / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ExportError, match="not a K3 / Kimi-Linear model folder.*llama"):
        export_onnx(not_k3, tmp_path / "o1")
    no_config = tmp_path / "empty_model"
    no_config.mkdir()
    with pytest.raises(ExportError, match="no config.json"):
        export_onnx(no_config, tmp_path / "o1")
    with pytest.raises(ExportError, match="opset"):
        export_onnx(model, tmp_path / "o2", opset=21)
    with pytest.raises(ExportError, match="dtype"):
        export_onnx(model, tmp_path / "o3", dtype="int8")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(K3ExportError, match="not empty.*overwrite"):
        export_onnx(model, busy)
    with pytest.raises(K3ExportError, match="not a folder k3export wrote"):  # --overwrite replaces only exports
        export_onnx(K3Config.tiny(), busy, weights=False, overwrite=True)
    assert (busy / "keep.txt").exists()
    with pytest.raises(ExportError, match="weights=False"):
        export_onnx(K3Config.tiny(), tmp_path / "o4")
    export_onnx(K3Config.tiny(), tmp_path / "o5", weights=False)
    res = export_onnx(K3Config.tiny(), tmp_path / "o5", weights=False, overwrite=True, dtype="fp16")
    assert load_export(res.out_dir).dtype == "float16"
    with pytest.raises(ArtifactError, match="runtime_config.json is missing"):
        load_export(tmp_path / "llama")
    for p in tmp_path.iterdir():
        assert ".partial-" not in p.name


def test_interrupted_export_leaves_nothing_complete(model, tmp_path):
    calls = []

    def boom(done, total):
        assert done < total and (not calls or calls[-1] < done)  # growing; interrupted before the last weight
        calls.append(done)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_onnx(model, tmp_path / "out", progress=boom)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []
    # an existing export survives an interrupted --overwrite
    export_onnx(K3Config.tiny(), tmp_path / "out", weights=False)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        export_onnx(model, tmp_path / "out", overwrite=True, progress=boom)
    assert load_export(tmp_path / "out").runtime.weights_materialized is False
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_export_from_folder_and_preset(model, tmp_path, exported):
    from typer.testing import CliRunner

    from k3export.modeling import save_pretrained
    from k3export_cli.main import app

    save_pretrained(model, tmp_path / "ckpt")
    runner = CliRunner()
    r = runner.invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    a, b = OrtDecoder(tmp_path / "out"), OrtDecoder(exported)
    ids = np.array([[9, 8, 7, 6]])
    assert _max_err(a.step(ids, a.initial(1))[0], b.step(ids, b.initial(1))[0]) == 0.0

    r = runner.invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert r.exit_code == 2 and "overwrite" in r.output
    r = runner.invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--opset", "20"])
    assert r.exit_code == 2 and "opset" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["export", "--config", "tiny", "--no-weights", str(tmp_path / "preset"), "--dtype",
                            "fp16"])
    assert r.exit_code == 0, r.output
    assert load_export(tmp_path / "preset").dtype == "float16"
    r = runner.invoke(app, ["export", "--config", "tiny", str(tmp_path / "p2")])
    assert r.exit_code == 2 and "--no-weights" in r.output


def test_errors_are_k3export_errors():
    assert issubclass(ExportError, K3ExportError)


def test_fused_ops_only_in_the_forms_that_keep_k3_functions(tmp_path):
    """`export_onnx(kernels=...)`: on by default where the form keeps k3 functions, off where it inlines them, and
    refused there in one line when asked for."""
    from k3export.ops.spec import FUSED_SPECS

    with pytest.raises(ExportError, match="--kernels: .*'inlined' inlines.*--no-kernels"):
        export_onnx(K3Config.tiny(), tmp_path / "asked", weights=False, form="inlined", kernels=True)
    for form, fused in (("inlined", False), ("functions", True), ("ort", True)):
        export_onnx(K3Config.tiny(), tmp_path / form, weights=False, form=form)
        ops = {n.op_type for n in onnx.load(str(tmp_path / form / "model.onnx"), load_external_data=False).graph.node}
        assert bool(ops & set(FUSED_SPECS)) is fused, form
