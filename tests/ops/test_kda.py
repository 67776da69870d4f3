"""k3::kda: Triton kernels (interpreter on CPU), the modeling file's chunked form and the registered op vs the
float64 token recurrence (``k3export.ops.naive``)."""

import functools
import itertools

import pytest
import torch

from k3export.modeling.modeling_k3 import kda_chunked
from k3export.ops import KERNELS, OpInputError, kda, kda_algorithm, use_backend
from k3export.ops.kda import CHUNK_SIZES, kda_triton
from k3export.ops.naive import kda_naive

from k3ops_ref import kda_inputs, max_abs, rms_rel

kda_recurrent_triton = functools.partial(kda_triton, algorithm="recurrent")
kda_chunk_triton = functools.partial(kda_triton, algorithm="chunk")

T_GRID = (1, 7, 64, 130)
H_GRID = (1, 3)
D_GRID = (16, 32, 64)
CASES = [("fp32", "zero"), ("fp32", "nonzero"), ("bf16", "zero"), ("bf16", "nonzero")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


CORE = (("fp32", "nonzero"), ("bf16", "zero"))


def _grid(kernel):
    """Full grid T x H x D x (dtype, state). The interpreter is slow (~10-50 ms per token and
    head on 2 shared cores), so the costliest combos are marked slow: recurrent cost ~ T*H,
    chunk cost ~ chunks*H. The default run keeps every T, H, D and all four dtype/state cases at
    small cost, and the two core cases for the larger ones."""
    for T, H, D, case in itertools.product(T_GRID, H_GRID, D_GRID, CASES):
        cost = T * H if kernel == "recurrent" else -(-T // 64) * H
        cheap = 21 if kernel == "recurrent" else 1
        medium = 64 if kernel == "recurrent" else 3
        slow = cost > medium or (cost > cheap and case not in CORE)
        if kernel == "chunk" and cost > 1 and D != 16 and case in CORE:
            slow = True
        marks = [pytest.mark.slow] if slow else []
        yield pytest.param(T, H, D, case, marks=marks, id=f"T{T}-H{H}-D{D}-{case[0]}-{case[1]}")


def _check(fn, T, H, D, case, device, seed):
    scale = D ** -0.5
    dt, state = case
    inp = kda_inputs(1, T, H, D, D, dtype=DTYPES[dt], state=state, seed=seed, device=device)
    before = {n: t.clone() for n, t in inp.items()}
    o, s = fn(**inp, scale=scale)
    assert o.dtype == inp["q"].dtype and s.dtype == torch.float32
    assert o.shape == (1, T, H, D) and s.shape == (1, H, D, D)
    for n in inp:  # inputs never mutated
        assert torch.equal(inp[n], before[n]), n
    # float64 reference on the same (possibly bf16-rounded) inputs
    o_ref, s_ref = kda_naive(**{n: t.cpu().double() for n, t in inp.items()}, scale=scale, dtype=torch.float64)
    o, s = o.cpu(), s.cpu()
    if dt == "fp32":
        assert max_abs(o, o_ref) < 1e-5, max_abs(o, o_ref)
        assert max_abs(s, s_ref) < 1e-5, max_abs(s, s_ref)
    else:
        assert torch.isfinite(o.float()).all()
        assert rms_rel(o, o_ref) < 5e-3, rms_rel(o, o_ref)
        assert rms_rel(s, s_ref) < 5e-3, rms_rel(s, s_ref)


@pytest.mark.parametrize("T,H,D,case", list(_grid("recurrent")))
def test_recurrent_kernel_vs_naive(triton_interpreter, device, T, H, D, case):
    _check(kda_recurrent_triton, T, H, D, case, device, seed=T * 100 + H * 10 + D)


@pytest.mark.parametrize("T,H,D,case", list(_grid("chunk")))
def test_chunk_kernel_vs_naive(triton_interpreter, device, T, H, D, case):
    _check(kda_chunk_triton, T, H, D, case, device, seed=T * 101 + H * 7 + D)


@pytest.mark.parametrize("T", T_GRID + (200,))
@pytest.mark.parametrize("dt,state", CASES)
def test_modeling_chunked_vs_naive(T, dt, state):
    """The modeling file's vectorised chunked form (the PyTorch fallback of prefill) over the same grid, batch 2,
    H=3, against the independent reference."""
    inp = kda_inputs(2, T, 3, 32, 16, dtype=DTYPES[dt], state=state, seed=T)
    o, s = kda_chunked(**inp, scale=0.2)
    o_ref, s_ref = kda_naive(**{n: t.double() for n, t in inp.items()}, scale=0.2)
    if dt == "fp32":
        assert max_abs(o, o_ref) < 1e-5 and max_abs(s, s_ref) < 1e-5
    else:
        assert rms_rel(o, o_ref) < 5e-3 and rms_rel(s, s_ref) < 5e-3


def test_strong_decay_no_overflow(triton_interpreter, device):
    """Gates down to -30 per token (chunk decay sums ~ -1000): sub-block splitting keeps it finite."""
    inp = kda_inputs(1, 80, 2, 16, 16, state="nonzero", gate="strong", seed=3, device=device)
    o_ref, s_ref = kda_naive(**{n: t.cpu().double() for n, t in inp.items()}, scale=0.25)
    for name, fn in (("modeling", kda_chunked), ("chunk", kda_chunk_triton), ("recurrent", kda_recurrent_triton)):
        o, s = fn(**inp, scale=0.25)
        assert torch.isfinite(o).all() and torch.isfinite(s).all(), name
        assert rms_rel(o.cpu(), o_ref) < 1e-5 and rms_rel(s.cpu(), s_ref) < 1e-5, name


def test_prefill_then_decode_equals_one_shot(triton_interpreter, device):
    """Carried state: chunked prefill of 70 tokens then 3 recurrent steps == one pass of 73."""
    inp = kda_inputs(1, 73, 2, 16, 16, state="nonzero", seed=11, device=device)
    o_full, s_full = kda_naive(**{n: t.cpu().double() for n, t in inp.items()}, scale=0.25)
    sl = lambda a, b: {n: (t[:, a:b] if n != "initial_state" else t) for n, t in inp.items()}  # noqa: E731
    o1, s = kda_chunk_triton(**sl(0, 70), scale=0.25)
    outs = [o1]
    for t in range(70, 73):
        step = sl(t, t + 1)
        step["initial_state"] = s
        o_t, s = kda_recurrent_triton(**step, scale=0.25)
        outs.append(o_t)
    assert max_abs(torch.cat(outs, 1).cpu(), o_full) < 1e-5
    assert max_abs(s.cpu(), s_full) < 1e-5


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunk_sizes_vs_naive(triton_interpreter, device, chunk_size):
    inp = kda_inputs(1, 70, 2, 16, 16, state="nonzero", seed=chunk_size, device=device)
    o, s = kda_triton(**inp, scale=0.25, chunk_size=chunk_size)
    o_ref, s_ref = kda_naive(**{n: t.cpu().double() for n, t in inp.items()}, scale=0.25)
    assert max_abs(o.cpu(), o_ref) < 1e-5 and max_abs(s.cpu(), s_ref) < 1e-5


def test_one_rule_picks_the_kernel(triton_interpreter, device):
    """kda_algorithm: recurrent for one token, chunked for more; the op and the "kda" hook run exactly that
    kernel (bit for bit), with the chunk size they are given; the hook declines what the kernels do not take."""
    assert [kda_algorithm(T) for T in (1, 2, 64, 65)] == ["recurrent", "chunk", "chunk", "chunk"]
    for T, chunk_size in ((1, 64), (5, 64), (40, 16)):
        inp = kda_inputs(1, T, 2, 16, 16, state="nonzero", seed=T, device=device)
        want = kda_triton(**inp, scale=0.25, chunk_size=chunk_size, algorithm=kda_algorithm(T))
        with use_backend("triton"):
            got = KERNELS["kda"](*inp.values(), 0.25, chunk_size)
            op = torch.ops.k3.kda(*inp.values(), 0.25, chunk_size)
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got, op, want)), (T, chunk_size)
    with use_backend("triton"):
        assert KERNELS["kda"](*inp.values(), 0.25, 128) is NotImplemented  # chunk size the kernel lacks
        assert KERNELS["kda"](*(t.double() for t in inp.values()), 0.25) is NotImplemented  # float64 reference
    with use_backend("torch"):
        assert KERNELS["kda"](*inp.values(), 0.25, 64) is NotImplemented


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_registered_op_dispatch(triton_interpreter, device, backend, T):
    inp = kda_inputs(2, T, 2, 16, 32, state="nonzero", seed=T, device=device)
    with use_backend(backend):
        o, s = torch.ops.k3.kda(*inp.values(), 0.3)
        o2, s2 = kda(**inp, scale=0.3)
    o_ref, s_ref = kda_naive(**{n: t.cpu().double() for n, t in inp.items()}, scale=0.3)
    assert max_abs(o.cpu(), o_ref) < 1e-5 and max_abs(s.cpu(), s_ref) < 1e-5
    assert torch.equal(o, o2) and torch.equal(s, s2)


