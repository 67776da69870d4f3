"""The op specs against the torch ops' real outputs on the tiny model's dims, the plugins' decorated functions
against the spec (no TensorRT), and the ONNX functions' signatures against the spec."""

import inspect

import pytest
import torch

from k3export.dtypes import dtype
from k3export.ops.spec import ALL_SPECS, KDA, MOE_ROUTE, SITU_GLU, SPECS, OpInputError, op_spec
from k3export.plugins import rules

from conftest import PLUGIN_MODULES

DTYPES = [torch.float32, torch.bfloat16]


def _ops():
    import k3export.ops.registry  # noqa: F401  registers torch.ops.k3.*

    return torch.ops.k3


def _kda_inputs(cfg, dtype, B=2, T=5):
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, H, K, generator=g).to(dtype)
    gl = -torch.rand(B, T, H, K, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.zeros(B, H, K, K)
    return q, k, v, gl, beta, s0


def _names(tensors):
    return [dtype(t.dtype).name for t in tensors]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 70])
def test_kda_spec_matches_torch_op(tiny, dt, T):
    args = _kda_inputs(tiny, dt, T=T)
    o, s = _ops().kda(*args, tiny.kda_head_dim ** -0.5)
    shapes = [tuple(a.shape) for a in args]
    KDA.check(shapes, [a.dtype for a in args])
    assert KDA.output_shapes(shapes) == [tuple(o.shape), tuple(s.shape)]
    assert KDA.output_dtypes([a.dtype for a in args]) == _names([o, s])
    # the modeling reference agrees too
    from k3export.modeling.modeling_k3 import kda_chunked

    o2, s2 = kda_chunked(*args, tiny.kda_head_dim ** -0.5)
    assert (tuple(o2.shape), o2.dtype) == (tuple(o.shape), o.dtype)


@pytest.mark.parametrize("dt", DTYPES)
def test_situ_glu_spec_matches_torch_op(tiny, dt):
    gate = torch.randn(3, 7, tiny.moe_intermediate_size).to(dt)
    up = torch.randn_like(gate)
    out = _ops().situ_glu(gate, up, tiny.activation_situ_beta, tiny.activation_situ_linear_beta)
    SITU_GLU.check([gate.shape, up.shape], [gate.dtype, up.dtype])
    assert SITU_GLU.output_shapes([tuple(gate.shape), tuple(up.shape)]) == [tuple(out.shape)]
    assert SITU_GLU.output_dtypes([gate.dtype, up.dtype]) == _names([out])


def test_moe_route_spec_matches_torch_op(tiny):
    E, k = tiny.num_experts, tiny.num_experts_per_token
    logits, bias = torch.randn(9, E), torch.randn(E)
    w, idx = _ops().moe_route(logits, bias, k, True, 1.0)
    attrs = {"top_k": k, "renormalize": 1, "scale": 1.0}
    MOE_ROUTE.check([logits.shape, bias.shape], [logits.dtype, bias.dtype], attrs)
    assert MOE_ROUTE.output_shapes([tuple(logits.shape), tuple(bias.shape)], attrs) == [tuple(w.shape), tuple(idx.shape)]
    assert MOE_ROUTE.output_dtypes([logits.dtype, bias.dtype]) == _names([w, idx]) == ["float32", "int64"]


