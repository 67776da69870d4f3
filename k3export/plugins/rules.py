"""Shape, dtype, attribute and launch rules of the k3 TensorRT plugins, as plain Python.

The ``tensorrt.plugin`` decorators in ``kda.py``, ``situ_glu.py`` and ``moe_route.py`` call these
functions; nothing here imports TensorRT, so CI checks the same rules without it.

Contracts (the ONNX exporter emits exactly these ``k3``-domain nodes, ``plugin_namespace="k3"``):

* ``k3::kda``       (q [B,T,H,K], k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] fp32, beta [B,T,H] fp32,
                    initial_state [B,H,K,V] fp32) -> (o [B,T,H,V] q's dtype, final_state [B,H,K,V] fp32);
                    attribute ``scale`` FLOAT.
* ``k3::situ_glu``  (gate, up) -> out (gate's shape and dtype); attributes ``beta1``, ``beta2`` FLOAT.
* ``k3::moe_route`` (logits [N,E] fp32, bias [E] fp32) -> (weights [N,top_k] fp32, indices [N,top_k] int64);
                    attributes ``top_k`` INT, ``renormalize`` INT, ``scale`` FLOAT.

Shape rules only rearrange the dims they are given, so they work on ints (tests, profile checks)
and on TensorRT's symbolic ``ShapeExpr`` objects alike. Checks run only on dims that are ints.
Launch rules put the symbolic operand on the left of every ``*`` (``ShapeExpr`` has no ``__rmul__``)
and take ``cdiv`` as an argument (``tensorrt.plugin.cdiv`` in the plugin, integer ceil-div in tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3export.errors import K3ExportError

PLUGIN_NAMESPACE = "k3"  # dot-free: TensorRT plugin namespaces may not contain '.'
PLUGIN_VERSION = "1"
#: ONNX node attributes the TensorRT parser reads itself and does not forward to the plugin
PARSER_CONTROL_ATTRS = frozenset({"plugin_namespace", "plugin_version", "aot"})

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class PluginInputError(K3ExportError, ValueError):
    """A k3 plugin got inputs of the wrong rank, shape or dtype, or an attribute out of range."""


@dataclass(frozen=True)
class PluginSpec:
    """Inputs, outputs and typed attributes (in registration order) of one k3 plugin."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[tuple[str, type], ...]
    #: tactics the autotune step offers (empty: TensorRT's default tactic only)
    tactics: tuple[int, ...] = field(default=())

    @property
    def plugin_id(self) -> str:
        return f"{PLUGIN_NAMESPACE}::{self.name}"

    @property
    def attribute_types(self) -> dict[str, type]:
        return dict(self.attributes)


# KDA tactics: the recurrent kernel (one token at a time; decode) and the chunked kernel (prefill).
KDA_TACTIC_RECURRENT = 1
KDA_TACTIC_CHUNKED = 2

PLUGINS: dict[str, PluginSpec] = {
    "kda": PluginSpec(
        "kda",
        ("q", "k", "v", "g", "beta", "initial_state"),
        ("o", "final_state"),
        (("scale", float),),
        (KDA_TACTIC_RECURRENT, KDA_TACTIC_CHUNKED),
    ),
    "situ_glu": PluginSpec("situ_glu", ("gate", "up"), ("out",), (("beta1", float), ("beta2", float))),
    "moe_route": PluginSpec(
        "moe_route",
        ("logits", "bias"),
        ("weights", "indices"),
        (("top_k", int), ("renormalize", int), ("scale", float)),
    ),
}

#: ONNX AttributeProto type name of each plugin attribute type (the parser maps INT->int32, FLOAT->float32)
ONNX_ATTRIBUTE_TYPE = {float: "FLOAT", int: "INT"}

#: io type strings of `tensorrt.plugin.AutoTuneCombination`: position = inputs then outputs.
#: '|' lists are dependent (all positions take the i-th entry together).
_F = "FP32|BF16|FP16"
AUTOTUNE_TYPES = {
    "kda": ", ".join([_F, _F, _F, "FP32", "FP32", "FP32", _F, "FP32"]),
    "situ_glu": ", ".join([_F, _F, _F]),
    "moe_route": "FP32, FP32, FP32, INT64",
}
AUTOTUNE_LAYOUT = "LINEAR"


