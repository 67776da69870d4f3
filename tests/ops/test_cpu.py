"""k3export.ops.cpu: the C++ kernels of the `kda_layer`, `attn_res_aggregate`, `rms_norm` and `moe_route` hooks
against the modeling file's PyTorch functions run in float64 (and the router against a per-row reference), alone
and inside a decoding model; and where they decline."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import k3export.modeling.modeling_k3 as mk
from k3export.modeling import K3Config, K3ForCausalLM, randomize_weights
from k3export.ops import backend, cpu

pytestmark = pytest.mark.skipif(cpu.extension() is None, reason="the CPU kernels cannot be built here (no compiler)")


def _kda_inputs(B: int, H: int, K: int, W: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    C = 3 * H * K
    norm = mk.K3RMSNorm(K, 1e-5)
    norm.weight.data = torch.randn(K, generator=gen)
    return dict(qkv=torch.randn(B, 1, C, generator=gen), conv_weight=torch.randn(C, 1, W, generator=gen),
                conv_state=torch.randn(B, C, W - 1, generator=gen),
                g=-3 * torch.rand(B, 1, H, K, generator=gen), b=torch.randn(B, 1, H, generator=gen),
                gate=torch.randn(B, 1, H * K, generator=gen), state=torch.randn(B, H, K, K, generator=gen),
                o_norm=norm)


@pytest.mark.parametrize("B,H,K,W", [(1, 4, 16, 4), (2, 3, 32, 2), (1, 2, 128, 4)])
def test_kda_layer_matches_float64(B, H, K, W):
    x = _kda_inputs(B, H, K, W)
    wide = {n: copy.deepcopy(t).double() for n, t in x.items()}
    with torch.no_grad():
        ref = mk.kda_layer.fallback(**wide)
        got = cpu.kda_layer(**x)
    assert got is not NotImplemented
    for name, a, r in zip(("o", "conv_state", "state"), got, ref):
        assert a.dtype == torch.float32 and a.shape == r.shape, name
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize("n,shape", [(1, (1, 1, 64)), (5, (2, 3, 48)), (17, (1, 1, 512))])
def test_attn_res_aggregate_matches_float64(n, shape):
    gen = torch.Generator().manual_seed(n)
    sources = [3 * torch.randn(*shape, generator=gen) for _ in range(n)]
    proj, norm = torch.randn(1, shape[-1], generator=gen), torch.randn(shape[-1], generator=gen)
    ref = mk.attn_res_aggregate.fallback([s.double() for s in sources], proj.double(), norm.double(), 1e-5)
    # fp32 rounding of the n-term weighted sum: up to ~n ulps of the largest source value (17 sources ~ 3 * 4: 1e-5)
    atol = max(2e-6, n * 2.0**-24 * max(s.abs().max().item() for s in sources))
    torch.testing.assert_close(cpu.attn_res_aggregate(sources, proj, norm, 1e-5).double(), ref, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("shape", [(1, 1, 512), (2, 3, 16), (4, 1)])
def test_rms_norm_matches_float64(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x, w = 5 * torch.randn(*shape, generator=gen), torch.randn(shape[-1], generator=gen)
    ref = mk.rms_norm.fallback(x.double(), w.double(), 1e-6)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6).double(), ref, rtol=1e-5, atol=2e-6)


def _route_reference(logits, bias, top_k, renormalize, scale):
    """Per row in float64: experts by (biased score descending, index ascending), weighed by the unbiased score."""
    weights, indices = [], []
    for row in logits.double():
        s = torch.sigmoid(row)
        chosen = sorted(range(len(row)), key=lambda e: (-(s[e] + bias[e].double()).item(), e))[:top_k]
        w = s[chosen]
        weights.append((w / (w.sum() + 1e-20) if renormalize else w) * scale)
        indices.append(chosen)
    return torch.stack(weights), torch.tensor(indices)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_route_matches_a_per_row_reference(renormalize):
    gen = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(9, 64, generator=gen), -0.1 * torch.randn(64, generator=gen).abs()
    logits[0, :], bias[:16] = 0.0, 0.0  # row 0: 16 experts tie for the top 8, and the lower indices win
    w, idx = cpu.moe_route(logits, bias, 8, renormalize, 2.5)
    rw, ridx = _route_reference(logits, bias, 8, renormalize, 2.5)
    assert idx.dtype == torch.int64 and torch.equal(idx, ridx) and idx[0].tolist() == list(range(8))
    torch.testing.assert_close(w.double(), rw, rtol=1e-6, atol=1e-7)


def test_kernels_decline_outside_their_contract():
    x = _kda_inputs(1, 2, 16, 4)
    assert cpu.kda_layer(**{**x, "mask": torch.ones(1, 1)}) is NotImplemented
    assert cpu.kda_layer(**{**x, "state": None}) is NotImplemented
    assert cpu.kda_layer(**{**x, "qkv": x["qkv"].double()}) is NotImplemented
    assert cpu.kda_layer(**{**x, "qkv": x["qkv"].expand(1, 2, -1)}) is NotImplemented
    s = [torch.randn(1, 1, 8), torch.randn(1, 2, 8)]
    assert cpu.attn_res_aggregate(s, torch.randn(1, 8), torch.randn(8), 1e-5) is NotImplemented
    assert cpu.rms_norm(torch.randn(2, 8).double(), torch.randn(8).double(), 1e-5) is NotImplemented
    assert cpu.moe_route(torch.randn(2, 8), torch.randn(8), 9, True, 1.0) is NotImplemented
    with backend.use_backend("torch"):
        assert cpu.kda_layer(**x) is NotImplemented
        assert cpu.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5) is NotImplemented
    x["g"].requires_grad_(True)
    assert cpu.kda_layer(**x) is NotImplemented


def test_a_failed_build_declines_with_one_warning(monkeypatch, caplog):
    import torch.utils.cpp_extension as ext

    def broken(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(ext, "load", broken)
    cpu.extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="k3export.ops.cpu"):
            assert cpu.attn_res_aggregate([torch.randn(1, 1, 8)], torch.randn(1, 8), torch.randn(8), 1e-5) \
                is NotImplemented
            cpu.extension()
        assert [r.getMessage() for r in caplog.records] == [
            "k3export: CPU decode kernels unavailable (RuntimeError: Ninja is required to load C++ extensions); "
            "PyTorch runs them"]
    finally:
        monkeypatch.undo()
        cpu.extension.cache_clear()


class _Counting:
    """The compiled module, counting the calls of each kernel."""

    def __init__(self, inner):
        self.inner, self.calls = inner, dict.fromkeys(cpu.KERNELS, 0)

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*args):
            self.calls[name] += 1
            return fn(*args)

        return call


def test_a_decoding_model_runs_the_kernels_and_matches_float64(monkeypatch):
    config = K3Config.tiny()
    model = K3ForCausalLM(config).eval()
    randomize_weights(model, 0)
    wide = copy.deepcopy(model).double()  # float64: the kernels decline, the PyTorch functions run
    counting = _Counting(cpu.extension())
    monkeypatch.setattr(cpu, "extension", lambda: counting)
    for name, kernel in cpu.KERNELS.items():
        monkeypatch.setitem(mk._KERNELS, name, kernel)
    tokens = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out, ref = model(input_ids=tokens, use_cache=True), wide(input_ids=tokens, use_cache=True)
        for step in range(6):
            nxt = ref.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, cache=out.cache, use_cache=True)
            ref = wide(input_ids=nxt, cache=ref.cache, use_cache=True)
            torch.testing.assert_close(out.logits.double(), ref.logits, rtol=1e-4, atol=1e-4, msg=f"decode step {step}")
    kda_layers = sum(t == "kda" for t in config.attn_types)
    assert counting.calls["kda_layer"] == 6 * kda_layers  # decode steps only: prefill has more than one token
    assert counting.calls["attn_res_aggregate"] > 7 * config.num_hidden_layers // config.attn_res_block_size
    moe_layers = sum(t == "moe" for t in config.mlp_types)
    assert counting.calls["moe_route"] == 7 * moe_layers and counting.calls["rms_norm"] > 7 * config.num_hidden_layers
