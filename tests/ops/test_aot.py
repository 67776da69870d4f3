"""AOT: every plugin-bound kernel compiles to sm_90 PTX without a GPU, with the TensorRT layout
(input pointers, int32 scalars, output pointers) and zero global / profile scratch."""

import re

import pytest

triton = pytest.importorskip("triton")

from k3export.ops.aot import AotKernel, compile_kernel, describe, list_plugin_kernels  # noqa: E402

EXPECTED = {
    "kda_recurrent": (["q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "h0_ptr"], ["T", "H"], ["o_ptr", "ht_ptr"]),
    "kda_chunk": (["q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "h0_ptr"], ["T", "H"], ["o_ptr", "ht_ptr"]),
    "situ_glu": (["gate_ptr", "up_ptr"], ["N"], ["out_ptr"]),
    "moe_route": (["logits_ptr", "bias_ptr"], [], ["weights_ptr", "indices_ptr"]),
}

# small head dims keep the chunk kernel's compile short; the production dims are marked slow
OPTIONS = {
    "kda_recurrent": dict(head_dim=128),
    "kda_chunk": dict(head_dim=64),
    "situ_glu": dict(),
    "moe_route": dict(num_experts=896, top_k=16),
}


def _ptx_params(ptx: str, entry: str) -> list[str]:
    body = ptx[ptx.index(f".entry {entry}(") :]
    body = body[: body.index(")")]
    return re.findall(r"\.param\s+\.(\w+)", body)


def test_list_plugin_kernels():
    assert sorted(list_plugin_kernels()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_compile_sm90(name):
    kern = compile_kernel(name, **OPTIONS[name])
    _check(kern, name)


@pytest.mark.slow
def test_compile_kda_chunk_production_dims():
    kern = compile_kernel("kda_chunk", head_dim=128, dtype="bf16")
    _check(kern, "kda_chunk")
    assert kern.constexprs["K"] == 128 and kern.constexprs["DOT_PRECISION"] == "tf32"


def _check(kern: AotKernel, name: str):
    ins, scalars, outs = EXPECTED[name]
    assert kern.target == ("cuda", 90, 32)
    assert kern.input_names == ins and kern.int32_scalar_names == scalars and kern.output_names == outs
    assert kern.param_names == ins + scalars + outs
    assert kern.global_scratch_size == 0 and kern.profile_scratch_size == 0
    assert ".target sm_90" in kern.ptx
    assert f".entry {kern.kernel_name}(" in kern.ptx
    kinds = _ptx_params(kern.ptx, kern.kernel_name)
    n = len(ins) + len(scalars) + len(outs)
    # Triton appends two hidden scratch pointers; with zero scratch TensorRT may leave them unset
    assert len(kinds) == n + 2 == kern.ptx_param_count
    expected_kinds = ["u64"] * len(ins) + ["u32"] * len(scalars) + ["u64"] * len(outs) + ["u64", "u64"]
    assert kinds == expected_kinds
    assert kern.num_warps in (1, 2, 4, 8, 16) and kern.block == (32 * kern.num_warps, 1, 1)
    assert kern.shared_mem >= 0
    assert kern.name in describe(kern)


def test_grid_rules():
    assert compile_kernel("situ_glu").grid(N=5000) == (5, 1, 1)
    k = compile_kernel("moe_route", num_experts=64, top_k=4)
    assert k.grid(N=17) == (17, 1, 1)
    r = compile_kernel("kda_recurrent", head_dim=64)
    assert r.grid(B=2, T=1, H=3) == (-(-64 // r.constexprs["BV"]), 6, 1)


def test_attributes_are_baked():
    k = compile_kernel("moe_route", num_experts=100, top_k=3, renormalize=False, route_scale=2.5)
    assert k.constexprs["E"] == 100 and k.constexprs["TOP_K"] == 3
    assert k.constexprs["RENORMALIZE"] is False and k.constexprs["SCALE"] == 2.5
    s = compile_kernel("situ_glu", beta1=3.0, beta2=7.0, dtype="fp32")
    assert s.constexprs["BETA1"] == 3.0 and s.params[0].dtype == "*fp32"


def test_bad_requests():
    with pytest.raises(ValueError, match="unknown plugin kernel"):
        compile_kernel("nope")
    with pytest.raises(ValueError, match="top_k"):
        compile_kernel("moe_route", num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="dtype"):
        compile_kernel("situ_glu", dtype="int8")