def spec(op: str) -> PluginSpec:
    try:
        return PLUGINS[op]
    except KeyError:
        raise PluginInputError(
            f"unknown k3 op {op!r}: the k3 TensorRT plugins are {', '.join(sorted(PLUGINS))}"
        ) from None


# ---------------------------------------------------------------------------------------- dtypes
_DTYPE_NAMES = {
    "float32": "float32", "float": "float32", "fp32": "float32", "torch.float32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16", "torch.float16": "float16",
    "int64": "int64", "torch.int64": "int64", "int32": "int32", "torch.int32": "int32",
    "float64": "float64", "torch.float64": "float64", "double": "float64",
    # tensorrt.DataType names
    "datatype.float": "float32", "datatype.half": "float16", "datatype.bf16": "bfloat16",
    "datatype.int64": "int64", "datatype.int32": "int32",
}


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name ('float32', 'bfloat16', 'float16', 'int64', ...) from a torch / numpy /
    TensorRT / string spelling."""
    key = str(dtype).strip().lower()
    if key in _DTYPE_NAMES:
        return _DTYPE_NAMES[key]
    try:  # numpy dtypes and types
        import numpy as np

        return _DTYPE_NAMES[np.dtype(dtype).name]
    except Exception:
        pass
    raise PluginInputError(f"unsupported dtype {dtype!r}")


def _is_int(d: Any) -> bool:
    return isinstance(d, int) and not isinstance(d, bool)


def _check_rank(op: str, name: str, shape: Sequence[Any], rank: int, layout: str) -> None:
    if len(shape) != rank:
        raise PluginInputError(f"k3::{op} input {name!r}: expected {layout} (rank {rank}), got rank {len(shape)}")


def _check_dims(op: str, name: str, shape: Sequence[Any], expected: Sequence[Any], layout: str) -> None:
    for axis, (got, want) in enumerate(zip(shape, expected)):
        if _is_int(got) and _is_int(want) and got != want:
            raise PluginInputError(
                f"k3::{op} input {name!r}: expected {layout}, axis {axis} is {got} but should be {want} "
                f"(shape {tuple(shape)})"
            )


def _check_dtype(op: str, name: str, got: str, allowed: Sequence[str], why: str = "") -> None:
    if got not in allowed:
        raise PluginInputError(f"k3::{op} input {name!r}: dtype {got}, expected {' or '.join(allowed)}{why}")


# ---------------------------------------------------------------------------------------- k3::kda
def kda_output_shapes(q: Sequence[Any], v: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """o [B,T,H,V] and final_state [B,H,K,V] from q [B,T,H,K] and v [B,T,H,V]."""
    B, T, H, K = q
    V = v[3]
    return (B, T, H, V), (B, H, K, V)


def kda_output_dtypes(q_dtype: Any) -> tuple[str, str]:
    """o in q's dtype, the final state in fp32."""
    return dtype_name(q_dtype), "float32"


def kda_check(shapes: Sequence[Sequence[Any]], dtypes: Sequence[Any]) -> None:
    """Raise PluginInputError naming the input when ranks, dims or dtypes break the k3::kda contract."""
    if len(shapes) != 6 or len(dtypes) != 6:
        raise PluginInputError(f"k3::kda takes 6 inputs {PLUGINS['kda'].inputs}, got {len(shapes)}")
    q, k, v, g, beta, h0 = (tuple(s) for s in shapes)
    _check_rank("kda", "q", q, 4, "[B, T, H, K]")
    B, T, H, K = q
    _check_rank("kda", "k", k, 4, "[B, T, H, K]")
    _check_dims("kda", "k", k, q, "[B, T, H, K] like q")
    _check_rank("kda", "v", v, 4, "[B, T, H, V]")
    _check_dims("kda", "v", v[:3], q[:3], "[B, T, H, V] with B, T, H of q")
    _check_rank("kda", "g", g, 4, "[B, T, H, K]")
    _check_dims("kda", "g", g, q, "[B, T, H, K] like q")
    _check_rank("kda", "beta", beta, 3, "[B, T, H]")
    _check_dims("kda", "beta", beta, q[:3], "[B, T, H]")
    _check_rank("kda", "initial_state", h0, 4, "[B, H, K, V]")
    _check_dims("kda", "initial_state", h0, (B, H, K, v[3]), "[B, H, K, V]")
    names = [dtype_name(d) for d in dtypes]
    _check_dtype("kda", "q", names[0], FLOAT_DTYPES)
    _check_dtype("kda", "k", names[1], (names[0],), " (same as q)")
    _check_dtype("kda", "v", names[2], (names[0],), " (same as q)")
    _check_dtype("kda", "g", names[3], ("float32",), " (the log-decay is kept in fp32)")
    _check_dtype("kda", "beta", names[4], ("float32",))
    _check_dtype("kda", "initial_state", names[5], ("float32",), " (the recurrent state is fp32)")


