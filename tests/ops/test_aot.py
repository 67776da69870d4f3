"""AOT: every plugin kernel compiles to sm_90 PTX without a GPU, with the launch layout its op spec gives
(input pointers, int32 scalars, output pointers, in the spec's order and dtypes), read back from the PTX
``.entry``, and zero global / profile scratch."""

import dataclasses
import re
import types

import pytest

triton = pytest.importorskip("triton")

import sys  # noqa: E402

import k3export.ops.registry  # noqa: E402,F401

# the op modules (the package's attributes of the same names are the op functions)
kda, situ_glu, moe_route = (sys.modules[f"k3export.ops.{op}"] for op in ("kda", "situ_glu", "moe_route"))
from k3export.ops.aot import KERNEL_OPS, SM90, Kernel, KernelError, check_layout, compile_kernel, ptx_params  # noqa: E402
from k3export.ops.spec import ALL_SPECS, OpInputError  # noqa: E402

KDA_PARAMS = [("q", "*bf16"), ("k", "*bf16"), ("v", "*bf16"), ("g", "*fp32"), ("beta", "*fp32"),
              ("initial_state", "*fp32"), ("T", "i32"), ("H", "i32"), ("o", "*bf16"), ("final_state", "*fp32")]
EXPECTED = {  # written out by hand: the spec must say exactly this
    "kda_recurrent": KDA_PARAMS,
    "kda_chunk": KDA_PARAMS,
    "situ_glu": [("gate", "*bf16"), ("up", "*bf16"), ("numel", "i32"), ("out", "*bf16")],
    "moe_route": [("logits", "*fp32"), ("bias", "*fp32"), ("weights", "*fp32"), ("indices", "*i64")],
    "moe_experts": [("z", "*bf16"), ("weights", "*fp32"), ("indices", "*i64"), ("w1", "*bf16"), ("w3", "*bf16"),
                    ("w2", "*bf16"), ("N", "i32"), ("u", "*fp32")],
    "moe_experts_mxfp4": [("z", "*bf16"), ("weights", "*fp32"), ("indices", "*i64"), ("w1", "*u8"), ("w3", "*u8"),
                          ("w2", "*u8"), ("w1_scale", "*u8"), ("w3_scale", "*u8"), ("w2_scale", "*u8"), ("N", "i32"),
                          ("u", "*fp32")],
    # the E4M3 scales as their bytes (the kernel decodes the bit fields)
    "moe_experts_nvfp4": [("z", "*bf16"), ("weights", "*fp32"), ("indices", "*i64"), ("w1", "*u8"), ("w3", "*u8"),
                          ("w2", "*u8"), ("w1_scale", "*u8"), ("w3_scale", "*u8"), ("w2_scale", "*u8"),
                          ("w1_scale_2", "*fp32"), ("w3_scale_2", "*fp32"), ("w2_scale_2", "*fp32"), ("N", "i32"),
                          ("u", "*fp32")],
}
# small head dims keep the chunk kernel's compile short; the production dims are marked slow
ARGS = {
    "kda_recurrent": ({"scale": 0.125}, {"K": 128, "V": 128}),
    "kda_chunk": ({"scale": 0.125}, {"K": 64, "V": 64}),
    "situ_glu": ({"beta1": 4.0, "beta2": 25.0}, {}),
    "moe_route": ({"top_k": 16, "renormalize": 1, "scale": 1.0}, {"E": 896}),
    "moe_experts": ({"act": "situ", "beta1": 4.0, "beta2": 25.0}, {"E": 896, "I": 3072, "D": 3584, "top_k": 16}),
    "moe_experts_mxfp4": ({"act": "situ", "beta1": 4.0, "beta2": 25.0}, {"E": 896, "I": 3072, "D": 3584, "top_k": 16}),
    "moe_experts_nvfp4": ({"act": "situ", "beta1": 4.0, "beta2": 25.0}, {"E": 896, "I": 3072, "D": 3584, "top_k": 16}),
}


