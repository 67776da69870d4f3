"""The Triton ``moe_experts`` kernels on NVFP4 experts (packed E2M1, E4M3 scales per 16, fp32 global scales),
under the interpreter on CPU, against the float64 naive reference (`moe_experts_nvfp4_naive`)."""

from __future__ import annotations

import sys

import pytest
import torch

import k3export.ops.registry  # noqa: F401  registers torch.ops.k3.* (and imports the module below)
from k3export.ops.naive import moe_experts_nvfp4_naive

experts = sys.modules["k3export.ops.moe_experts"]  # the module (the package attribute is the op function)

pytestmark = pytest.mark.skipif(not experts.HAVE_TRITON, reason="needs triton")


def _nvfp4(N=5, D=64, I=32, E=6, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    mats = {}
    shared = torch.rand(E, generator=g) * 0.1 + 0.02
    for w, (o, i) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
        packed = torch.randint(0, 256, (E, o, i // 2), generator=g, dtype=torch.int32).to(torch.uint8)
        # E4M3 bytes over the normal and subnormal range, both signs kept positive (no NaN)
        scale = torch.randint(0x01, 0x58, (E, o, i // 16), generator=g, dtype=torch.int32).to(torch.uint8)
        s2 = shared if w != "w2" else torch.rand(E, generator=g) * 0.1 + 0.02
        mats[w] = (packed, scale.view(torch.float8_e4m3fn), s2.float())
    z = torch.randn(N, D, generator=g)
    weights = torch.rand(N, k, generator=g)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    return z, weights, indices, mats


@pytest.mark.parametrize("algorithm", ["experts", "tokens"])
def test_nvfp4_kernel_matches_the_float64_reference(triton_interpreter, device, algorithm):
    """The op's kernel and the TensorRT plugin's ("tokens": 20 tokens, two blocks of BN, with repeats of experts
    across them)."""
    z, weights, indices, mats = _nvfp4(N=20 if algorithm == "tokens" else 5)
    packed = [mats[w][0] for w in ("w1", "w3", "w2")]
    scales = [mats[w][1] for w in ("w1", "w3", "w2")]
    scale_2 = [mats[w][2] for w in ("w1", "w3", "w2")]
    u = experts.moe_experts_triton(*(t.to(device) for t in (z, weights, indices, *packed)), "situ", 4.0, 25.0,
                                   *(t.to(device) for t in scales),
                                   scale_2=tuple(t.to(device) for t in scale_2), algorithm=algorithm).cpu()
    ref = moe_experts_nvfp4_naive(z.double(), weights, indices, *packed, *scales, *scale_2, "situ", 4.0, 25.0)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(u.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