def kda_kernel_for_tactic(tactic: int) -> str:
    """Kernel a KDA tactic runs: 1 (and TensorRT's default 0) the fused recurrent kernel, 2 the chunked one."""
    if tactic in (0, KDA_TACTIC_RECURRENT):
        return "kda_recurrent"
    if tactic == KDA_TACTIC_CHUNKED:
        return "kda_chunk"
    raise PluginInputError(f"k3::kda: unknown tactic {tactic} (1 = recurrent, 2 = chunked)")


#: dynamic shared memory a kernel may use without cudaFuncSetAttribute(MaxDynamicSharedMemorySize); the
#: TensorRT AOT launcher is not documented to raise that limit, so kernels above it are not offered.
MAX_DEFAULT_SHARED_BYTES = 48 * 1024


def kda_tactics(chunk_shared_bytes: int | None) -> list[int]:
    """Tactics the KDA autotune offers: always the recurrent kernel; the chunked kernel when it compiled
    (`chunk_shared_bytes` not None) and fits the default shared-memory limit."""
    tactics = [KDA_TACTIC_RECURRENT]
    if chunk_shared_bytes is not None and chunk_shared_bytes <= MAX_DEFAULT_SHARED_BYTES:
        tactics.append(KDA_TACTIC_CHUNKED)
    return tactics


