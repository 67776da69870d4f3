"""k3export.ops.cpu: the C++ kernels of the `kda_layer` and `attn_res_aggregate` hooks against the modeling file's
PyTorch functions run in float64, alone and inside a decoding model; and where they decline."""

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
    torch.testing.assert_close(cpu.attn_res_aggregate(sources, proj, norm, 1e-5).double(), ref, rtol=1e-5, atol=2e-6)


def test_kernels_decline_outside_their_contract():
    x = _kda_inputs(1, 2, 16, 4)
    assert cpu.kda_layer(**{**x, "mask": torch.ones(1, 1)}) is NotImplemented
    assert cpu.kda_layer(**{**x, "state": None}) is NotImplemented
    assert cpu.kda_layer(**{**x, "qkv": x["qkv"].double()}) is NotImplemented
    assert cpu.kda_layer(**{**x, "qkv": x["qkv"].expand(1, 2, -1)}) is NotImplemented
    s = [torch.randn(1, 1, 8), torch.randn(1, 2, 8)]
    assert cpu.attn_res_aggregate(s, torch.randn(1, 8), torch.randn(8), 1e-5) is NotImplemented
    with backend.use_backend("torch"):
        assert cpu.kda_layer(**x) is NotImplemented
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
        self.inner, self.calls = inner, {"kda_layer": 0, "attn_res_aggregate": 0}

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
