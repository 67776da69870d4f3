"""The ``k3::moe_experts`` and ``k3::moe_experts_mxfp4`` plugins without TensorRT: their decorated functions against a
stand-in ``tensorrt.plugin`` (output descs = the torch ops' outputs, io types, the AOT kernel with its entry, grid,
block, shared memory and int32 scalar N), and the contracts' shape / dtype rules as plain functions."""

import pytest
import torch

from k3export.dtypes import dtype
from k3export.ops.spec import MOE_EXPERTS, MOE_EXPERTS_MXFP4, OpInputError
from k3export.plugins import rules

ATTRS = {"act": "situ", "beta1": 4.0, "beta2": 25.0}
N, D, I, E, K = 5, 64, 32, 8, 2


def _tensors(dt, mxfp4):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(N, D, generator=gen).to(dt)
    weights, indices = torch.rand(N, K, generator=gen), torch.randint(0, E, (N, K), generator=gen)
    if mxfp4:
        ws = [torch.randint(0, 256, s, generator=gen, dtype=torch.uint8)
              for s in ((E, I, D // 2), (E, I, D // 2), (E, D, I // 2))]
        ss = [torch.full(s, 127, dtype=torch.uint8) for s in ((E, I, D // 32), (E, I, D // 32), (E, D, I // 32))]
        return [z, weights, indices, *ws, *ss]
    return [z, weights, indices, *(torch.randn(*s, generator=gen).to(dt) for s in ((E, I, D), (E, I, D), (E, D, I)))]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [MOE_EXPERTS, MOE_EXPERTS_MXFP4], ids=lambda s: s.name)
def test_registered_descs_agree_with_the_torch_ops(fake_trt, dt, spec):
    import k3export.ops.registry  # noqa: F401  registers torch.ops.k3.*

    trt, trtp, registry = fake_trt
    args = _tensors(dt, spec is MOE_EXPERTS_MXFP4)
    u = getattr(torch.ops.k3, spec.name)(*args, *ATTRS.values())  # the torch backend on CPU
    (d,) = registry[spec.plugin_id]["register"](*(trtp.TensorDesc(tuple(t.shape), dtype(t.dtype).trt) for t in args),
                                                *ATTRS.values())
    assert (d.shape, dtype(d.dtype).name) == (tuple(u.shape), "float32")
    with pytest.raises(OpInputError, match="act='gelu'"):  # the spec's checks run there too
        registry[spec.plugin_id]["register"](*(trtp.TensorDesc(tuple(t.shape), dtype(t.dtype).trt) for t in args),
                                             "gelu", 4.0, 25.0)


def test_autotune_types_from_the_spec():
    """Written out by hand: z and the dense weights share the dependent FP32|BF16|FP16 entry; MXFP4 bytes travel as
    INT8 (TensorRT's parser widens UINT8 initializers to INT32)."""
    f = "FP32|BF16|FP16"
    assert rules.autotune_types(MOE_EXPERTS) == ", ".join([f, "FP32", "INT64", f, f, f, "FP32"])
    assert rules.autotune_types(MOE_EXPERTS_MXFP4) == ", ".join([f, "FP32", "INT64"] + ["INT8"] * 6 + ["FP32"])


def _v(x):
    return getattr(x, "v", x)


@pytest.mark.parametrize("spec", [MOE_EXPERTS, MOE_EXPERTS_MXFP4], ids=lambda s: s.name)
def test_aot_impl_launches_the_token_block_kernel(fake_trt, spec):
    pytest.importorskip("triton", reason="the AOT compile needs the triton package")
    from k3export.ops.aot import compile_kernel

    trt, trtp, registry = fake_trt
    args = _tensors(torch.bfloat16, spec is MOE_EXPERTS_MXFP4)
    descs = [trtp.TensorDesc(tuple(t.shape), dtype(t.dtype).trt) for t in args]
    want = compile_kernel(spec.kernels[0], "bf16", ATTRS, {"E": E, "I": I, "D": D, "top_k": K})
    entry, ptx, launch, scalars = registry[spec.plugin_id]["aot_impl"](*descs, *ATTRS.values(), (), 0)
    assert entry == want.entry == f"{spec.name}_kernel" and f".entry {entry}(" in ptx and ptx == want.ptx
    assert [_v(launch.grid_x), _v(launch.grid_y), _v(launch.grid_z)] == [-(-N // want.constexprs["BN"]), 1, 1]
    assert [_v(s) for s in scalars] == [N]
    assert (launch.block_x, launch.shared_mem) == (want.block[0], want.shared)
    assert launch.shared_mem <= rules.MAX_DEFAULT_SHARED_BYTES


def test_expert_dims_must_be_static(fake_trt):
    class Dynamic:
        is_fake, is_constant = False, False

    trt, trtp, registry = fake_trt
    descs = [trtp.TensorDesc(tuple(t.shape), dtype(t.dtype).trt) for t in _tensors(torch.float32, False)]
    descs[3].shape_expr = type(descs[3].shape_expr)((Dynamic(), *descs[3].shape_expr[1:]))
    with pytest.raises(OpInputError, match="k3::moe_experts: E must be static"):
        registry["k3::moe_experts"]["aot_impl"](*descs, *ATTRS.values(), (), 0)


def test_contract_rules_as_plain_functions():
    f32, bf, i64, u8 = "float32", "bfloat16", "int64", "uint8"
    dense = [(N, D), (N, K), (N, K), (E, I, D), (E, I, D), (E, D, I)]
    assert MOE_EXPERTS.check(dense, [bf, f32, i64, bf, bf, bf], ATTRS)["top_k"] == K
    assert MOE_EXPERTS.output_shapes(dense, ATTRS) == [(N, D)]
    assert MOE_EXPERTS.output_dtypes([bf, f32, i64, bf, bf, bf]) == ["float32"]
    with pytest.raises(OpInputError, match="input 'w3'.*axis 1 is 16 but should be 32"):
        MOE_EXPERTS.check(dense[:4] + [(E, 16, D), dense[5]], [f32, f32, i64, f32, f32, f32])
    with pytest.raises(OpInputError, match="input 'w2': dtype float16, expected bfloat16 \\(same as z\\)"):
        MOE_EXPERTS.check(dense, [bf, f32, i64, bf, bf, "float16"])
    with pytest.raises(OpInputError, match="beta2: expected a finite float > 0"):
        MOE_EXPERTS.check(dense, [f32, f32, i64, f32, f32, f32], {**ATTRS, "beta2": float("inf")})
    with pytest.raises(OpInputError, match="2\\*\\*31 - 1 token-slots"):
        MOE_EXPERTS.check([(2**28, D), (2**28, 8), (2**28, 8)] + dense[3:], [f32, f32, i64, f32, f32, f32])

    mx = [(N, D), (N, K), (N, K), (E, I, D // 2), (E, I, D // 2), (E, D, I // 2), (E, I, D // 32), (E, I, D // 32),
          (E, D, I // 32)]
    mx_dtypes = [bf, f32, i64] + [u8] * 6
    MOE_EXPERTS_MXFP4.check(mx, mx_dtypes, ATTRS)
    assert MOE_EXPERTS_MXFP4.output_shapes(mx, ATTRS) == [(N, D)]
    with pytest.raises(OpInputError, match="w2 \\[E, D, I/2\\].*I = 32.*I/2 = 32"):
        MOE_EXPERTS_MXFP4.check(mx[:5] + [(E, D, I)] + mx[6:], mx_dtypes)
    with pytest.raises(OpInputError, match="multiple of 32"):
        MOE_EXPERTS_MXFP4.check([(N, 48), *mx[1:3], (E, I, 24), (E, I, 24), (E, 48, 16), (E, I, 1), (E, I, 1),
                                 (E, 48, 1)], mx_dtypes)
    with pytest.raises(OpInputError, match="input 'w1_scale': dtype float32, expected uint8 \\(E8M0\\)"):
        MOE_EXPERTS_MXFP4.check(mx, mx_dtypes[:6] + [f32] + mx_dtypes[7:])
    # TensorRT's symbolic dims pass through (only ints are compared)
    n_sym = object()
    assert MOE_EXPERTS_MXFP4.output_shapes([(n_sym, D), *mx[1:]]) == [(n_sym, D)]
    MOE_EXPERTS_MXFP4.check([(n_sym, D), (n_sym, K), (n_sym, K), *mx[3:]], mx_dtypes, ATTRS)