def kda_launch(B: Any, T: Any, H: int, V: int, BV: int) -> dict[str, Any]:
    """Grid and int32 scalars of both KDA kernels: grid (cdiv(V, BV), B*H); scalars (T, H).

    One program owns the state tile S[:, v-block] of one (batch, head) and walks the T tokens.
    H, V, BV are build-time ints (compiled in); B and T may be symbolic."""
    for n, d in (("H", H), ("V", V), ("BV", BV)):
        if not _is_int(d):
            raise PluginInputError(f"k3::kda: {n} must be a build-time constant (static in the ONNX graph)")
    return {"grid": (-(-V // BV), B * H, 1), "scalars": (T, H)}


# ---------------------------------------------------------------------------------------- k3::situ_glu
def situ_glu_output_shapes(gate: Sequence[Any]) -> tuple[tuple[Any, ...]]:
    return (tuple(gate),)


def situ_glu_output_dtypes(gate_dtype: Any) -> tuple[str]:
    return (dtype_name(gate_dtype),)


def situ_glu_check(shapes: Sequence[Sequence[Any]], dtypes: Sequence[Any]) -> None:
    if len(shapes) != 2 or len(dtypes) != 2:
        raise PluginInputError(f"k3::situ_glu takes 2 inputs (gate, up), got {len(shapes)}")
    gate, up = (tuple(s) for s in shapes)
    if len(gate) != len(up):
        raise PluginInputError(f"k3::situ_glu input 'up': rank {len(up)} differs from gate's rank {len(gate)}")
    _check_dims("situ_glu", "up", up, gate, "the shape of gate")
    g, u = dtype_name(dtypes[0]), dtype_name(dtypes[1])
    _check_dtype("situ_glu", "gate", g, FLOAT_DTYPES)
    _check_dtype("situ_glu", "up", u, (g,), " (same as gate)")


def situ_glu_launch(numel: Any, block: int, cdiv: Callable[[Any, Any], Any]) -> dict[str, Any]:
    """Elementwise: grid (cdiv(numel, BLOCK),); scalar (numel,)."""
    grid_x = -(-numel // block) if _is_int(numel) else cdiv(numel, block)
    return {"grid": (grid_x, 1, 1), "scalars": (numel,)}


# ---------------------------------------------------------------------------------------- k3::moe_route
def moe_route_output_shapes(logits: Sequence[Any], top_k: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    N = logits[0]
    return (N, int(top_k)), (N, int(top_k))


def moe_route_output_dtypes() -> tuple[str, str]:
    return "float32", "int64"


def moe_route_check(shapes: Sequence[Sequence[Any]], dtypes: Sequence[Any], top_k: int) -> None:
    if len(shapes) != 2 or len(dtypes) != 2:
        raise PluginInputError(f"k3::moe_route takes 2 inputs (logits, bias), got {len(shapes)}")
    logits, bias = (tuple(s) for s in shapes)
    _check_rank("moe_route", "logits", logits, 2, "[N, E]")
    _check_rank("moe_route", "bias", bias, 1, "[E]")
    _check_dims("moe_route", "bias", bias, logits[1:], "[E] with E of logits")
    _check_dtype("moe_route", "logits", dtype_name(dtypes[0]), ("float32",), " (the router runs in fp32)")
    _check_dtype("moe_route", "bias", dtype_name(dtypes[1]), ("float32",))
    E = logits[1]
    if not _is_int(top_k) or top_k < 1 or (_is_int(E) and top_k > E):
        raise PluginInputError(f"k3::moe_route attribute top_k={top_k!r}: expected 1 <= top_k <= E (E = {E})")
    if top_k >= 3840:
        raise PluginInputError(f"k3::moe_route attribute top_k={top_k}: TensorRT's TopK needs K < 3840")


def moe_route_launch(N: Any) -> dict[str, Any]:
    """One program per token row: grid (N, 1, 1); no int32 scalars (E, top_k are compiled in)."""
    return {"grid": (N, 1, 1), "scalars": ()}


# ---------------------------------------------------------------------------------------- generic
def output_shapes(op: str, shapes: Sequence[Sequence[Any]], attrs: dict[str, Any] | None = None) -> list[tuple]:
    """Output shapes of a k3 plugin from its input shapes (and attributes)."""
    attrs = attrs or {}
    if op == "kda":
        return list(kda_output_shapes(shapes[0], shapes[2]))
    if op == "situ_glu":
        return list(situ_glu_output_shapes(shapes[0]))
    if op == "moe_route":
        return list(moe_route_output_shapes(shapes[0], attrs["top_k"]))
    spec(op)
    raise AssertionError(op)  # pragma: no cover


def output_dtypes(op: str, dtypes: Sequence[Any]) -> list[str]:
    if op == "kda":
        return list(kda_output_dtypes(dtypes[0]))
    if op == "situ_glu":
        return list(situ_glu_output_dtypes(dtypes[0]))
    if op == "moe_route":
        return list(moe_route_output_dtypes())
    spec(op)
    raise AssertionError(op)  # pragma: no cover


def check_inputs(op: str, shapes: Sequence[Sequence[Any]], dtypes: Sequence[Any], attrs: dict[str, Any] | None = None) -> None:
    attrs = attrs or {}
    if op == "kda":
        kda_check(shapes, dtypes)
    elif op == "situ_glu":
        situ_glu_check(shapes, dtypes)
    elif op == "moe_route":
        moe_route_check(shapes, dtypes, attrs.get("top_k"))
    else:
        spec(op)


def check_attributes(op: str, attrs: dict[str, Any], where: str = "") -> None:
    """Names and Python types of node attributes (parser controls removed) against the plugin's."""
    s = spec(op)
    expected = s.attribute_types
    given = {k: v for k, v in attrs.items() if k not in PARSER_CONTROL_ATTRS}
    missing = [k for k in expected if k not in given]
    unknown = [k for k in given if k not in expected]
    prefix = f"{where}: " if where else ""
    if missing or unknown:
        raise PluginInputError(
            f"{prefix}k3::{op} attributes {sorted(given)} do not match the plugin's "
            f"{[f'{k}: {ONNX_ATTRIBUTE_TYPE[t]}' for k, t in s.attributes]}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {unknown}" if unknown else "")
        )
    for k, t in s.attributes:
        v = given[k]
        ok = isinstance(v, float) if t is float else (isinstance(v, int) and not isinstance(v, bool))
        if not ok:
            raise PluginInputError(
                f"{prefix}k3::{op} attribute {k!r} is {type(v).__name__} {v!r}; the plugin expects "
                f"{ONNX_ATTRIBUTE_TYPE[t]}"
            )