@pytest.mark.parametrize("dt", DTYPES)
def test_registered_desc_functions_agree_with_torch_ops(fake_trt, tiny, dt):
    """The functions given to @trtp.register, run on descriptors of the tiny shapes, give the torch ops'
    output shapes and dtypes."""
    trt, trtp, registry = fake_trt

    def desc(t):
        return trtp.TensorDesc(tuple(t.shape), dtype(t.dtype).trt)

    args = _kda_inputs(tiny, dt, T=3)
    o, s = _ops().kda(*args, 0.25)
    descs = registry["k3::kda"]["register"](*map(desc, args), 0.25)
    assert [d.shape for d in descs] == [tuple(o.shape), tuple(s.shape)]
    assert [dtype(d.dtype).name for d in descs] == _names([o, s])

    gate = torch.randn(2, 3, tiny.moe_intermediate_size).to(dt)
    out = _ops().situ_glu(gate, gate, 4.0, 25.0)
    (d,) = registry["k3::situ_glu"]["register"](desc(gate), desc(gate), 4.0, 25.0)
    assert (d.shape, dtype(d.dtype).name) == (tuple(out.shape), dtype(out.dtype).name)

    logits, bias = torch.randn(6, tiny.num_experts), torch.zeros(tiny.num_experts)
    w, idx = _ops().moe_route(logits, bias, tiny.num_experts_per_token, True, 1.0)
    dw, di = registry["k3::moe_route"]["register"](desc(logits), desc(bias), tiny.num_experts_per_token, 1, 1.0)
    assert (dw.shape, di.shape) == (tuple(w.shape), tuple(idx.shape))
    assert (dtype(dw.dtype).name, dtype(di.dtype).name) == ("float32", "int64")
    with pytest.raises(OpInputError, match="input 'g': dtype bfloat16"):  # the spec's checks run there too
        registry["k3::kda"]["register"](*map(desc, args[:3]), desc(args[3].bfloat16()), *map(desc, args[4:]), 0.25)


def test_decorated_signatures_follow_the_spec_and_the_tensorrt_plugin_schema(fake_trt):
    """Inputs, then attributes in registration order with their types, as the spec says; aot_impl ends with
    (outputs, tactic), impl with (outputs, stream[, tactic]), autotune with (outputs)."""
    _, trtp, registry = fake_trt
    assert {m.SPEC.name for m in PLUGIN_MODULES} == {s.name for s in ALL_SPECS.values() if s.kernels}
    for spec in (m.SPEC for m in PLUGIN_MODULES):
        fns = registry[spec.plugin_id]
        assert set(fns) == {"register", "autotune", "aot_impl", "impl"}
        reg = inspect.signature(fns["register"]).parameters
        assert list(reg)[: len(spec.inputs)] == list(spec.input_names)
        attrs = [(n, p.annotation) for n, p in reg.items()][len(spec.inputs):]
        assert attrs == list(spec.attributes), spec.name
        base = list(spec.input_names) + list(spec.attribute_names)
        assert list(inspect.signature(fns["aot_impl"]).parameters) == base + ["outputs", "tactic"]
        assert list(inspect.signature(fns["autotune"]).parameters) == base + ["outputs"]
        impl = list(inspect.signature(fns["impl"]).parameters)
        assert impl[: len(base) + 2] == base + ["outputs", "stream"]
        assert inspect.signature(fns["aot_impl"]).return_annotation.__args__[:2] == (str, str)


def test_autotune_types_from_the_spec():
    """Written out by hand: a floating tensor and those typed like it share the dependent FP32|BF16|FP16 entry."""
    f = "FP32|BF16|FP16"
    assert rules.autotune_types(KDA) == ", ".join([f, f, f, "FP32", "FP32", "FP32", f, "FP32"])
    assert rules.autotune_types(SITU_GLU) == ", ".join([f, f, f])
    assert rules.autotune_types(MOE_ROUTE) == "FP32, FP32, FP32, INT64"


def test_kda_tactics_and_kernel_choice():
    assert rules.kda_tactic(1, None) == rules.kda_tactic(1, 1024) == rules.KDA_TACTICS["recurrent"]
    assert rules.kda_tactic(64, 1024) == rules.kda_tactic(-1, 1024) == rules.KDA_TACTICS["chunk"]
    assert rules.kda_tactic(64, None) == rules.kda_tactic(64, rules.MAX_DEFAULT_SHARED_BYTES + 1) == 1
    assert [rules.kda_kernel(t) for t in (0, 1, 2)] == ["kda_recurrent", "kda_recurrent", "kda_chunk"]
    with pytest.raises(OpInputError, match="unknown tactic 7"):
        rules.kda_kernel(7)


