"""Plugin shape/dtype rules against the torch ops' real outputs on the tiny model's dims (no TensorRT)."""

import inspect

import pytest
import torch

from k3export.plugins import rules

DTYPES = [torch.float32, torch.bfloat16]


def _ops():
    import k3export.ops  # noqa: F401  registers torch.ops.k3.*

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 70])
def test_kda_rules_match_torch_op(tiny, dtype, T):
    args = _kda_inputs(tiny, dtype, T=T)
    o, s = _ops().kda(*args, tiny.kda_head_dim ** -0.5)
    shapes = [tuple(a.shape) for a in args]
    rules.kda_check(shapes, [a.dtype for a in args])
    (o_shape, s_shape) = rules.output_shapes("kda", shapes)
    assert (o_shape, s_shape) == (tuple(o.shape), tuple(s.shape))
    assert rules.output_dtypes("kda", [a.dtype for a in args]) == [rules.dtype_name(o.dtype), rules.dtype_name(s.dtype)]
    # the modeling reference agrees too
    from k3export.modeling.modeling_k3 import kda_chunked

    o2, s2 = kda_chunked(*args, tiny.kda_head_dim ** -0.5)
    assert (tuple(o2.shape), o2.dtype) == (tuple(o.shape), o.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_situ_glu_rules_match_torch_op(tiny, dtype):
    gate = torch.randn(3, 7, tiny.moe_intermediate_size).to(dtype)
    up = torch.randn_like(gate)
    out = _ops().situ_glu(gate, up, tiny.activation_situ_beta, tiny.activation_situ_linear_beta)
    rules.situ_glu_check([gate.shape, up.shape], [gate.dtype, up.dtype])
    assert rules.output_shapes("situ_glu", [tuple(gate.shape), tuple(up.shape)]) == [tuple(out.shape)]
    assert rules.output_dtypes("situ_glu", [gate.dtype, up.dtype]) == [rules.dtype_name(out.dtype)]


def test_moe_route_rules_match_torch_op(tiny):
    E, k = tiny.num_experts, tiny.num_experts_per_token
    logits = torch.randn(9, E)
    bias = torch.randn(E)
    w, idx = _ops().moe_route(logits, bias, k, True, 1.0)
    rules.moe_route_check([logits.shape, bias.shape], [logits.dtype, bias.dtype], k)
    attrs = {"top_k": k, "renormalize": 1, "scale": 1.0}
    assert rules.output_shapes("moe_route", [tuple(logits.shape), tuple(bias.shape)], attrs) == [tuple(w.shape), tuple(idx.shape)]
    assert rules.output_dtypes("moe_route", [logits.dtype, bias.dtype]) == [rules.dtype_name(w.dtype), rules.dtype_name(idx.dtype)]
    assert (rules.dtype_name(w.dtype), rules.dtype_name(idx.dtype)) == ("float32", "int64")


@pytest.mark.parametrize("dtype", DTYPES)
def test_registered_desc_functions_agree_with_torch_ops(fake_trt, tiny, dtype):
    """The functions given to @trtp.register, run on descriptors of the tiny shapes, give the torch ops'
    output shapes and dtypes."""
    trt, trtp, registry = fake_trt
    from k3export.plugins._torch_bridge import name_to_trt, trt_to_name

    def _desc(t, name_to_trt):
        return trtp.TensorDesc(tuple(t.shape), name_to_trt(rules.dtype_name(t.dtype)))

    args = _kda_inputs(tiny, dtype, T=3)
    o, s = _ops().kda(*args, 0.25)
    descs = [registry["k3::kda"]["register"](*[_desc(a, name_to_trt) for a in args], 0.25)][0]
    assert [d.shape for d in descs] == [tuple(o.shape), tuple(s.shape)]
    assert [trt_to_name(d.dtype) for d in descs] == [rules.dtype_name(o.dtype), rules.dtype_name(s.dtype)]

    gate = torch.randn(2, 3, tiny.moe_intermediate_size).to(dtype)
    out = _ops().situ_glu(gate, gate, 4.0, 25.0)
    (d,) = registry["k3::situ_glu"]["register"](_desc(gate, name_to_trt), _desc(gate, name_to_trt), 4.0, 25.0)
    assert (d.shape, trt_to_name(d.dtype)) == (tuple(out.shape), rules.dtype_name(out.dtype))

    logits, bias = torch.randn(6, tiny.num_experts), torch.zeros(tiny.num_experts)
    w, idx = _ops().moe_route(logits, bias, tiny.num_experts_per_token, True, 1.0)
    dw, di = registry["k3::moe_route"]["register"](_desc(logits, name_to_trt), _desc(bias, name_to_trt),
                                                   tiny.num_experts_per_token, 1, 1.0)
    assert (dw.shape, di.shape) == (tuple(w.shape), tuple(idx.shape))
    assert (trt_to_name(dw.dtype), trt_to_name(di.dtype)) == ("float32", "int64")


def test_decorated_signatures_follow_the_tensorrt_plugin_schema(fake_trt):
    """Inputs, then attributes in registration order with their registered types; aot_impl ends with
    (outputs, tactic), impl with (outputs, stream[, tactic]), autotune with (outputs)."""
    _, trtp, registry = fake_trt
    for op, spec in rules.PLUGINS.items():
        fns = registry[spec.plugin_id]
        assert set(fns) == {"register", "autotune", "aot_impl", "impl"}
        reg = inspect.signature(fns["register"]).parameters
        assert list(reg)[: len(spec.inputs)] == list(spec.inputs)
        attrs = [(n, p.annotation) for n, p in reg.items()][len(spec.inputs):]
        assert attrs == list(spec.attributes), op
        base = list(spec.inputs) + [n for n, _ in spec.attributes]
        assert list(inspect.signature(fns["aot_impl"]).parameters) == base + ["outputs", "tactic"]
        assert list(inspect.signature(fns["autotune"]).parameters) == base + ["outputs"]
        impl = list(inspect.signature(fns["impl"]).parameters)
        assert impl[: len(base) + 2] == base + ["outputs", "stream"]
        assert inspect.signature(fns["aot_impl"]).return_annotation.__args__[:2] == (str, str)


def test_autotune_combinations_cover_every_io(fake_trt):
    _, trtp, registry = fake_trt
    FakeDesc = trtp.TensorDesc

    for op, spec in rules.PLUGINS.items():
        types_ = [t.strip() for t in rules.AUTOTUNE_TYPES[op].split(",")]
        assert len(types_) == len(spec.inputs) + len(spec.outputs), op
        lengths = {len(t.split("|")) for t in types_ if "|" in t}
        assert len(lengths) <= 1, f"{op}: dependent '|' lists must have equal lengths"
    q = FakeDesc((1, 4, 4, 16), "DT.BF16")
    v = FakeDesc((1, 4, 4, 16), "DT.BF16")
    f = FakeDesc((1, 4, 4, 16), "DT.FLOAT")
    ((types_, layout, tactics),) = registry["k3::kda"]["autotune"](q, q, v, f, FakeDesc((1, 4, 4), "DT.FLOAT"),
                                                                   FakeDesc((1, 4, 16, 16), "DT.FLOAT"), 0.25, ())
    assert layout == "LINEAR" and tactics[0] == rules.KDA_TACTIC_RECURRENT


def test_kda_tactics_and_kernel_choice():
    assert rules.kda_tactics(None) == [rules.KDA_TACTIC_RECURRENT]
    assert rules.kda_tactics(1024) == [rules.KDA_TACTIC_RECURRENT, rules.KDA_TACTIC_CHUNKED]
    assert rules.kda_tactics(rules.MAX_DEFAULT_SHARED_BYTES + 1) == [rules.KDA_TACTIC_RECURRENT]
    assert rules.kda_kernel_for_tactic(0) == "kda_recurrent"
    assert rules.kda_kernel_for_tactic(2) == "kda_chunk"
    with pytest.raises(rules.PluginInputError, match="unknown tactic 7"):
        rules.kda_kernel_for_tactic(7)


def test_launch_rules():
    plan = rules.kda_launch(3, 11, 4, 100, 32)
    assert plan == {"grid": (4, 12, 1), "scalars": (11, 4)}
    with pytest.raises(rules.PluginInputError, match="V must be a build-time constant"):
        rules.kda_launch(3, 11, 4, object(), 32)
    assert rules.situ_glu_launch(1025, 1024, None) == {"grid": (2, 1, 1), "scalars": (1025,)}
    assert rules.moe_route_launch(7) == {"grid": (7, 1, 1), "scalars": ()}


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
    ],
)
def test_kda_bad_inputs_name_the_tensor(shapes, dtypes, match):
    with pytest.raises(rules.PluginInputError, match=match):
        rules.kda_check(shapes, dtypes)


