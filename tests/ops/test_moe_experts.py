"""k3::moe_experts and k3::moe_experts_mxfp4: both Triton kernels (the op's expert-parallel one and the TensorRT
plugin's token-block one, under the interpreter) against the float64 per-slot reference; MXFP4 against the
dequantised reference (compressed-tensors' decoding, `decode_mxfp4`); the registered ops, the modeling hook, the
contract's errors and the AOT PTX of the plugin kernels."""

import sys

import pytest
import torch

import k3export.ops.registry  # noqa: F401  registers torch.ops.k3.*
from k3export.converters.checkpoints.mxfp4 import decode_mxfp4
from k3export.modeling import modeling_k3 as mk
from k3export.ops import KERNELS, OpInputError, use_backend
from k3export.ops.naive import moe_experts_mxfp4_naive, mxfp4_dequant_naive
from k3export.ops.spec import MOE_EXPERTS, MOE_EXPERTS_MXFP4

from k3ops_ref import max_abs, rms_rel
from moe_ref import per_slot_reference

experts = sys.modules["k3export.ops.moe_experts"]  # the module (the package attribute is the op function)
ALGORITHMS = experts.ALGORITHMS
SELECTED = (1, 3, 4, 6)  # experts 0, 2, 5, 7 are never chosen


def _routing(N, k, seed, shared=SELECTED):
    """Distinct experts per token drawn from `shared` (so tokens share experts and others go unchosen)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(shared)
    rows = [pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(N)]
    indices = torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)
    return torch.rand(N, k, generator=gen) + 0.1, indices


def _dense(N=5, D=48, I=32, E=8, k=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + 100)
    z = torch.randn(N, D, generator=gen)
    w1, w3 = (torch.randn(E, I, D, generator=gen) / D**0.5 for _ in range(2))
    w2 = torch.randn(E, D, I, generator=gen) / I**0.5
    weights, indices = _routing(N, k, seed)
    return [z.to(dtype), weights, indices, w1.to(dtype), w3.to(dtype), w2.to(dtype)]


def _mxfp4(N=5, D=64, I=32, E=8, k=2, dtype=torch.float32, seed=0):
    """Random packed bytes (every nibble: zeros, subnormals, signs) and E8M0 scales around 2^-3, plus the
    dequantised fp32 weights (compressed-tensors' decoding)."""
    gen = torch.Generator().manual_seed(seed + 200)
    z = torch.randn(N, D, generator=gen).to(dtype)
    packed, dense = [], []
    for out_f, in_f in ((I, D), (I, D), (D, I)):
        w = torch.randint(0, 256, (E, out_f, in_f // 2), generator=gen, dtype=torch.uint8)
        s = torch.randint(121, 127, (E, out_f, in_f // 32), generator=gen, dtype=torch.uint8)
        packed.append((w, s))
        dense.append(torch.stack([decode_mxfp4(w[e], s[e], torch.float32) for e in range(E)]))
    weights, indices = _routing(N, k, seed)
    ws = [w for w, _ in packed] + [s for _, s in packed]
    return [z, weights, indices, *ws], dense


def _check_fp32(u, ref):
    assert u.dtype == torch.float32 and u.shape == ref.shape
    assert max_abs(u, ref) < 2e-6 * max(1.0, float(ref.abs().max())), max_abs(u, ref)


# ------------------------------------------------------------------------------------------------ dense kernels
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_kernels_match_per_slot_float64(triton_interpreter, device, algorithm, act):
    """Tokens share experts; the experts nobody chose hold NaN and must never be read."""
    args = _dense(seed=1 if act == "situ" else 2)
    unused = sorted(set(range(8)) - set(SELECTED))
    for w in args[3:]:
        w[unused] = float("nan")
    u = experts.moe_experts_triton(*(t.to(device) for t in args), act, 4.0, 25.0, algorithm=algorithm).cpu()
    _check_fp32(u, per_slot_reference(*args, act, 4.0, 25.0))


def test_plugin_kernel_owns_its_rows(triton_interpreter, device):
    """The plugin kernel as TensorRT launches it: more tokens than one block (two programs), a token that names one
    expert twice, and an output buffer full of garbage (it zeroes its own rows; nothing else does)."""
    args = _dense(N=experts.BN + 3, k=3, seed=3)
    args[2][4] = torch.tensor([6, 6, 1])  # both slots of expert 6 count
    ref = per_slot_reference(*args, "situ", 4.0, 25.0)
    const, num_warps = experts.config("tokens", 8, 32, 48, 3, "situ", 4.0, 25.0, "float32", interpret=True)
    grid, scalars = experts.launch("tokens", experts.BN + 3, 8, 32, const)
    assert grid == (2, 1, 1) and scalars == (experts.BN + 3,)
    u = torch.full((experts.BN + 3, 48), float("nan"), device=device)
    experts.moe_experts_kernel[grid](*(t.to(device) for t in args), *scalars, u, num_warps=num_warps, **const)
    _check_fp32(u.cpu(), ref)
    _check_fp32(experts.moe_experts_triton(*args, "situ", 4.0, 25.0), ref)  # the expert-parallel kernel too


def test_more_slots_of_one_expert_than_a_tile(triton_interpreter, device):
    """The expert-parallel kernel walks an expert's slots BM at a time, scanning BS slots per step: expert 3 has 150
    slots (three tiles of 64, the second straddling the two scan blocks of 256)."""
    args = _dense(N=150, k=2, seed=4)
    args[2][:, 0] = 3
    const, _ = experts.config("experts", 8, 32, 48, 2, "silu", 4.0, 25.0, "float32", N=150)
    assert const["BM"] == 64 and const["BS"] == 256
    u = experts.moe_experts_triton(*(t.to(device) for t in args), "silu", 4.0, 25.0).cpu()
    _check_fp32(u, per_slot_reference(*args, "silu", 4.0, 25.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_accumulate_in_fp32(triton_interpreter, device, dtype):
    args = _dense(dtype=dtype, seed=5)
    ref = per_slot_reference(*args, "situ", 4.0, 25.0)  # on the rounded inputs, in float64
    for algorithm in ALGORITHMS:
        u = experts.moe_experts_triton(*(t.to(device) for t in args), "situ", 4.0, 25.0, algorithm=algorithm).cpu()
        assert u.dtype == torch.float32
        assert rms_rel(u, ref) < 4e-3  # the intermediate is rounded to the input dtype for the down GEMM


def test_no_tokens(triton_interpreter, device):
    args = _dense(N=0)
    for algorithm in ALGORITHMS:
        u = experts.moe_experts_triton(*args, "situ", 4.0, 25.0, algorithm=algorithm)
        assert u.shape == (0, 48) and u.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ MXFP4
def test_mxfp4_naive_decoding_is_compressed_tensors_bit_for_bit():
    """Every byte (both nibbles) under every scale byte, against `decode_mxfp4` (bit-identical to
    compressed-tensors): values, signed zeros, inf (scale 255) and NaN (scale 255 times a zero nibble)."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row r: every byte, scale byte r
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)
    ours = mxfp4_dequant_naive(packed, scale, torch.bfloat16)
    ref = decode_mxfp4(packed, scale, torch.bfloat16)
    assert torch.equal(ours.isnan(), ref.isnan())
    keep = ~ref.isnan()
    assert torch.equal(ours[keep].view(torch.int16), ref[keep].view(torch.int16))
    assert torch.equal(mxfp4_dequant_naive(packed, scale)[keep], decode_mxfp4(packed, scale, torch.float32)[keep])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_mxfp4_kernels_match_the_dequantised_reference(triton_interpreter, device, algorithm):
    args, (w1, w3, w2) = _mxfp4(seed=6)
    u = experts.moe_experts_triton(*(t.to(device) for t in args[:6]), "situ", 4.0, 25.0,
                                   *(t.to(device) for t in args[6:]), algorithm=algorithm).cpu()
    ref = per_slot_reference(*args[:3], w1, w3, w2, "situ", 4.0, 25.0)
    _check_fp32(u, ref)
    assert max_abs(moe_experts_mxfp4_naive(args[0].double(), *args[1:], "situ", 4.0, 25.0), ref) < 1e-9


def test_mxfp4_extreme_scales_and_bf16(triton_interpreter, device):
    """Scale bytes 0 (2^-127, subnormal) and 254 on unused rows do not disturb the rest; bf16 activations (W4A16:
    the decoded weights are exact in bf16)."""
    args, dense = _mxfp4(dtype=torch.bfloat16, seed=7)
    args[6][0, 0, 0], args[6][2, 5, 1] = 0, 254  # expert 0 and 2: never chosen
    args[7][1, 3, 0] = 0  # expert 1 (chosen): a group of subnormal values
    dense = [mxfp4_dequant_naive(w, s) for w, s in zip(args[3:6], args[6:9])]
    ref = per_slot_reference(*args[:3], *dense, "silu", 4.0, 25.0)
    for algorithm in ALGORITHMS:
        u = experts.moe_experts_triton(*(t.to(device) for t in args[:6]), "silu", 4.0, 25.0,
                                       *(t.to(device) for t in args[6:]), algorithm=algorithm).cpu()
        assert u.dtype == torch.float32 and rms_rel(u, ref) < 4e-3


# ------------------------------------------------------------------------------------------------ ops and hook
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_registered_ops(triton_interpreter, device, backend):
    args = _dense(seed=8)
    ref = per_slot_reference(*args, "situ", 4.0, 25.0)
    mx, dense = _mxfp4(seed=9)
    mx_ref = per_slot_reference(*mx[:3], *dense, "silu", 4.0, 25.0)
    with use_backend(backend):
        u = torch.ops.k3.moe_experts(*(t.to(device) for t in args), "situ", 4.0, 25.0).cpu()
        u2 = k3export.ops.moe_experts(*(t.to(device) for t in args)).cpu()
        v = torch.ops.k3.moe_experts_mxfp4(*(t.to(device) for t in mx), "silu", 4.0, 25.0).cpu()
    _check_fp32(u, ref)
    assert torch.equal(u, u2)
    _check_fp32(v, mx_ref)


def test_modeling_hook_follows_the_backend_switch(triton_interpreter, monkeypatch):
    calls = []
    real = experts.moe_experts_triton
    monkeypatch.setattr(experts, "moe_experts_triton", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    before = mk._KERNELS.get("moe_experts")  # plug_in may have registered it for the session: put it back after
    mk.register_kernel("moe_experts", KERNELS["moe_experts"])
    try:
        args = _dense(seed=10)
        ref = per_slot_reference(*args, "situ", 4.0, 25.0)
        for backend, n_calls in (("torch", 0), ("triton", 1)):
            with use_backend(backend):
                _check_fp32(mk.moe_experts(*args, "situ", 4.0, 25.0), ref)
            assert len(calls) == n_calls, backend
        with use_backend("triton"):  # float64 is outside the kernels' contract: the modeling code runs
            mk.moe_experts(*(t.double() if t.is_floating_point() and i != 1 else t for i, t in enumerate(args)),
                           "situ", 4.0, 25.0)
        assert len(calls) == 1
    finally:
        mk.register_kernel("moe_experts", before)


def test_export_traces_the_op():
    class M(torch.nn.Module):
        def forward(self, z, weights, indices, w1, w3, w2):
            return torch.ops.k3.moe_experts(z, weights, indices, w1, w3, w2, "situ", 4.0, 25.0)

    ep = torch.export.export(M(), tuple(_dense()))
    assert any("k3.moe_experts" in str(n.target) for n in ep.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_name_the_tensor_or_attribute(triton_interpreter, backend):
    args = _dense()
    mx, _ = _mxfp4()
    situ = ("situ", 4.0, 25.0)
    cases = [
        (args, situ, {3: args[3].bfloat16()}, "input 'w1'.*same as z"),
        (args, situ, {5: args[5][:, :, :16]}, "input 'w2'.*axis 2 is 16 but should be 32"),
        (args, situ, {1: args[1].double()}, "input 'weights': dtype float64"),
        (args, situ, {2: args[2].int()}, "input 'indices': dtype int32"),
        (args, ("gelu", 4.0, 25.0), {}, "act='gelu'"),
        (args, ("situ", 0.0, 25.0), {}, "beta1"),
        (mx, situ, {3: mx[3][:, :, :16], 4: mx[4][:, :, :16]}, "moe_experts_mxfp4: w1 / w3.*D = 64.*D/2 = 16"),
        (mx, situ, {6: mx[6][:, :, :1], 7: mx[7][:, :, :1]}, "D/32 = 1"),
        (mx, situ, {4: mx[4].to(torch.int8)}, "input 'w3': dtype int8, expected uint8 \\(packed E2M1\\)"),
    ]
    with use_backend(backend):
        for inputs, attrs, swap, match in cases:
            op = torch.ops.k3.moe_experts_mxfp4 if len(inputs) == 9 else torch.ops.k3.moe_experts
            with pytest.raises(OpInputError, match=match):
                op(*(swap.get(i, t) for i, t in enumerate(inputs)), *attrs)


# ------------------------------------------------------------------------------------------------ AOT (sm_90 PTX)
@pytest.mark.parametrize("name,dt", [("moe_experts", "bf16"), ("moe_experts", "fp32"), ("moe_experts_mxfp4", "bf16")])
def test_plugin_kernels_compile_for_sm90_without_scratch(name, dt):
    """Entry name, the launch layout read back from the PTX (inputs, the int32 N, the output), zero global and
    profile scratch, attributes and dims baked in, shared memory within the default launch limit."""
    from k3export.ops.aot import check_layout, compile_kernel, ptx_params
    from k3export.plugins.rules import MAX_DEFAULT_SHARED_BYTES

    spec = MOE_EXPERTS_MXFP4 if name.endswith("mxfp4") else MOE_EXPERTS
    kern = compile_kernel(name, dt, {"act": "silu", "beta1": 4.0, "beta2": 25.0},
                          {"E": 64, "I": 256, "D": 512, "top_k": 8})
    check_layout(kern)
    assert kern.entry == f"{name}_kernel" and f".entry {kern.entry}(" in kern.ptx and ".target sm_90" in kern.ptx
    n_in = len(spec.inputs)
    assert ptx_params(kern.ptx, kern.entry) == [".u64 .ptr"] * n_in + [".u32", ".u64 .ptr"] + [".u64 .ptr"] * 2
    assert [n for n, _ in kern.params] == [*spec.input_names, "N", "u"]
    assert (kern.global_scratch, kern.profile_scratch) == (0, 0)
    assert kern.shared <= MAX_DEFAULT_SHARED_BYTES
    c = kern.constexprs
    assert (c["E"], c["I"], c["D"], c["TOP_K"], c["ACT"], c["BETA1"]) == (64, 256, 512, 8, 1, 4.0)
    assert c["BN"] == experts.BN and experts.launch("tokens", 37, 64, 256, c) == ((3, 1, 1), (37,))


def test_launch_and_tile_rules():
    const, warps = experts.config("experts", 896, 3072, 3584, 16, "situ", 4.0, 25.0, "bfloat16", N=1)
    assert (const["BM"], const["BS"], const["BI"], const["BD"], warps) == (16, 16, 64, 32, 4)
    assert experts.launch("experts", 1, 896, 3072, const) == ((896, 48, 1), (1,))
    const, warps = experts.config("experts", 896, 3072, 3584, 16, "situ", 4.0, 25.0, "bfloat16", N=4096)
    assert (const["BM"], const["BS"], warps) == (64, 256, 8)  # 73 slots per expert on average
    const, _ = experts.config("tokens", 896, 3072, 3584, 16, "silu", 4.0, 25.0, "bfloat16", mxfp4=True)
    assert (const["BN"], const["BS"], const["BI"], const["BD"], const["ACT"]) == (16, 256, 32, 32, 1)
    with pytest.raises(OpInputError, match="act='relu'"):
        experts.config("tokens", 8, 32, 32, 2, "relu", 4.0, 25.0, "float32")
