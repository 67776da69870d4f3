"""Each k3 op's kernel contract, written once.

An `OpSpec` names the op's inputs and outputs (symbolic layout, allowed dtypes), its attributes (the ONNX node
attributes, which are the TensorRT plugin attributes, in registration order), the int32 scalars its kernels take
between the input and the output pointers, and the Triton kernels a plugin may launch. Derived from it:

* the input checks of ``torch.ops.k3.*`` and of the TensorRT plugins (`OpSpec.check`, one error type);
* output shapes and dtypes (the torch ops' fake tensors, the plugins' output descs);
* the AOT kernel signature (`k3export.ops.aot`: input pointers, int32 scalars, output pointers);
* the ONNX function signatures (`k3export.converters.onnx.functions`) and the plugin rules (`k3export.plugins`).

Plain Python (no torch): shapes are tuples of ints or of TensorRT's symbolic dims, and only int dims are compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from k3export.dtypes import DTypeError, dtype
from k3export.errors import K3ExportError

NAMESPACE = "k3"  # torch library, ONNX domain and TensorRT plugin namespace (dot-free, as TensorRT requires)
FLOATS = ("float32", "bfloat16", "float16")


class OpInputError(K3ExportError, ValueError):
    """A k3 op or plugin got an input of the wrong rank, shape or dtype, or an attribute out of range."""


@dataclass(frozen=True)
class Arg:
    """One tensor: `dims` is its layout ("B T H K"; "." = any size; "..." = any shape, the same for every "..."
    tensor) and `dtype` the dtypes allowed: "float" (fp32, bf16, fp16), canonical names joined by "|", or "=q" (like
    input q)."""

    name: str
    dims: str
    dtype: str
    why: str = ""
    #: the node may leave it out (trailing inputs only); a fused op's kernel then takes the other meaning (its doc)
    optional: bool = False

    @property
    def layout(self) -> str:
        return "[" + ", ".join(self.dims.split()) + "]"


@dataclass(frozen=True)
class OpSpec:
    name: str
    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    attributes: tuple[tuple[str, type], ...] = ()
    scalars: tuple[str, ...] = ()  # int32 kernel scalars: dim symbols, or "numel" of the "..." shape
    kernels: tuple[str, ...] = ()
    limits: Callable[[dict, dict], None] | None = None  # value checks beyond layout and dtype: (dims, attrs)
    #: the last input repeats (one or more tensors of one shape: attn_res_aggregate's sources)
    variadic: bool = False
    #: what the op computes, in one line (the fused ops': which standard-op subgraph of the export it replaces)
    doc: str = ""
    #: attributes the native libraries' kernel of the op reads beyond `attributes`, each optional (absent: 0)
    library_attributes: tuple[tuple[str, type], ...] = ()

    def takes_inputs(self, n: int) -> bool:
        """Whether a node of this op may have `n` inputs (optional trailing inputs left out, a variadic one repeated)."""
        required = sum(not a.optional for a in self.inputs)
        return n >= len(self.inputs) if self.variadic else required <= n <= len(self.inputs)

    @property
    def plugin_id(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.outputs)

    @property
    def attribute_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.attributes)

    def fail(self, message: str) -> OpInputError:
        return OpInputError(f"{self.plugin_id} {message}")

    # -- layout and dtypes
    def check(self, shapes: Sequence[Sequence[Any]], dtypes: Sequence[Any], attrs: dict | None = None) -> dict:
        """Raise OpInputError naming the input (or attribute) that breaks the contract; return the dims by symbol."""
        if not self.takes_inputs(len(shapes)) or len(dtypes) != len(shapes):
            raise self.fail(f"takes {len(self.inputs)} inputs {self.input_names}, got {len(shapes)}")
        args = self.args(len(shapes))
        dims: dict[str, Any] = {}
        for arg, shape in zip(args, shapes):
            shape = tuple(shape)
            if arg.dims == "...":
                want = dims.setdefault("...", shape)
                if len(shape) != len(want):
                    raise self.fail(f"input {arg.name!r}: rank {len(shape)} differs from {len(want)} (shape {shape})")
                syms = [f"...{i}" for i in range(len(shape))]
            else:
                syms = arg.dims.split()
                if len(shape) != len(syms):
                    raise self.fail(f"input {arg.name!r}: expected {arg.layout} (rank {len(syms)}), got shape {shape}")
            for axis, (sym, d) in enumerate(zip(syms, shape)):
                if sym == ".":  # any size
                    continue
                have = dims.setdefault(sym, d)
                if _is_int(have) and _is_int(d) and have != d:
                    raise self.fail(f"input {arg.name!r}: expected {arg.layout}, axis {axis} is {d} but should be "
                                    f"{have} (shape {shape})")
        known = dict(zip(self.input_names, self.dtype_names(dtypes)))
        for arg, got in zip(args, self.dtype_names(dtypes)):
            allowed = self.allowed(arg, known)
            if got not in allowed:
                same = f" (same as {arg.dtype[1:]})" if arg.dtype.startswith("=") else ""
                raise self.fail(f"input {arg.name!r}: dtype {got}, expected {' or '.join(allowed)}{same}{arg.why}")
        if self.limits is not None:
            self.limits(dims, dict(attrs or {}))
        return dims

    def args(self, n: int) -> tuple[Arg, ...]:
        """The inputs of a node with `n` of them: optional ones left out, a variadic one repeated."""
        if self.variadic:
            return self.inputs[:-1] + (self.inputs[-1],) * (n - len(self.inputs) + 1)
        return self.inputs[:n]

    def dtype_names(self, dtypes: Sequence[Any]) -> list[str]:
        out = []
        for arg, d in zip(self.args(len(dtypes)), dtypes):
            try:
                out.append(dtype(d).name)
            except DTypeError:
                raise self.fail(f"input {arg.name!r}: unsupported dtype {d!r}") from None
        return out

    def allowed(self, arg: Arg, known: dict[str, str]) -> tuple[str, ...]:
        """The dtypes `arg` may have, given the dtypes `known` of the tensors before it."""
        if arg.dtype.startswith("="):
            return (known[arg.dtype[1:]],)
        return tuple(n for part in arg.dtype.split("|") for n in (FLOATS if part == "float" else (part,)))

    def output_shapes(self, shapes: Sequence[Sequence[Any]], attrs: dict | None = None) -> list[tuple]:
        """Output shapes from the input shapes (symbolic dims pass through) and the attributes."""
        dims = dict(attrs or {})
        for arg, shape in zip(self.inputs, shapes):
            if arg.dims == "...":
                dims.setdefault("...", tuple(shape))
            else:
                for sym, d in zip(arg.dims.split(), shape):
                    dims.setdefault(sym, d)
        return [dims["..."] if a.dims == "..." else tuple(dims[s] for s in a.dims.split()) for a in self.outputs]

    def output_dtypes(self, dtypes: Sequence[Any]) -> list[str]:
        known = dict(zip(self.input_names, self.dtype_names(dtypes)))
        return [self.allowed(a, known)[0] for a in self.outputs]

    def io_dtypes(self, float_dtype: str) -> dict[str, str]:
        """Every input's and output's dtype when the op runs in `float_dtype` (the AOT kernel signature)."""
        out: dict[str, str] = {}
        for a in self.inputs + self.outputs:
            allowed = self.allowed(a, out)
            out[a.name] = float_dtype if float_dtype in allowed else allowed[0]
        return out

    # -- attributes
    def check_attributes(self, attrs: dict, where: str = "") -> None:
        """The attribute names and types of an ONNX node (parser controls removed) against the contract."""
        prefix = f"{where}: " if where else ""
        missing = [n for n in self.attribute_names if n not in attrs]
        unknown = [n for n in attrs if n not in self.attribute_names]
        if missing or unknown:
            raise OpInputError(
                f"{prefix}{self.plugin_id} attributes {sorted(attrs)} do not match the plugin's "
                f"{[f'{n}: {ONNX_ATTRIBUTE_TYPE[t]}' for n, t in self.attributes]}"
                + (f"; missing {missing}" if missing else "") + (f"; unknown {unknown}" if unknown else ""))
        for n, t in self.attributes:
            v = attrs[n]
            if type(v) is not t:
                raise OpInputError(f"{prefix}{self.plugin_id} attribute {n!r} is {type(v).__name__} {v!r}; the plugin "
                                   f"expects {ONNX_ATTRIBUTE_TYPE[t]}")


#: ONNX AttributeProto type of each attribute type (the TensorRT parser maps INT -> int32, FLOAT -> float32)
ONNX_ATTRIBUTE_TYPE = {float: "FLOAT", int: "INT", str: "STRING"}


def _is_int(d: Any) -> bool:
    return isinstance(d, int) and not isinstance(d, bool)


def _finite(spec_name: str, name: str, value: Any, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise OpInputError(f"{NAMESPACE}::{spec_name} attribute {name}: expected a finite float"
                           f"{' > 0' if positive else ''}, got {value!r}")


MAX_HEAD_DIM = 256  # the KDA kernels hold a [K, V-block] state tile in registers


def _kda_limits(dims: dict, attrs: dict) -> None:
    K, V = dims["K"], dims["V"]
    if any(_is_int(d) and not 1 <= d <= MAX_HEAD_DIM for d in (K, V)):
        raise OpInputError(f"k3::kda head dims K={K}, V={V}: expected 1 <= K, V <= {MAX_HEAD_DIM}")
    if "scale" in attrs:
        _finite("kda", "scale", attrs["scale"])


def _situ_glu_limits(dims: dict, attrs: dict) -> None:
    shape = dims["..."]
    if all(_is_int(d) for d in shape) and math.prod(shape) >= 2**31:
        raise OpInputError(f"k3::situ_glu input 'gate': at most 2**31 - 1 elements (int32 count), got {math.prod(shape)}")
    for name in ("beta1", "beta2"):
        if name in attrs:
            _finite("situ_glu", name, attrs[name], positive=True)


TOPK_MAX = 3840  # TensorRT's TopK needs K < 3840


def _moe_route_limits(dims: dict, attrs: dict) -> None:
    E, top_k = dims["E"], attrs.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 1 or (_is_int(E) and top_k > E) or top_k >= TOPK_MAX):
        raise OpInputError(f"k3::moe_route attribute top_k={top_k!r}: expected an int with 1 <= top_k <= E = {E} "
                           f"(logits [N, E]) and top_k < {TOPK_MAX}")
    if "renormalize" in attrs and attrs["renormalize"] not in (0, 1):
        raise OpInputError(f"k3::moe_route attribute renormalize={attrs['renormalize']!r}: expected a bool (0 or 1)")
    if "scale" in attrs:
        _finite("moe_route", "scale", attrs["scale"])


KDA = OpSpec(
    "kda",
    inputs=(
        Arg("q", "B T H K", "float", " (L2-normalised, not yet scaled)"),
        Arg("k", "B T H K", "=q"),
        Arg("v", "B T H V", "=q"),
        Arg("g", "B T H K", "float32", " (the log-decay is kept in fp32)"),
        Arg("beta", "B T H", "float32"),
        Arg("initial_state", "B H K V", "float32", " (the recurrent state is fp32)"),
    ),
    outputs=(Arg("o", "B T H V", "=q"), Arg("final_state", "B H K V", "float32")),
    attributes=(("scale", float),),
    scalars=("T", "H"),
    kernels=("kda_recurrent", "kda_chunk"),
    limits=_kda_limits,
)

SITU_GLU = OpSpec(
    "situ_glu",
    inputs=(Arg("gate", "...", "float"), Arg("up", "...", "=gate")),
    outputs=(Arg("out", "...", "=gate"),),
    attributes=(("beta1", float), ("beta2", float)),
    scalars=("numel",),
    kernels=("situ_glu",),
    limits=_situ_glu_limits,
)

MOE_ROUTE = OpSpec(
    "moe_route",
    inputs=(Arg("logits", "N E", "float32", " (the router runs in fp32)"), Arg("bias", "E", "float32")),
    outputs=(Arg("weights", "N top_k", "float32"), Arg("indices", "N top_k", "int64")),
    attributes=(("top_k", int), ("renormalize", int), ("scale", float)),
    kernels=("moe_route",),
    limits=_moe_route_limits,
)

MOE_ACTS = ("situ", "silu")  # k3::moe_experts attribute act: SiTU-GLU (K3) or SiLU-GLU (Kimi-Linear)


def _moe_experts_limits(dims: dict, attrs: dict, name: str = "moe_experts") -> None:
    if "act" in attrs and attrs["act"] not in MOE_ACTS:
        raise OpInputError(f"k3::{name} attribute act={attrs['act']!r}: expected one of {MOE_ACTS}")
    for beta in ("beta1", "beta2"):
        if beta in attrs:
            _finite(name, beta, attrs[beta], positive=True)
    N, top_k = dims["N"], dims["top_k"]
    if _is_int(N) and _is_int(top_k) and N * top_k >= 2**31:
        raise OpInputError(f"k3::{name} inputs 'weights' / 'indices': at most 2**31 - 1 token-slots (int32 count), "
                           f"got N * top_k = {N * top_k}")


def _fp4_experts_limits(name: str, block: int, scale: str) -> Callable[[dict, dict], None]:
    """The limits of the routed experts on packed E2M1 bytes (two a byte) with one `scale` per `block` features."""

    def limits(dims: dict, attrs: dict) -> None:
        _moe_experts_limits(dims, attrs, name)
        for full, what in (("D", f"w1 / w3 [E, I, D/2], their scales [E, I, D/{block}]"),
                           ("I", f"w2 [E, D, I/2], its scales [E, D, I/{block}]")):
            packed, scales = f"{full}/2", f"{full}/{block}"
            n, p, s = dims[full], dims[packed], dims[scales]
            if all(_is_int(d) for d in (n, p, s)) and (n % block or p * 2 != n or s * block != n):
                raise OpInputError(f"k3::{name}: {what} do not fit {full} = {n} (two E2M1 values per byte, one "
                                   f"{scale} scale per {block}): got {packed} = {p}, {scales} = {s}; {full} must be "
                                   f"a multiple of {block}")

    return limits


MOE_EXPERTS = OpSpec(
    "moe_experts",
    inputs=(Arg("z", "N D", "float"), Arg("weights", "N top_k", "float32"), Arg("indices", "N top_k", "int64"),
            Arg("w1", "E I D", "=z"), Arg("w3", "E I D", "=z"), Arg("w2", "E D I", "=z")),
    outputs=(Arg("u", "N D", "float32"),),
    attributes=(("act", str), ("beta1", float), ("beta2", float)),
    scalars=("N",),
    kernels=("moe_experts",),
    limits=_moe_experts_limits,
)

#: ``quantize_activations`` (INT 0 / 1, absent 0): an attribute of the k3 ORT library's ``moe_experts_mxfp4`` (and
#: the fused ``moe_route_experts_mxfp4``) alone, not of the torch op or the plugin. 1: z and the hidden activation
#: are each rounded to int8 per 32 features before their products, x ~ d q with d = max|x| / 127 in fp32 and
#: q = round(x / d) (the quotient in fp32, ties to even: QuantizeLinear's; d = 0 gives q = 0), as MatMulNBits'
#: accuracy_level 4 and llama.cpp's Q8_0 round theirs (`naive.q8_round_naive`). `artifacts.expert_views.packed_view`
#: sets it where the export's MatMulNBits run at accuracy_level 4.
MXFP4_QUANTIZE_ACTIVATIONS = "quantize_activations"

#: the routed experts on compressed-tensors' MXFP4 bytes (W4A16): packed E2M1 (two per byte, element 2j in the low
#: nibble of byte j) and E8M0 scales (2^(byte - 127)) per 32 input features, as the checkpoint stores them
MOE_EXPERTS_MXFP4 = OpSpec(
    "moe_experts_mxfp4",
    inputs=(Arg("z", "N D", "float"), Arg("weights", "N top_k", "float32"), Arg("indices", "N top_k", "int64"),
            Arg("w1", "E I D/2", "uint8", " (packed E2M1)"), Arg("w3", "E I D/2", "uint8", " (packed E2M1)"),
            Arg("w2", "E D I/2", "uint8", " (packed E2M1)"), Arg("w1_scale", "E I D/32", "uint8", " (E8M0)"),
            Arg("w3_scale", "E I D/32", "uint8", " (E8M0)"), Arg("w2_scale", "E D I/32", "uint8", " (E8M0)")),
    outputs=(Arg("u", "N D", "float32"),),
    attributes=(("act", str), ("beta1", float), ("beta2", float)),
    scalars=("N",),
    kernels=("moe_experts_mxfp4",),
    limits=_fp4_experts_limits("moe_experts_mxfp4", 32, "E8M0"),
    library_attributes=((MXFP4_QUANTIZE_ACTIVATIONS, int),),
)



#: the routed experts on NVIDIA's NVFP4 bytes (W4A16; ``nvidia/Kimi-K3-NVFP4``): packed E2M1 as in MXFP4, one E4M3
#: scale per 16 input features and one fp32 global scale per expert matrix (``weight_scale_2``; an expert's w1 and
#: w3 hold the same): w = e2m1 * e4m3 * scale_2. The ONNX export spells it as the 12-input standard-op body of
#: ``k3::moe_experts`` (`k3export.converters.onnx.nvfp4`). Its kernels: the k3 ORT library's ``moe_experts_nvfp4``
#: (on the export's bytes retyped, `expert_views.packed_view`), the Triton kernels (`moe_experts.moe_experts_triton(...,
#: scale_2=...)`) and the TensorRT plugin of this name (`k3export.plugins.moe_experts_nvfp4`, the "tokens" kernel;
#: the E4M3 scales reach its kernel as their bytes, which it decodes by bit fields).
MOE_EXPERTS_NVFP4 = OpSpec(
    "moe_experts_nvfp4",
    inputs=(Arg("z", "N D", "float"), Arg("weights", "N top_k", "float32"), Arg("indices", "N top_k", "int64"),
            Arg("w1", "E I D/2", "uint8", " (packed E2M1)"), Arg("w3", "E I D/2", "uint8", " (packed E2M1)"),
            Arg("w2", "E D I/2", "uint8", " (packed E2M1)"), Arg("w1_scale", "E I D/16", "float8e4m3fn"),
            Arg("w3_scale", "E I D/16", "float8e4m3fn"), Arg("w2_scale", "E D I/16", "float8e4m3fn"),
            Arg("w1_scale_2", "E", "float32"), Arg("w3_scale_2", "E", "float32"), Arg("w2_scale_2", "E", "float32")),
    outputs=(Arg("u", "N D", "float32"),),
    attributes=(("act", str), ("beta1", float), ("beta2", float)),
    scalars=("N",),
    kernels=("moe_experts_nvfp4",),
    limits=_fp4_experts_limits("moe_experts_nvfp4", 16, "E4M3"),
)

# -- the fused ops: one kernel each in the k3 ONNX Runtime library and the OpenVINO extension, in place of a
# standard-op subgraph of the export (`k3export.converters.onnx.fusions` matches them; their ONNX functions, whose
# bodies are those subgraphs: `k3export.converters.onnx.fused_bodies`; their naive references: `k3export.ops.naive`).
# fp32 kernels; the bodies take any float type.

ATTN_RES_AGGREGATE = OpSpec(
    "attn_res_aggregate",
    inputs=(Arg("weight", "D", "float32", " (the key norm's gain times the pseudo-query)"),
            Arg("sources", "N D", "=weight")),
    outputs=(Arg("out", "N D", "=weight"),),
    attributes=(("epsilon", float),),
    variadic=True,
    doc="Attention Residuals over depth: per row, softmax over the sources of (weight . v_s) / rms(v_s), then the "
        "weighted sum of the raw v_s (the export's RMSNormalization / ReduceSum / Softmax / Mul / ReduceSum of the "
        "stacked sources)",
)

MLA_ATTEND = OpSpec(
    "mla_attend",
    inputs=(Arg("q", "B H T R", "float32"),
            Arg("lat_t", "B 1 . .", "float32", " ([B, 1, R, S] latents transposed; halves: the key half [B, 1, S, W])"),
            Arg("c", "B 1 . .", "float32", " ([B, 1, S, Dc] latents' first Dc features; halves: the value half)"),
            Arg("visible", "...", "bool", " ([T, S] or [B, 1, T, S])"),
            Arg("any_key", "B 1 T 1", "float32", optional=True)),
    outputs=(Arg("out", "B H T Dc", "float32"),),
    attributes=(("scale", float), ("fill", float), ("halves", int), ("value_dim", int)),
    doc="MLA's absorbed attention over the latent cache, a query row at a time: softmax(scale q . latent_s where "
        "visible, else fill) [* any_key] times the latents' first Dc features; halves = 1: the latents are the "
        "cache's key / value halves joined (latent_s = key_s ++ value_s), Dc = value_dim (the export's If that "
        "attends in one call or in blocks of queries)",
)

SHORT_CONV = OpSpec(
    "short_conv",
    inputs=(Arg("state", "B C W-1", "float32"), Arg("x", "B T C", "=state"), Arg("taps", "W C", "=state"),
            Arg("start", "B", "int64", " (the row of [state | x] where each row's new state starts)", optional=True)),
    outputs=(Arg("y", "B T C", "=state"), Arg("present", "B C W-1", "=state")),
    doc="KDA's causal depthwise conv + SiLU over full = [stateᵀ | x]: y_t = silu(sum_j taps_j full_{t+j}); the new "
        "state the W - 1 rows of full from `start` (absent: the last W - 1), transposed",
)

L2_NORM = OpSpec(
    "l2_norm",
    inputs=(Arg("x", "...", "float32"),),
    outputs=(Arg("y", "...", "=x"),),
    attributes=(("epsilon", float),),
    doc="x / sqrt(sum(x^2) + epsilon) over the last axis (KDA's q and k)",
)

#: the KDA layer's stateful core (its conv state and recurrent state), one name with the modeling file's
#: ``kda_layer`` hook, whose boundary also takes beta's sigmoid, the padding masks and the gated output norm in
KDA_LAYER = OpSpec(
    "kda_layer",
    inputs=(Arg("state", "B C W-1", "float32"), Arg("x", "B T C", "=state"), Arg("taps", "W C", "=state"),
            Arg("g", "B T H K", "float32"), Arg("beta", "B T H", "float32"), Arg("initial_state", "B H K V", "float32"),
            Arg("start", "B", "int64", optional=True)),
    outputs=(Arg("o", "B T H V", "float32"), Arg("present", "B C W-1", "=state"),
             Arg("final_state", "B H K V", "float32")),
    attributes=(("scale", float), ("epsilon", float)),
    doc="KDA's stateful core: short_conv, its output split into q, k (H heads of K) and v (H of V), q and k through "
        "l2_norm, then kda from initial_state",
)

_ROUTE_EXPERTS_ATTRS = MOE_ROUTE.attributes + MOE_EXPERTS.attributes


def _moe_route_experts_limits(dims: dict, attrs: dict) -> None:
    _moe_route_limits(dims, attrs)
    _moe_experts_limits(dims, attrs, "moe_route_experts")


def _moe_route_experts_mxfp4_limits(dims: dict, attrs: dict) -> None:
    _moe_route_limits(dims, attrs)
    _fp4_experts_limits("moe_route_experts_mxfp4", 32, "E8M0")(dims, attrs)


MOE_ROUTE_EXPERTS = OpSpec(
    "moe_route_experts",
    inputs=MOE_ROUTE.inputs + (MOE_EXPERTS.inputs[0],) + MOE_EXPERTS.inputs[3:],
    outputs=MOE_EXPERTS.outputs,
    attributes=_ROUTE_EXPERTS_ATTRS,
    limits=_moe_route_experts_limits,
    doc="moe_route, then moe_experts on its slots, in one call",
)

MOE_ROUTE_EXPERTS_MXFP4 = OpSpec(
    "moe_route_experts_mxfp4",
    inputs=MOE_ROUTE.inputs + (MOE_EXPERTS_MXFP4.inputs[0],) + MOE_EXPERTS_MXFP4.inputs[3:],
    outputs=MOE_EXPERTS_MXFP4.outputs,
    attributes=_ROUTE_EXPERTS_ATTRS,
    limits=_moe_route_experts_mxfp4_limits,
    doc="moe_route, then moe_experts_mxfp4 on its slots, in one call",
    library_attributes=MOE_EXPERTS_MXFP4.library_attributes,
)

#: the fused ops, by name
FUSED_SPECS: dict[str, OpSpec] = {s.name: s for s in (ATTN_RES_AGGREGATE, MLA_ATTEND, SHORT_CONV, L2_NORM,
                                                       KDA_LAYER, MOE_ROUTE_EXPERTS, MOE_ROUTE_EXPERTS_MXFP4)}

#: every k3 op with an ONNX function of its own, in the order the functions are listed; those with `kernels` are
#: TensorRT plugins
SPECS: dict[str, OpSpec] = {s.name: s for s in (KDA, SITU_GLU, MOE_ROUTE, MOE_EXPERTS)}
#: every k3 op: `SPECS` and the ops that are TensorRT plugins (and library kernels) with no ONNX function of that
#: name (``moe_experts_mxfp4`` / ``moe_experts_nvfp4``: the ONNX export spells FP4 experts as the standard-op body
#: of ``k3::moe_experts``)
ALL_SPECS: dict[str, OpSpec] = {**SPECS, MOE_EXPERTS_MXFP4.name: MOE_EXPERTS_MXFP4,
                                MOE_EXPERTS_NVFP4.name: MOE_EXPERTS_NVFP4}
#: every op the k3 ONNX Runtime library and OpenVINO extension run: `ALL_SPECS` and the fused ops
LIBRARY_SPECS: dict[str, OpSpec] = {**ALL_SPECS, **FUSED_SPECS}


def op_spec(name: str) -> OpSpec:
    try:
        return ALL_SPECS[name]
    except KeyError:
        raise OpInputError(f"unknown k3 op {name!r}: the k3 ops are {', '.join(ALL_SPECS)}") from None


def check_tensors(spec: OpSpec, *tensors: Any, **attrs: Any) -> dict:
    """`OpSpec.check` on tensors (anything with .shape, .dtype, .device), plus: all on one device."""
    for arg, t in zip(spec.inputs, tensors):
        if not all(hasattr(t, a) for a in ("shape", "dtype", "device")):
            raise spec.fail(f"input {arg.name!r}: expected a tensor of shape {arg.layout}, got {type(t).__name__}")
    devices = {str(t.device) for t in tensors}
    if len(devices) > 1:
        raise spec.fail(f"inputs must be on one device, got {dict(zip(spec.input_names, map(str, (t.device for t in tensors))))}")
    return spec.check([tuple(t.shape) for t in tensors], [t.dtype for t in tensors], attrs)
