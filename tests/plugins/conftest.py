"""Shared fixtures of the plugin / TensorRT tests: the tiny config, a hand-built k3 ONNX model, and a
fake ``tensorrt`` + ``tensorrt.plugin`` pair that records what the plugin modules register."""

import sys
import types

import numpy as np
import pytest
from onnx import TensorProto, helper

from k3export.modeling import K3Config
from k3export.plugins import kda, moe_experts, moe_experts_mxfp4, moe_experts_nvfp4, moe_route, situ_glu

PLUGIN_MODULES = (kda, situ_glu, moe_route, moe_experts, moe_experts_mxfp4, moe_experts_nvfp4)


@pytest.fixture(scope="session")
def tiny():
    return K3Config.tiny()


def k3_node(op, inputs, outputs, name=None, **attrs):
    return helper.make_node(op, inputs, outputs, name=name or f"n_{op}", domain="k3", plugin_namespace="k3", **attrs)


def hand_model(nodes, dtype=TensorProto.BFLOAT16, extra_inputs=()):
    """input_ids [batch, seq] + KDA/MLA-like state inputs, the given nodes, one bf16 weight."""
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("past_key_values.0.conv_state_q", dtype, ["batch", 64, 3]),
        helper.make_tensor_value_info("past_key_values.0.recurrent_state", TensorProto.FLOAT, ["batch", 4, 16, 16]),
        helper.make_tensor_value_info("past_key_values.1.latent", dtype, ["batch", "past_len", 40]),
        *extra_inputs,
    ]
    w = helper.make_tensor("w", dtype, [4, 4], np.zeros(16, dtype=np.uint16).tolist() if dtype == TensorProto.BFLOAT16
                           else np.zeros(16, dtype=np.float32).tolist())
    outputs = [helper.make_tensor_value_info(n.output[0], dtype, None) for n in nodes[-1:]] or [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("k3", 1)])


def contract_nodes():
    """One node per plugin, exactly as the contract says."""
    return [
        k3_node("kda", ["q", "k", "v", "g", "beta", "s0"], ["o", "s1"], scale=0.25),
        k3_node("situ_glu", ["gate", "up"], ["act"], beta1=4.0, beta2=25.0),
        k3_node("moe_route", ["logits", "bias"], ["weights", "indices"], top_k=2, renormalize=1, scale=1.0),
    ]


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """The tiny model exported to ONNX in bf16 (the graph the TensorRT parser would read)."""
    import torch

    from k3export import K3ForCausalLM
    from k3export.converters.onnx import export_onnx

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("export") / "tiny"
    export_onnx(K3ForCausalLM(K3Config.tiny()).eval(), out, dtype="bf16")
    return out


# ------------------------------------------------------------------------------------ fake tensorrt
class Dim:
    """A static dim as tensorrt.plugin's ShapeExpr shows it inside aot_impl (constant, not fake)."""

    is_fake = False
    is_constant = True

    def __init__(self, v):
        self.v = int(v)

    def constant_value(self):
        return self.v

    def __mul__(self, o):
        return Dim(self.v * (o.v if isinstance(o, Dim) else o))

    def __add__(self, o):
        return Dim(self.v + (o.v if isinstance(o, Dim) else o))

    def __eq__(self, o):
        return self.v == (o.v if isinstance(o, Dim) else o)

    def __hash__(self):
        return hash(self.v)

    def __repr__(self):
        return f"Dim({self.v})"


class ShapeExprs(tuple):
    def numel(self):
        out = Dim(1)
        for d in self:
            out = out * d
        return out


class FakeShape(tuple):
    """tensorrt.plugin.Shape as autotune sees it: -1 for a dynamic dim, with the tuned profile's bounds."""

    def __new__(cls, dims, max=None):
        self = super().__new__(cls, dims)
        self.max = tuple(max) if max is not None else None
        return self


class FakeDesc:
    def __init__(self, shape, dtype, max=None):
        self.shape_expr = ShapeExprs(Dim(d) if not isinstance(d, Dim) else d for d in shape)
        self.shape = FakeShape(tuple(int(d.v) for d in self.shape_expr), max)
        self.dtype = dtype


class _Exprs(list):
    def __init__(self, n):
        super().__init__([None] * n)


class FakeLaunch:
    def __init__(self):
        self.grid_x = self.grid_y = self.grid_z = self.block_x = 1
        self.shared_mem = 0


def make_fake_tensorrt():
    """(trt, trtp, registry) where registry[plugin_id][kind] is the decorated function."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "fake"
    types_ = ("FLOAT", "HALF", "BF16", "INT32", "INT64", "UINT8")
    trt.DataType = types.SimpleNamespace(**{n: f"DataType.{n}" for n in types_})
    trtp = types.ModuleType("tensorrt.plugin")
    registry = {}

    def deco(kind):
        def outer(plugin_id):
            def inner(fn):
                registry.setdefault(plugin_id, {})[kind] = fn
                return fn
            return inner
        return outer

    for kind in ("register", "autotune", "aot_impl", "impl"):
        setattr(trtp, kind, deco(kind))
    trtp.TensorDesc = FakeDesc
    trtp.Tensor = type("Tensor", (), {})
    trtp.KernelLaunchParams = FakeLaunch
    trtp.SymIntExprs = _Exprs
    trtp.SymInt32 = lambda v: v
    trtp.cdiv = lambda a, b: Dim(-(-(a.v if isinstance(a, Dim) else a) // b))
    trtp.from_shape_expr = lambda shape, dtype: FakeDesc(tuple(shape), dtype)
    trtp.AutoTuneCombination = lambda types_, layout="LINEAR", tactics=None: (types_, layout, tactics)
    trtp.op = types.SimpleNamespace()
    return trt, trtp, registry


@pytest.fixture
def fake_trt(monkeypatch):
    """Plugin modules defined against a fake tensorrt (the real one is not importable in CI)."""
    trt, trtp, registry = make_fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    for m in PLUGIN_MODULES:
        m.define(trtp, trt)
    return trt, trtp, registry
