"""The whole tiny K3 with `ops_backend="triton"` (torch.ops.k3.* Triton kernels, interpreted on CPU)
against the plain-PyTorch model over prefill and decode."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from k3export.modeling import K3Cache  # noqa: E402


def test_triton_backend_matches_torch_over_prefill_and_decode(tiny_k3):
    ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(0))
    triton_model = copy.deepcopy(tiny_k3)
    triton_model.config.ops_backend = "triton"
    assert tiny_k3.config.ops_backend == "auto"  # on CPU "auto" means the plain-PyTorch ops

    def run(model):
        cache = K3Cache(model.config)
        with torch.no_grad():
            logits = [model(ids[:, :9], cache=cache).logits]
            logits += [model(ids[:, t:t + 1], cache=cache).logits for t in range(9, 13)]
        return torch.cat(logits, 1), cache

    ref, ref_cache = run(tiny_k3)
    got, got_cache = run(triton_model)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    for i, state in ref_cache.recurrent_states.items():
        torch.testing.assert_close(got_cache.recurrent_states[i], state, atol=1e-4, rtol=0)
    for i, latent in ref_cache.latents.items():
        torch.testing.assert_close(got_cache.latents[i], latent, atol=1e-4, rtol=0)