def test_every_plugin_kernel_is_listed():
    assert KERNEL_OPS == {"kda_recurrent": "kda", "kda_chunk": "kda", "situ_glu": "situ_glu", "moe_route": "moe_route",
                          "moe_experts": "moe_experts", "moe_experts_mxfp4": "moe_experts_mxfp4",
                          "moe_experts_nvfp4": "moe_experts_nvfp4"}
    assert set(EXPECTED) == set(KERNEL_OPS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_compile_sm90(name):
    _check(compile_kernel(name, "bf16", *ARGS[name]), name)


@pytest.mark.parametrize("cc", [86, 90])
def test_compile_nvfp4_for_ampere_and_hopper(cc):
    """The NVFP4 plugin kernel compiles to PTX for each target a build names (sm_86: TensorRT-RTX's consumer GPUs;
    sm_90: the datacenter ones), at K3's dims."""
    kern = compile_kernel("moe_experts_nvfp4", "bf16", *ARGS["moe_experts_nvfp4"], target=("cuda", cc, 32))
    assert f".target sm_{cc}" in kern.ptx and list(kern.params) == EXPECTED["moe_experts_nvfp4"]
    assert kern.shared <= 48 * 1024


@pytest.mark.slow
def test_compile_kda_chunk_production_dims():
    kern = compile_kernel("kda_chunk", "bf16", {"scale": 128 ** -0.5}, {"K": 128, "V": 128})
    _check(kern, "kda_chunk")
    assert kern.constexprs["K"] == 128 and kern.constexprs["DOT_PRECISION"] == "tf32"


def _check(kern: Kernel, name: str):
    spec = ALL_SPECS[KERNEL_OPS[name]]
    assert list(kern.params) == EXPECTED[name]
    assert (kern.n_inputs, kern.n_scalars, kern.n_outputs) == (len(spec.inputs), len(spec.scalars), len(spec.outputs))
    assert kern.target == SM90 and ".target sm_90" in kern.ptx and f".entry {kern.entry}(" in kern.ptx
    assert (kern.global_scratch, kern.profile_scratch) == (0, 0)
    # read independently of ptx_params: pointers are u64, int32 scalars u32, then Triton's two hidden pointers
    body = kern.ptx[kern.ptx.index(f".entry {kern.entry}("):]
    kinds = re.findall(r"\.param\s+\.(\w+)", body[: body.index(")")])
    assert kinds == ["u32" if t == "i32" else "u64" for _, t in EXPECTED[name]] + ["u64", "u64"]
    assert kern.num_warps in (1, 2, 4, 8, 16) and kern.block == (32 * kern.num_warps, 1, 1)


def test_launch_rules():
    const, _ = kda.config("recurrent", 64, 100, "bfloat16")
    assert kda.launch(3, 11, 4, 100, const["BV"]) == ((-(-100 // const["BV"]), 12, 1), (11, 4))
    assert situ_glu.launch(5000) == ((5, 1, 1), (5000,))
    assert moe_route.launch(17) == ((17, 1, 1), ())


def test_attributes_and_dtypes_are_baked():
    k = compile_kernel("moe_route", "fp32", {"top_k": 3, "renormalize": 0, "scale": 2.5}, {"E": 100})
    assert k.constexprs["E"] == 100 and k.constexprs["TOP_K"] == 3
    assert k.constexprs["RENORMALIZE"] is False and k.constexprs["SCALE"] == 2.5
    s = compile_kernel("situ_glu", "fp32", {"beta1": 3.0, "beta2": 7.0})
    assert s.constexprs["BETA1"] == 3.0 and s.params[0] == ("gate", "*fp32")
    a = compile_kernel("kda_recurrent", "fp32", {"scale": 0.25}, {"K": 16, "V": 16})
    b = compile_kernel("kda_recurrent", "fp32", {"scale": 0.5}, {"K": 16, "V": 16})
    assert a.ptx != b.ptx  # one compile per attribute value


def test_layout_check_rejects_wrong_order_and_scratch():
    k = compile_kernel("situ_glu", "bf16", *ARGS["situ_glu"])
    with pytest.raises(KernelError, match="TensorRT passes 2 input pointers, 2 int32 scalars"):
        check_layout(dataclasses.replace(k, n_scalars=2, n_outputs=0))
    with pytest.raises(KernelError, match="scratch"):
        check_layout(dataclasses.replace(k, global_scratch=256))
    with pytest.raises(KernelError, match="no .entry"):
        ptx_params("// empty", "nothing")
    assert ptx_params(k.ptx, k.entry)[:4] == [".u64 .ptr", ".u64 .ptr", ".u32", ".u64 .ptr"]


def test_kernel_arguments_must_follow_the_spec(monkeypatch):
    """A kernel whose runtime arguments are not the spec's launch layout is refused before compiling."""
    fake = types.SimpleNamespace(arg_names=["up_ptr", "gate_ptr", "numel", "out_ptr", "BETA1", "BETA2", "BLOCK"])
    monkeypatch.setattr(situ_glu, "aot_config", lambda *a: (fake, {"BETA1": 4.0, "BETA2": 25.0, "BLOCK": 1024}, 4))
    with pytest.raises(KernelError, match="not the launch layout of k3::situ_glu"):
        compile_kernel("situ_glu", "bf16", *ARGS["situ_glu"])


def test_bad_requests():
    with pytest.raises(KernelError, match="unknown plugin kernel"):
        compile_kernel("nope")
    with pytest.raises(OpInputError, match="top_k"):
        compile_kernel("moe_route", "fp32", {"top_k": 9, "renormalize": 1, "scale": 1.0}, {"E": 8})
    with pytest.raises(KernelError, match="dtype"):
        compile_kernel("situ_glu", "int8", *ARGS["situ_glu"])
