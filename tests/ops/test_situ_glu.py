"""k3::situ_glu: Triton kernel (interpreter) and torch path vs a float64 reference."""

import pytest
import torch

from k3export.ops import OpInputError, situ_glu, use_backend
from k3export.ops.naive import situ_glu_naive
from k3export.ops.situ_glu import situ_glu_triton

from k3ops_ref import max_abs, rms_rel


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # wide range: exercises tanh near 0 (polynomial), mid range and saturation
    g = torch.randn(shape, generator=gen) * 6
    u = torch.randn(shape, generator=gen) * 40
    g.view(-1)[:4] = torch.tensor([0.0, 1e-4, -200.0, 200.0])
    u.view(-1)[:4] = torch.tensor([1e-6, -1e-3, 1e4, -1e4])
    return g.to(dtype), u.to(dtype)


def _formula64(g, u, b1, b2):
    g, u = g.double(), u.double()
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 5, 1100)])
@pytest.mark.parametrize("beta1,beta2", [(4.0, 25.0), (1.0, 2.5)])
def test_kernel_fp32(triton_interpreter, device, shape, beta1, beta2):
    g, u = _inputs(shape, torch.float32, seed=len(shape))
    out = situ_glu_triton(g.to(device), u.to(device), beta1, beta2).cpu()
    ref = _formula64(g, u, beta1, beta2)
    assert out.dtype == torch.float32 and out.shape == g.shape
    # relative to the output scale (|out| <= beta1 * beta2)
    assert max_abs(out, ref) < 1e-5 * beta1 * beta2
    # and relatively accurate near zero (no cancellation in tanh)
    small = ref.abs() < 1e-2
    if small.any():
        rel = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-30))[small & (ref != 0)]
        assert rel.max() < 1e-5 if rel.numel() else True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half(triton_interpreter, device, dtype):
    g, u = _inputs((4, 300), dtype, seed=5)
    out = situ_glu_triton(g.to(device), u.to(device), 4.0, 25.0).cpu()
    assert out.dtype == dtype
    ref = _formula64(g, u, 4.0, 25.0)
    assert rms_rel(out, ref) < 5e-3
    # the output rounding is the only error: identical to rounding the exact value
    assert max_abs(out, ref.to(dtype)) <= float(ref.abs().max()) * 2**-7


def test_bound(triton_interpreter, device):
    g = torch.tensor([1e4, 1e4, -1e4], device=device)
    u = torch.tensor([1e4, -1e4, 1e4], device=device)
    out = situ_glu_triton(g, u, 4.0, 25.0).cpu()
    assert torch.allclose(out, torch.tensor([100.0, -100.0, 0.0]), atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_registered_op(triton_interpreter, device, backend):
    g, u = _inputs((3, 33), torch.float32, seed=9)
    with use_backend(backend):
        out = torch.ops.k3.situ_glu(g.to(device), u.to(device), 4.0, 25.0).cpu()
        out2 = situ_glu(g.to(device), u.to(device)).cpu()
    assert max_abs(out, situ_glu_naive(g, u, 4.0, 25.0)) < 1e-4
    assert torch.equal(out, out2)


def test_export_traces_the_op():
    class M(torch.nn.Module):
        def forward(self, g, u):
            return torch.ops.k3.situ_glu(g, u, 4.0, 25.0)

    g, u = _inputs((2, 8), torch.float32)
    ep = torch.export.export(M(), (g, u))
    assert any("k3.situ_glu" in str(n.target) for n in ep.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize(
    "args,name",
    [
        ((torch.zeros(2, 3), torch.zeros(3, 2), 4.0, 25.0), "up"),
        ((torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16), 4.0, 25.0), "up"),
        ((torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), 4.0, 25.0), "gate"),
        ((torch.zeros(2), torch.zeros(2), 0.0, 25.0), "beta1"),
        ((torch.zeros(2), torch.zeros(2), 4.0, float("nan")), "beta2"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs(triton_interpreter, backend, args, name):
    with use_backend(backend):
        with pytest.raises(OpInputError, match=name):
            situ_glu(*args)
        with pytest.raises(ValueError, match=name):
            torch.ops.k3.situ_glu(*args)