def test_other_bad_inputs():
    with pytest.raises(rules.PluginInputError, match="'up'.*axis 1 is 5"):
        rules.situ_glu_check([(2, 4), (2, 5)], ["bfloat16", "bfloat16"])
    with pytest.raises(rules.PluginInputError, match="logits.*fp32|logits.*float32"):
        rules.moe_route_check([(3, 8), (8,)], ["bfloat16", "float32"], 2)
    with pytest.raises(rules.PluginInputError, match="top_k=9"):
        rules.moe_route_check([(3, 8), (8,)], ["float32", "float32"], 9)
    with pytest.raises(rules.PluginInputError, match="unknown k3 op 'rope'"):
        rules.spec("rope")
    with pytest.raises(rules.PluginInputError, match="unsupported dtype"):
        rules.dtype_name("complex128")


def test_symbolic_dims_pass_through():
    """Rules only rearrange dims, so TensorRT's symbolic dims flow through (checked only when ints)."""
    B, T = object(), object()
    o, s = rules.kda_output_shapes((B, T, 4, 16), (B, T, 4, 8))
    assert o == (B, T, 4, 8) and s == (B, 4, 16, 8)
    rules.kda_check([(B, T, 4, 16)] * 4 + [(B, T, 4), (B, 4, 16, 16)], ["float16"] * 3 + ["float32"] * 3)
