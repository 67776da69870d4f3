"""The decorated aot_impl / autotune functions (against a stand-in ``tensorrt.plugin``, no GPU, no TensorRT): the
kernel the tactic selects, compiled by ``k3export.ops.aot`` (so its PTX layout is checked), its entry, grid, block,
shared memory and int32 scalars from the ops' launch rules; KDA's tactic follows ``kda_algorithm``."""

import pytest

from k3export.ops.aot import compile_kernel
from k3export.plugins import rules

pytest.importorskip("triton", reason="the AOT compile needs the triton package")

B, T, H, K = 2, 5, 4, 16


def _v(x):
    return getattr(x, "v", x)


def _result(r):
    entry, ptx, launch, scalars = r
    assert f".entry {entry}(" in ptx and ".target sm_90" in ptx
    return entry, [_v(launch.grid_x), _v(launch.grid_y), _v(launch.grid_z)], launch.block_x, launch.shared_mem, \
        [_v(s) for s in scalars]


def _kda_descs(trt, trtp, T=T, max=None):
    D, bf, f32 = trtp.TensorDesc, trt.DataType.BF16, trt.DataType.FLOAT
    q = D((B, T, H, K), bf, max)
    return q, q, q, D((B, T, H, K), f32), D((B, T, H), f32), D((B, H, K, K), f32)


def test_kda_aot_impl_per_tactic(fake_trt):
    trt, trtp, registry = fake_trt
    for tactic, kernel in ((1, "kda_recurrent"), (2, "kda_chunk")):
        want = compile_kernel(kernel, "bf16", {"scale": 0.25}, {"K": K, "V": K})
        entry, grid, block, shared, scalars = _result(
            registry["k3::kda"]["aot_impl"](*_kda_descs(trt, trtp), 0.25, (), tactic))
        assert entry == f"{kernel}_kernel" == want.entry
        assert grid == [-(-K // want.constexprs["BV"]), B * H, 1] and scalars == [T, H]
        assert (block, shared) == (want.block[0], want.shared)


def test_situ_glu_and_moe_route_aot_impl(fake_trt):
    trt, trtp, registry = fake_trt
    D, bf, f32 = trtp.TensorDesc, trt.DataType.BF16, trt.DataType.FLOAT
    g = D((3, 7, 32), bf)
    entry, grid, _, _, scalars = _result(registry["k3::situ_glu"]["aot_impl"](g, g, 4.0, 25.0, (), 0))
    assert entry == "situ_glu_kernel" and grid == [1, 1, 1] and scalars == [3 * 7 * 32]
    entry, grid, block, _, scalars = _result(
        registry["k3::moe_route"]["aot_impl"](D((9, 8), f32), D((8,), f32), 2, 1, 1.0, (), 0))
    assert entry == "moe_route_kernel" and grid == [9, 1, 1] and scalars == [] and block % 32 == 0


def test_kda_autotune_follows_the_one_rule(fake_trt):
    """One tactic per profile: recurrent when the profile's T is 1 (decode), chunked above (prefill) when the
    chunk kernel fits the default shared memory; an unknown T takes the chunk kernel too (correct for any T)."""
    trt, trtp, registry = fake_trt
    autotune = registry["k3::kda"]["autotune"]
    shared = compile_kernel("kda_chunk", "bf16", {"scale": 0.25}, {"K": K, "V": K}).shared
    chunked = [rules.kda_tactic(T, shared)]
    for descs, want in ((_kda_descs(trt, trtp, T=1), [1]), (_kda_descs(trt, trtp), chunked),
                        (_kda_descs(trt, trtp, T=-1, max=(B, 1, H, K)), [1]),
                        (_kda_descs(trt, trtp, T=-1, max=(B, 64, H, K)), chunked)):
        ((types_, layout, tactics),) = autotune(*descs, 0.25, ())
        assert (types_, layout, tactics) == (rules.autotune_types(rules.SPECS["kda"]), "LINEAR", want)


def test_static_dims_are_required(fake_trt):
    class Dynamic:
        is_fake, is_constant = False, False

    trt, trtp, registry = fake_trt
    q, k, v, g, beta, s0 = _kda_descs(trt, trtp)
    q.shape_expr = type(q.shape_expr)((q.shape_expr[0], q.shape_expr[1], Dynamic(), q.shape_expr[3]))
    with pytest.raises(rules.OpInputError, match="k3::kda: H must be static"):
        registry["k3::kda"]["aot_impl"](q, k, v, g, beta, s0, 0.25, (), 1)
