"""onnxruntime-genai's own Generator (greedy, search options from genai_config.json) on our export produces the
PyTorch model's tokens: 64 steps, batch 1 and batch 2 with prompts of different lengths, on the tiny model and on
bench/big_cfg.json."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from genai_fixtures import export_for_genai

og = pytest.importorskip("onnxruntime_genai")

from big_cfg import big_config  # noqa: E402

STEPS = 64


def prompts_for(config, lengths, seed=0) -> list[list[int]]:
    """Random prompts that avoid the special ids (genai reads trailing pad tokens as padding)."""
    rng = np.random.default_rng(seed)
    special = {config.pad_token_id, config.bos_token_id, *np.atleast_1d(config.eos_token_id).tolist()}
    out = []
    for n in lengths:
        row = [int(t) for t in rng.integers(3, config.vocab_size, size=3 * n) if int(t) not in special][:n]
        out.append(row)
    return out


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def torch_greedy(model, prompt: list[int], steps: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=steps, do_sample=False, eos_token_id=None,
                         pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt):].tolist()


def genai_greedy(export: Path, prompts: list[list[int]], steps: int, pad: int) -> list[list[int]]:
    """The standard genai loop: a right-padded batch (genai's padding), append_tokens once, generate_next_token."""
    model = og.Model(str(export))
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), pad, dtype=np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=len(prompts), max_length=width + steps)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    out: list[list[int]] = [[] for _ in prompts]
    while not gen.is_done():
        gen.generate_next_token()
        for row, t in zip(out, gen.get_next_tokens()):
            row.append(int(t))
    return out


def right_padding_is_a_noop(model) -> bool:
    """Whether the model's KDA layers leave their state alone for trailing masked tokens (genai's right padding):
    the modeling + graph change that batch-2 genai generation needs."""
    from k3export.modeling import K3Cache

    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, model.config.pad_token_id, model.config.pad_token_id]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        padded, alone = K3Cache(model.config), K3Cache(model.config)
        model(ids, attention_mask=mask, cache=padded)
        model(ids[1:, :3], cache=alone)
    a, b = padded.to_states(), alone.to_states()
    return all(torch.allclose(a[n][1:], b[n], atol=1e-4) for n in a if not n.endswith((".key", ".value")))


_TORCH: dict[tuple[int, tuple[int, ...]], list[int]] = {}  # torch greedy tokens, by (model, prompt)


def check(model, export: Path, prompts: list[list[int]]) -> None:
    cfg = model.config
    eos = set(np.atleast_1d(cfg.eos_token_id).tolist())
    for p in prompts:
        if (id(model), tuple(p)) not in _TORCH:
            _TORCH[id(model), tuple(p)] = torch_greedy(model, p, STEPS)
    want = [until_eos(_TORCH[id(model), tuple(p)], eos) for p in prompts]
    got = genai_greedy(export, prompts, STEPS, cfg.pad_token_id)
    for i, (g, w) in enumerate(zip(got, want)):
        assert until_eos(g, eos) == w, f"row {i} (prompt length {len(prompts[i])}): genai {g[:12]}... vs torch " \
                                       f"{w[:12]}..."
        assert len(w) == STEPS or w[-1] in eos


@pytest.fixture(scope="module")
def tiny_export(tok_model, tok_checkpoint, tmp_path_factory):
    return export_for_genai(tok_model, tok_checkpoint, tmp_path_factory.mktemp("gen") / "tiny")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    from k3export.modeling import K3ForCausalLM, randomize_weights

    torch.manual_seed(1)
    model = K3ForCausalLM(big_config()).eval()
    randomize_weights(model, seed=1)
    return model, export_for_genai(model, None, tmp_path_factory.mktemp("gen") / "big")


def _needs_right_padding(model):
    if not right_padding_is_a_noop(model):
        pytest.xfail("onnxruntime-genai right-pads a batch; the model/graph still decay the KDA state and shift the "
                     "conv window over trailing masked tokens (needs the masked-token no-op change in modeling_k3.py "
                     "and converters/onnx/graph.py)")


def test_tiny_batch1(tok_model, tiny_export):
    check(tok_model, tiny_export, prompts_for(tok_model.config, [11, 4])[:1])


def test_tiny_batch2_different_lengths(tok_model, tiny_export):
    _needs_right_padding(tok_model)
    check(tok_model, tiny_export, prompts_for(tok_model.config, [11, 4]))


def test_big_cfg_batch1(big):
    check(big[0], big[1], prompts_for(big[0].config, [16, 7])[:1])


def test_big_cfg_batch2_different_lengths(big):
    _needs_right_padding(big[0])
    check(big[0], big[1], prompts_for(big[0].config, [16, 7]))