def test_onnx_functions_are_signed_by_the_spec(tiny):
    from k3export.converters.onnx.functions import DOMAIN, OPS, all_functions

    assert OPS == tuple(SPECS) and DOMAIN == rules.PLUGIN_NAMESPACE
    for fn in all_functions(tiny, 27):
        spec = SPECS[fn.name]
        assert (tuple(fn.input), tuple(fn.output), tuple(fn.attribute)) == (
            spec.input_names, spec.output_names, spec.attribute_names), fn.name
        assert set(spec.input_names) <= _names_read(fn.node), fn.name  # the body reads the spec's names


def _names_read(nodes) -> set[str]:
    """Every value name the nodes read, inside Loop / If subgraphs too."""
    out = set()
    for node in nodes:
        out |= set(node.input)
        for a in node.attribute:
            out |= _names_read(a.g.node) if a.HasField("g") else set()
    return out


@pytest.mark.parametrize(
    "shapes,dtypes,match",
    [
        ([(2, 5, 4, 16), (2, 5, 4, 16), (2, 5, 4, 16), (2, 5, 4, 16), (2, 5, 4), (2, 4, 16, 8)],
         ["bfloat16"] * 3 + ["float32"] * 3, "initial_state.*axis 3 is 8 but should be 16"),
        ([(2, 5, 4, 16), (2, 6, 4, 16), (2, 5, 4, 16), (2, 5, 4, 16), (2, 5, 4), (2, 4, 16, 16)],
         ["bfloat16"] * 3 + ["float32"] * 3, "input 'k'.*axis 1 is 6"),
        ([(2, 5, 4, 16)] * 4 + [(2, 5, 4), (2, 4, 16, 16)],
         ["bfloat16", "bfloat16", "bfloat16", "bfloat16", "float32", "float32"], "input 'g'.*dtype bfloat16"),
        ([(2, 5, 4, 16)] * 3 + [(2, 5, 4, 16), (2, 5, 4), (2, 4, 16, 16)],
         ["bfloat16", "float16", "bfloat16", "float32", "float32", "float32"], "input 'k'.*same as q"),
        ([(2, 5, 4, 16)] * 4 + [(2, 5), (2, 4, 16, 16)], ["float32"] * 6, "input 'beta'.*rank 3"),
        ([(2, 5, 4, 300)] * 4 + [(2, 5, 4), (2, 4, 300, 300)], ["float32"] * 6, "K=300, V=300"),
    ],
)
def test_kda_bad_inputs_name_the_tensor(shapes, dtypes, match):
    with pytest.raises(OpInputError, match=match):
        KDA.check(shapes, dtypes)


def test_other_bad_inputs():
    with pytest.raises(OpInputError, match="'up'.*axis 1 is 5"):
        SITU_GLU.check([(2, 4), (2, 5)], ["bfloat16", "bfloat16"])
    with pytest.raises(OpInputError, match="'up'.*rank 3 differs"):
        SITU_GLU.check([(2, 4), (2, 4, 1)], ["bfloat16", "bfloat16"])
    with pytest.raises(OpInputError, match="logits.*float32"):
        MOE_ROUTE.check([(3, 8), (8,)], ["bfloat16", "float32"], {"top_k": 2})
    with pytest.raises(OpInputError, match="top_k=9"):
        MOE_ROUTE.check([(3, 8), (8,)], ["float32", "float32"], {"top_k": 9})
    with pytest.raises(OpInputError, match="unknown k3 op 'rope'"):
        op_spec("rope")
    with pytest.raises(OpInputError, match="unsupported dtype"):
        SITU_GLU.check([(2,), (2,)], ["complex128", "complex128"])


def test_symbolic_dims_pass_through():
    """The spec only rearranges dims, so TensorRT's symbolic dims flow through (compared only when ints)."""
    B, T = object(), object()
    o, s = KDA.output_shapes([(B, T, 4, 16), (B, T, 4, 16), (B, T, 4, 8)])
    assert o == (B, T, 4, 8) and s == (B, 4, 16, 8)
    KDA.check([(B, T, 4, 16)] * 4 + [(B, T, 4), (B, 4, 16, 16)], ["float16"] * 3 + ["float32"] * 3)