def test_wrapper_defaults():
    inp = kda_inputs(1, 4, 1, 16, 16, state="zero", seed=1)
    with use_backend("torch"):
        o, s = kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])  # zeros state, K^-0.5
    o_ref, s_ref = kda_naive(**{n: t.double() for n, t in inp.items()}, scale=16 ** -0.5)
    assert max_abs(o, o_ref) < 1e-6 and max_abs(s, s_ref) < 1e-6


def test_torch_export_traces_the_op():
    class M(torch.nn.Module):
        def forward(self, q, k, v, g, beta, h0):
            return torch.ops.k3.kda(q, k, v, g, beta, h0, 0.25)

    inp = kda_inputs(1, 5, 2, 16, 16, seed=2)
    ep = torch.export.export(M(), tuple(inp.values()))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert any("k3.kda" in t for t in targets), targets
    with use_backend("torch"):
        o, s = ep.module()(*inp.values())
    o_ref, s_ref = kda_naive(**{n: t.double() for n, t in inp.items()}, scale=0.25)
    assert max_abs(o, o_ref) < 1e-5 and max_abs(s, s_ref) < 1e-5


def _bad_cases():
    good = kda_inputs(2, 3, 2, 16, 8, seed=0)

    def mod(**kw):
        d = dict(good)
        d.update(kw)
        return d

    return [
        ("q", mod(q=good["q"][0])),
        ("k", mod(k=good["k"][:, :2])),
        ("v", mod(v=torch.zeros(2, 3, 3, 8))),
        ("g", mod(g=good["g"].to(torch.bfloat16))),
        ("g", mod(g=good["g"][..., :8])),
        ("beta", mod(beta=torch.zeros(2, 3, 5))),
        ("initial_state", mod(initial_state=good["initial_state"].to(torch.bfloat16))),
        ("initial_state", mod(initial_state=torch.zeros(2, 2, 8, 16))),
        ("initial_state", mod(initial_state=torch.zeros(1, 2, 16, 8))),
        ("v", mod(v=good["v"].to(torch.bfloat16))),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", range(10))
def test_bad_inputs_raise_value_error(triton_interpreter, backend, case):
    name, args = _bad_cases()[case]
    with use_backend(backend):
        with pytest.raises(ValueError, match=name) as info:
            kda(**args, scale=0.25)
        assert isinstance(info.value, OpInputError)
        with pytest.raises(ValueError, match=name):  # the registered op checks too
            torch.ops.k3.kda(*args.values(), 0.25)
