"""k3::situ_glu - the SiTU-GLU activation of every K3 FFN.

    softcap(x, b) = b * tanh(x / b)
    SiTU(x; b1)   = softcap(x, b1) * sigmoid(x)
    SiTU-GLU(g,u) = SiTU(g; beta1) * softcap(u; beta2)      (K3: beta1 = 4, beta2 = 25)

Math in fp32, output in the input dtype; |output| <= beta1 * beta2. The contract is ``spec.SITU_GLU``; the torch
backend is ``naive.situ_glu_naive`` in fp32, the Triton backend ``situ_glu_kernel``.
"""

from __future__ import annotations

import torch

from k3export.ops import backend
from k3export.ops.naive import situ_glu_naive
from k3export.ops.spec import SITU_GLU, check_tensors

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    HAVE_TRITON = False

BLOCK = 1024


if HAVE_TRITON:

    @triton.jit
    def _tanh(x):
        """tanh in fp32: an odd polynomial near 0 (no cancellation), the exp form elsewhere (overflow-free)."""
        x2 = x * x
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        p = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
        return tl.where(tl.abs(x) < 0.125, p, tl.where(x < 0, -t, t))

    @triton.jit
    def situ_glu_kernel(
        gate_ptr, up_ptr,  # inputs
        numel,  # int32 scalar
        out_ptr,  # output
        BETA1: tl.constexpr, BETA2: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Grid (cdiv(numel, BLOCK),): elementwise over flat contiguous gate / up."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < numel
        g = tl.load(gate_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=m, other=0.0).to(tl.float32)
        e = tl.exp(-tl.abs(g))  # overflow-free sigmoid
        sig = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        res = (BETA1 * _tanh(g / BETA1)) * sig * (BETA2 * _tanh(u / BETA2))
        tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=m)


def launch(numel, cdiv=lambda a, b: -(-a // b)) -> tuple[tuple, tuple]:
    """(grid, int32 scalars): grid (cdiv(numel, BLOCK), 1, 1), scalars (numel,). A symbolic numel needs the
    caller's `cdiv` (``tensorrt.plugin.cdiv``)."""
    return (cdiv(numel, BLOCK), 1, 1), (numel,)


def aot_config(kernel: str, float_dtype: str, attrs: dict, dims: dict):
    """(jit function, constexprs, num_warps) of the plugin kernel: beta1, beta2 baked in."""
    return situ_glu_kernel, {"BETA1": float(attrs["beta1"]), "BETA2": float(attrs["beta2"]), "BLOCK": BLOCK}, 4


def situ_glu_triton(gate, up, beta1: float, beta2: float):
    if not HAVE_TRITON:
        raise RuntimeError("the Triton situ_glu kernel needs the `triton` package")
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    if g.numel():
        grid, scalars = launch(g.numel())
        situ_glu_kernel[grid](g, u, *scalars, out, BETA1=float(beta1), BETA2=float(beta2), BLOCK=BLOCK)
    return out


@torch.library.custom_op("k3::situ_glu", mutates_args=())
def _situ_glu_op(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    check_tensors(SITU_GLU, gate, up, beta1=beta1, beta2=beta2)
    if backend.resolve(gate) == "torch":
        return situ_glu_naive(gate, up, beta1, beta2, dtype=torch.float32)
    return situ_glu_triton(gate, up, beta1, beta2)


@_situ_glu_op.register_fake
def _(gate, up, beta1, beta2):
    return torch.empty_like(gate)


def situ_glu(gate, up, beta1: float = 4.0, beta2: float = 25.0):
    """``torch.ops.k3.situ_glu`` with K3's defaults (beta1 = 4, beta2 = 25)."""
    return torch.ops.k3.situ_glu(gate, up, float(beta1), float(beta2))
