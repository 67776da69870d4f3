"""k3::situ_glu - the SiTU-GLU activation of every K3 FFN.

    softcap(x, b) = b * tanh(x / b)
    SiTU(x; b1)   = softcap(x, b1) * sigmoid(x)
    SiTU-GLU(g,u) = SiTU(g; beta1) * softcap(u; beta2)      (K3: beta1 = 4, beta2 = 25)

Math in fp32, output in the input dtype; |output| <= beta1 * beta2.
"""

from __future__ import annotations

import math

import torch

from k3export.modeling.modeling_k3 import situ_glu as modeling_situ_glu

from k3export.ops import backend as _backend
from k3export.ops._common import FLOAT_DTYPES, OpInputError, check_dtype, check_same_device

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    triton = None
    tl = None
    HAVE_TRITON = False

BLOCK = 1024


def check_situ_glu_inputs(gate, up, beta1, beta2) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(gate.shape) != tuple(up.shape):
        raise OpInputError(f"up: expected the same shape as gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    check_dtype("gate", gate, FLOAT_DTYPES)
    check_dtype("up", up, (gate.dtype,), " (same as gate)")
    check_same_device(gate=gate, up=up)
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not (isinstance(b, (int, float)) and math.isfinite(b) and b > 0):
            raise OpInputError(f"{name}: expected a finite float > 0, got {b!r}")
    if gate.numel() >= 2**31:
        raise OpInputError(f"gate: at most 2**31 - 1 elements per call, got {gate.numel()}")


def situ_glu_naive(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float, *, dtype=torch.float64):
    """Reference in ``dtype`` (float64 by default), returned in the input dtype."""
    g = gate.to(dtype)
    u = up.to(dtype)
    out = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))
    return out.to(gate.dtype)


def situ_glu_torch(gate, up, beta1: float, beta2: float):
    """The torch backend: the modeling file's fp32 SiTU-GLU (the source of truth)."""
    return modeling_situ_glu(gate, up, beta1, beta2)


if HAVE_TRITON:

    @triton.jit
    def situ_glu_kernel(
        gate_ptr, up_ptr,  # inputs
        N,  # int32 scalar: number of elements
        out_ptr,  # output
        BETA1: tl.constexpr, BETA2: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Grid (cdiv(N, BLOCK),): elementwise over flat contiguous gate/up."""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        g = tl.load(gate_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=m, other=0.0).to(tl.float32)
        e = tl.exp(-tl.abs(g))  # overflow-free sigmoid
        sig = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        # tanh written out (no helper jit function, so the AOT path compiles one flat kernel):
        # odd polynomial near 0 (no cancellation), exp form elsewhere (overflow-free)
        x = g / BETA1
        x2 = x * x
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0, -t, t)
        p = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
        tg = tl.where(tl.abs(x) < 0.125, p, t)
        y = u / BETA2
        y2 = y * y
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(y < 0, -t, t)
        p = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0 + y2 * (62.0 / 2835.0)))))
        tu = tl.where(tl.abs(y) < 0.125, p, t)
        out = (BETA1 * tg) * sig * (BETA2 * tu)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=m)


def situ_glu_triton(gate, up, beta1: float, beta2: float):
    if not HAVE_TRITON:
        raise RuntimeError("the Triton situ_glu kernel needs the `triton` package")
    g = gate.contiguous()
    u = up.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        situ_glu_kernel[(triton.cdiv(n, BLOCK),)](g, u, n, out, BETA1=float(beta1), BETA2=float(beta2), BLOCK=BLOCK)
    return out


@torch.library.custom_op("k3::situ_glu", mutates_args=())
def _situ_glu_op(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    check_situ_glu_inputs(gate, up, beta1, beta2)
    if _backend.resolve(gate) == "triton":
        return situ_glu_triton(gate, up, beta1, beta2)
    return situ_glu_torch(gate, up, beta1, beta2)


@_situ_glu_op.register_fake
def _situ_glu_fake(gate, up, beta1, beta2):
    return torch.empty_like(gate)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """Validated entry point for ``torch.ops.k3.situ_glu`` (K3 defaults beta1=4, beta2=25)."""
    check_situ_glu_inputs(gate, up, beta1, beta2)
    return torch.ops.k3.situ_glu(gate, up, float(beta1), float(beta2))
