# Copyright 2026 the k3export authors. Apache-2.0.
"""MXFP4 routed experts in an ONNX export: in the file as the checkpoint has them, and in ONNX Runtime at 9 bits.

**In the file** (``export --experts mxfp4``, the default when the source keeps MXFP4). Per MoE layer and expert
matrix (w1, w3, w2) the export holds two initializers, stacked over the E experts from the checkpoint's
per-expert tensors, byte for byte:

* ``...experts.w1.weight_packed`` FLOAT4E2M1 [E, out, in]: compressed-tensors' ``weight_packed`` bytes (two E2M1
  values per byte, element 2j in the low nibble, which is ONNX's 4-bit packing);
* ``...experts.w1.weight_scale`` FLOAT8E8M0 [E, out, in/32]: its ``weight_scale`` bytes (2^(byte - 127)).

``k3::moe_experts(z, weights, indices, w1, w3, w2, w1_scale, w3_scale, w2_scale)`` consumes them; its body
(`bodies.mxfp4_expert`) crops the selected expert with ``Pad`` (negative pads; no standard gather takes 4-bit
types) and dequantises it with ``DequantizeLinear(block_size=32, axis=-1)``, so a runtime that implements the
ONNX standard reads the file directly and touches only the selected experts. 4.25 bits per expert weight.

**In ONNX Runtime** (`ort_model`; the session that runs it is `k3export.runtime.ort_session`, beside the runners).
ORT 1.32's CPU ``DequantizeLinear`` takes no E8M0 scales and nothing in it gathers FP4 quickly, so when a session
is built the MXFP4 pairs are rewritten, in memory, into the lossless 8-bit form: q = 2v + 128 (uint8; 2v is an
integer in [-12, 12] for every E2M1 value v) with float scales 2^(e - 128) and
``GatherBlockQuantized(bits=8, block_size=32)`` (default zero point 128) in the loop body. The 8-bit form is
written to a temporary file that ORT memory-maps (the file is unlinked once the session holds it), so the experts
take 9 bits per element, only the pages of experts actually selected become resident, and no fp32 or second copy
exists at any point. ``export --genai`` persists the same rewrite in the export folder (`write_ort_form`);
``k3export.runtime.OrtRunner`` then opens that file and converts nothing per session. The measured alternatives
are in ``docs/mxfp4.md``.

Exact: GatherBlockQuantized computes (q - 128) * 2^(e-128) = v * 2^(e-127) in fp32, the value
``DequantizeLinear`` and `decode_mxfp4` give, for every scale byte but 255 (E8M0 NaN; compressed-tensors decodes
it as 2^128 = inf: the 8-bit form gives inf for |v| >= 1 as well, but 0 instead of NaN for v = 0).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from k3export.artifacts.graph_forms import EXPERT_BLOCK, expert_block
from k3export.errors import ExportError
from k3export.ops.spec import MXFP4_QUANTIZE_ACTIVATIONS

from .bodies import MS_DOMAIN, Body, moe_experts_nodes
from .shards import DEFAULT_MAX_SHARD_BYTES, plan_shards, write_shards
# has_mxfp4 and EXPERT_FORMATS re-exported: their home is artifacts.graph_forms
from .forms import EXPERT_FORMATS, graph_form, has_mxfp4  # noqa: F401
from .nvfp4 import e4m3_to_float, ort_moe_function as nvfp4_ort_function

GROUP_SIZE = 32
_CHUNK = 1 << 23  # bytes converted per step (the transient is a few times this)

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_Q8 = (2 * _E2M1 + 128).astype(np.uint32)                      # E2M1 code -> q = 2v + 128
_w = np.arange(65536, dtype=np.uint32)
#: two packed bytes (a little-endian uint16: four E2M1 codes) -> their four q bytes (a little-endian uint32)
Q8_QUAD = (_Q8[_w & 15] | _Q8[(_w >> 4) & 15] << 8 | _Q8[(_w >> 8) & 15] << 16 | _Q8[_w >> 12] << 24).astype(np.uint32)
#: E8M0 byte -> the float scale of the 8-bit form, 2^(byte - 128) (half the MXFP4 scale: q - 128 = 2v)
Q8_SCALE = np.exp2(np.arange(256, dtype=np.float64) - 128).astype(np.float32)
del _w


# ---------------------------------------------------------------------------------------------- the export side
def stored_experts(source: Any, model_or_dir: Any = None, config_json: dict[str, Any] | None = None) -> str | None:
    """``"mxfp4"``, ``"nvfp4"`` (NVIDIA's release: `weights.CheckpointSource.has_nvfp4`, or a Model-Optimizer
    config.json) or None: the quantized form an export's source keeps its routed experts in (`keeps_mxfp4`)."""
    if source is not None:
        return "nvfp4" if getattr(source, "has_nvfp4", False) else "mxfp4" if keeps_mxfp4(source) else None
    if keeps_mxfp4(None, model_or_dir, config_json):
        return "mxfp4"
    from k3export.files import CONFIG_NAME, read_config_json

    if config_json is None and isinstance(model_or_dir, (str, os.PathLike)) and (
            Path(model_or_dir).expanduser() / CONFIG_NAME).is_file():
        config_json = read_config_json(Path(model_or_dir).expanduser())
    if config_json is None:
        return None
    from k3export.converters.checkpoints.layouts import quantization_format

    return "nvfp4" if quantization_format(config_json) == "nvfp4" else None


def keeps_mxfp4(source: Any, model_or_dir: Any = None, config_json: dict[str, Any] | None = None) -> bool:
    """Whether an export's source keeps its routed experts in MXFP4: the weight `source` says so
    (`weights.CheckpointSource.has_mxfp4`), or, without weights, the checkpoint's config.json (`config_json` when
    the caller read it, else `model_or_dir`'s when it is a folder) declares compressed-tensors MXFP4 (the released
    layout, or ours after --keep-mxfp4)."""
    if source is not None:
        return bool(getattr(source, "has_mxfp4", False))
    from k3export.files import CONFIG_NAME, read_config_json

    if config_json is None and isinstance(model_or_dir, (str, os.PathLike)) and (
            Path(model_or_dir).expanduser() / CONFIG_NAME).is_file():
        config_json = read_config_json(Path(model_or_dir).expanduser())
    if config_json is None:
        return False
    from k3export.converters.checkpoints.layouts import check_quantization

    return check_quantization(config_json) is not None


def choose_experts(requested: str | None, keeps: bool | str | None, weights: bool) -> str:
    """The expert format of an export whose source keeps its experts in `keeps` (``"mxfp4"`` / ``"nvfp4"``; True
    means MXFP4, False / None dense): `requested` (``"dense"`` / ``"mxfp4"`` / ``"nvfp4"``), or by default the form
    the source keeps. A quantized form the source does not keep is refused (a graph-only export, ``weights=False``,
    may declare any)."""
    stored = "mxfp4" if keeps is True else keeps or None
    if requested is None:
        return stored or "dense"
    if requested not in EXPERT_FORMATS:
        raise ExportError(f"unknown expert format {requested!r}; choose one of {', '.join(EXPERT_FORMATS)}")
    if requested == "mxfp4" and weights and stored != "mxfp4":
        raise ExportError("--experts mxfp4 needs a checkpoint whose routed experts are MXFP4 (the released Kimi-K3, "
                          f"or ours converted with --keep-mxfp4); this source has {stored or 'dense'} experts: use "
                          f"--experts {stored or 'dense'}")
    if requested == "nvfp4" and weights and stored != "nvfp4":
        raise ExportError("--experts nvfp4 needs a checkpoint whose routed experts are NVFP4 (NVIDIA's Kimi-K3-NVFP4, "
                          f"or the release converted with convert --experts nvfp4); this source has "
                          f"{stored or 'dense'} experts: use --experts {stored or 'dense'}")
    return requested


def resolve_experts(requested: str | None, source: Any, model_or_dir: Any = None,
                    config_json: dict[str, Any] | None = None) -> str:
    """`choose_experts` for a weight `source` (None: a graph-only export) read from `model_or_dir`
    (`stored_experts`)."""
    return choose_experts(requested, stored_experts(source, model_or_dir, config_json), source is not None)


def _expert_domain(model: onnx.ModelProto) -> str | None:
    """The domain of the model's own ``moe_experts`` function, read from the file: running an export must not
    import `k3export.ops` (and with it torch) just to learn the k3 domain."""
    return next((f.domain for f in model.functions if f.name == "moe_experts"), None)


def _expert_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    domain = _expert_domain(model)
    return [n for n in model.graph.node if n.domain == domain and n.op_type == "moe_experts"]


def _act(node: onnx.NodeProto) -> tuple[str, float, float]:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    act = attrs["act"].decode() if isinstance(attrs["act"], bytes) else attrs["act"]
    return act, float(attrs["beta1"]), float(attrs["beta2"])


def _replace_function(model: onnx.ModelProto, fn: onnx.FunctionProto) -> None:
    """Put `fn` in place of the model's ``k3::moe_experts`` function, keeping its doc and default attributes."""
    for i, old in enumerate(model.functions):
        if old.domain == fn.domain and old.name == fn.name:
            fn.doc_string = old.doc_string
            fn.attribute_proto.extend(a for a in old.attribute_proto if a.name not in fn.attribute)
            model.functions[i].CopyFrom(fn)
            return
    model.functions.append(fn)


def use_mxfp4_function(model: onnx.ModelProto, opset: int, form: Any = None, nvfp4: bool = False) -> None:
    """Give a graph built with MXFP4 experts (``K3GraphBuilder.experts = "mxfp4"``) the MXFP4 ``k3::moe_experts``
    body (`bodies.moe_experts_function(mxfp4=True)`) in place of the dense one, written for graph form `form`
    (`forms.graph_form`); `nvfp4`: the NVFP4 body of a graph built with NVFP4 experts (``nvfp4=True``)."""
    from .bodies import moe_experts_function

    form = graph_form(form)
    nodes = _expert_nodes(model)
    if not nodes:
        return
    _replace_function(model, moe_experts_function(nodes[0].domain, *_act(nodes[0]), opset, mxfp4=not nvfp4,
                                                  nvfp4=nvfp4, branches=form.branches, sequences=form.sequences,
                                                  unique=form.unique))


# ---------------------------------------------------------------------------------------------- ONNX Runtime
def ort_expert(b: Body, weight: tuple[str, str], e: str, like: str) -> str:
    """Expert ``e``'s weight [out, in] from the 8-bit form (uint8 [E, out, in], float [E, out, in/32])."""
    q, s = weight
    w = b.op("GatherBlockQuantized", [q, b.op("Unsqueeze", [e, b.const([0])]), s], domain=MS_DOMAIN, bits=8,
             block_size=GROUP_SIZE, gather_axis=0, quantize_axis=2)                        # [1, out, in] fp32
    return b.op("CastLike", [b.op("Squeeze", [w, b.const([0])]), like])


def _ort_experts(b: Body, weight: tuple[str, str], e: str, like: str) -> str:
    """Experts ``e`` (a vector) [S, out, in] from the 8-bit form: the decode path of `moe_experts_nodes`."""
    q, s = weight
    w = b.op("GatherBlockQuantized", [q, e, s], domain=MS_DOMAIN, bits=8, block_size=GROUP_SIZE, gather_axis=0,
             quantize_axis=2)
    return b.op("CastLike", [w, like])


ort_expert.many = _ort_experts  # type: ignore[attr-defined]


def ort_moe_function(act: str, beta1: float, beta2: float, opset: int, domain: str | None = None,
                     block: int = EXPERT_BLOCK) -> onnx.FunctionProto:
    """``k3::moe_experts`` over the 8-bit form (the signature of the MXFP4 one), for ONNX Runtime's CPU provider;
    `domain`: the export's (default: `functions.DOMAIN`); `block`: experts per loop iteration (`expert_block`)."""
    if domain is None:
        from .functions import DOMAIN as domain
    b = Body("")
    pairs = [("w1", "w1_scale"), ("w3", "w3_scale"), ("w2", "w2_scale")]
    b.out(moe_experts_nodes(b, "z", "weights", "indices", *pairs, act, beta1, beta2, expert=ort_expert, block=block),
          "u")
    inputs = ["z", "weights", "indices", "w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"]
    return helper.make_function(domain, "moe_experts", inputs, ["u"], b.nodes,
                                [helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)],
                                attributes=["act", "beta1", "beta2"])


#: the k3 custom-op library's kernel of the MXFP4 experts (`k3export.ops.spec.MOE_EXPERTS_MXFP4`'s name)
PACKED_OP = "moe_experts_mxfp4"
#: its kernel of the NVFP4 experts (`k3export.ops.spec.MOE_EXPERTS_NVFP4`'s name): the 12-input node, retyped
NVFP4_PACKED_OP = "moe_experts_nvfp4"


def packed_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """An MXFP4 export's graph (weights not loaded) as ONNX Runtime runs it with the k3 custom-op library
    (`k3export.runtime.ort_ops`), which reads the experts' bytes at 4.25 bits: each MXFP4 ``k3::moe_experts``
    becomes ``k3::moe_experts_mxfp4`` on the same inputs, and their FLOAT4E2M1 / FLOAT8E8M0 initializers are retyped
    uint8 ([E, out, in/2], [E, out, in/32]; no kernel API takes the 4-bit and E8M0 types) with their external data
    as it is: nothing is converted or written, ORT maps the export's own bytes. The file is not changed, so
    without the library it still runs through `ort_model`. External data stays relative to the export's folder.
    An NVFP4 export's 12-input node becomes ``k3::moe_experts_nvfp4`` the same way (FLOAT4E2M1 and FLOAT8E4M3FN
    retyped uint8, the fp32 global scales as they are: 4.5 bits a weight). A ``moe_experts_mxfp4`` whose slots one
    ``k3::moe_route`` alone gives becomes one ``moe_route_experts_mxfp4`` with it (`fusions.fuse_moe_route_experts`;
    the export keeps the two nodes, which ONNX Runtime's 8-bit form rewrites apart).

    Where the export's dense projections round their inputs to int8 (``MatMulNBits`` at accuracy_level 4,
    ``export --quantize`` with ``--quantize-activations``), the MXFP4 experts do as well
    (``quantize_activations=1``, `k3export.ops.spec.MXFP4_QUANTIZE_ACTIVATIONS`): integer products, as llama.cpp's
    MXFP4 experts take Q8_0 activations."""
    from .fusions import fuse_moe_route_experts

    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = _expert_nodes(out)
    if not nodes:
        return out
    q8 = any(n.op_type == "MatMulNBits" and n.domain == MS_DOMAIN and any(
        a.name == "accuracy_level" and a.i == 4 for a in n.attribute) for n in out.graph.node)
    for t, scale, _ in _ort_form_tensors(out):
        if scale is False:
            t.dims[-1] //= 2
        if scale != "copy":  # NVFP4's fp32 global scales stay fp32
            t.data_type = TensorProto.UINT8
    for node in nodes:
        node.op_type = NVFP4_PACKED_OP if len(node.input) == 12 else PACKED_OP
        if q8 and node.op_type == PACKED_OP:
            node.attribute.append(helper.make_attribute(MXFP4_QUANTIZE_ACTIVATIONS, 1))
    # no node calls the MXFP4 body any more (its Pad on FLOAT4E2M1 would not type-check on uint8)
    keep = [f for f in out.functions if not (f.domain == nodes[0].domain and f.name == "moe_experts")]
    del out.functions[:]
    out.functions.extend(keep)
    fuse_moe_route_experts(out)
    return out


def q8_from_packed(packed: np.ndarray) -> np.ndarray:
    """uint8 MXFP4 bytes [..., n/2] -> the 8-bit form q = 2v + 128, uint8 [..., n]."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    return np.take(Q8_QUAD, packed.view(np.uint16)).view(np.uint8).reshape(*packed.shape[:-1], -1)


def _external(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _set_external(t: TensorProto, location: str, offset: int, length: int) -> None:
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def _e4m3_half() -> np.ndarray:
    """E4M3 byte -> its value / 2 (float32, exact): NVFP4 block scales in the 8-bit form (q - 128 = 2v)."""
    return (e4m3_to_float(np.arange(256, dtype=np.uint8)) / 2).astype(np.float32)


def _convert(src: Path, offset: int, length: int, out, scale: bool | str) -> None:
    """Stream `length` bytes of `src` from `offset` into `out`, as 8-bit values (packed), float scales (E8M0:
    True; ``"e4m3"``: NVFP4's, halved) or as they are (``"copy"``: NVFP4's fp32 global scales)."""
    table = Q8_SCALE if scale is True else _e4m3_half() if scale == "e4m3" else None
    with open(src, "rb") as fh:
        fh.seek(offset)
        left = length
        buf = np.empty(_CHUNK, np.uint8)
        while left:
            n = fh.readinto(memoryview(buf)[: min(_CHUNK, left)])
            if not n:
                raise ExportError(f"{src}: ends before byte {offset + length} (a truncated export)")
            chunk = buf[:n]
            if scale == "copy":
                out.write(chunk.tobytes())
            else:
                out.write(np.take(table, chunk).tobytes() if table is not None else q8_from_packed(chunk).tobytes())
            left -= n


def _ort_form_tensors(model: onnx.ModelProto) -> list[tuple[TensorProto, bool | str, int]]:
    """(initializer, kind, bytes in the 8-bit form) of every quantized input of ``k3::moe_experts``, in order, each
    once: 8-bit values (kind False) take one byte per element (from half a byte), float scales four (from one; E8M0
    True, NVFP4's E4M3 ``"e4m3"``), NVFP4's fp32 global scales (``"copy"``) stay four."""
    inits = {t.name: t for t in model.graph.initializer}
    out: dict[str, tuple[TensorProto, bool | str, int]] = {}
    for node in _expert_nodes(model):
        if len(node.input) not in (9, 12):
            raise ExportError(f"node {node.name}: k3::moe_experts with {len(node.input)} inputs is neither the "
                              "MXFP4 form (9 inputs) nor the NVFP4 form (12)")
        nvfp4 = len(node.input) == 12
        for i, name in enumerate(node.input[3:], start=3):
            # w1, w3, w2, then their scales (and NVFP4's global scales)
            kind: bool | str = False if i < 6 else ("e4m3" if nvfp4 else True) if i < 9 else "copy"
            want = {False: TensorProto.FLOAT4E2M1, True: TensorProto.FLOAT8E8M0, "e4m3": TensorProto.FLOAT8E4M3FN,
                    "copy": TensorProto.FLOAT}[kind]
            t = inits.get(name)
            if name not in out and (t is None or t.data_type != want or t.data_location != TensorProto.EXTERNAL):
                raise ExportError(f"moe_experts input {name!r} is not an external "
                                  f"{TensorProto.DataType.Name(want)} initializer")
            numel = int(np.prod(t.dims))
            out.setdefault(name, (t, kind, numel if kind is False else numel * 4))
    return list(out.values())


def has_nvfp4(model: onnx.ModelProto) -> bool:
    """Whether `model` (weights not loaded) keeps NVFP4 experts: a 12-input ``k3::moe_experts``."""
    return any(len(n.input) == 12 for n in _expert_nodes(model))


def ort_form_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the 8-bit experts `ort_model` writes for `model` (alignment padding aside)."""
    return sum(n for _, _, n in _ort_form_tensors(model))


def ort_form_shards(model: onnx.ModelProto, prefix: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """The names of the shards `ort_model` writes the 8-bit experts of `model` to."""
    tensors = _ort_form_tensors(model)
    return sorted({loc for loc, _ in plan_shards([n for _, _, n in tensors], max_shard_bytes, prefix)})


def ort_model(model: onnx.ModelProto, folder: str | os.PathLike[str], out_dir: str | os.PathLike[str],
              prefix: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              progress: Callable[[int, int], None] | None = None,
              resume_key: str | None = None) -> tuple[onnx.ModelProto, Path]:
    """An MXFP4 export's graph (weights not loaded; its external data lives in `folder`) as ONNX Runtime runs it.

    Every MXFP4 pair feeding ``k3::moe_experts`` is converted, streaming, into the 8-bit form, written to shards
    ``{out_dir}/{prefix}NNNNN`` cut like the export's data shards (`shards.plan_shards`: at K3's size the form is
    ~3.1 TB, which no single file of a Hub repository may hold); the initializers are retyped (uint8
    [E, out, in], float [E, out, in/32]) and point there, the function body becomes `ort_moe_function`, and every
    external-data location is made relative to the returned root folder (the common ancestor of `folder` and
    `out_dir`), to be set as the session's external-data folder (`k3export.runtime.ort_session.FOLDER_KEY`).
    ``progress(bytes written, bytes in all)`` follows it.
    With `resume_key` each finished shard is recorded, and one a run with the same key finished is kept
    (`shards.finished_shard`), as the export's data shards are."""
    folder = Path(folder).resolve()
    out_dir = Path(out_dir).resolve()
    root = Path(os.path.commonpath([folder, out_dir]))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = _expert_nodes(out)
    todo = _ort_form_tensors(out)
    places = plan_shards([n for _, _, n in todo], max_shard_bytes, prefix)

    def write(fh, tensor: tuple[TensorProto, bool | str, int]) -> None:
        t, scale, nbytes = tensor
        ext = _external(t)
        length = nbytes if scale == "copy" else nbytes // 4 if scale else nbytes // 2
        _convert(folder / ext["location"], int(ext.get("offset", 0)), length, fh, scale)

    write_shards(out_dir, [(x, x[2]) for x in todo], places, write, resume_key=resume_key, progress=progress)
    for (t, scale, nbytes), (location, offset) in zip(todo, places):
        t.data_type = TensorProto.FLOAT if scale is not False else TensorProto.UINT8
        _set_external(t, str((out_dir / location).relative_to(root)), offset, nbytes)
    converted = {t.name for t, _, _ in todo}
    for t in out.graph.initializer:
        if t.name not in converted and t.data_location == TensorProto.EXTERNAL:
            ext = _external(t)
            where = (folder / ext["location"]).resolve()
            _set_external(t, str(where.relative_to(root)), int(ext.get("offset", 0)),
                          int(ext["length"]) if "length" in ext else where.stat().st_size)
    if nodes:
        opset = next(o.version for o in out.opset_import if o.domain in ("", "ai.onnx"))
        _, inter, dim = todo[0][0].dims  # the first layer's w1 [E, I, D]
        make = nvfp4_ort_function if len(nodes[0].input) == 12 else ort_moe_function
        _replace_function(out, make(*_act(nodes[0]), opset, domain=nodes[0].domain, block=expert_block(inter, dim)))
        if not any(o.domain == MS_DOMAIN for o in out.opset_import):
            out.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return out, root


def write_ort_form(model: onnx.ModelProto, folder: str | os.PathLike[str], model_file: str, data_prefix: str,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   progress: Callable[[int, int], None] | None = None, resume_key: str | None = None) -> None:
    """Write an MXFP4 export's graph (`model`, external data in `folder`) as ONNX Runtime runs it (`ort_model`)
    into `folder`: `model_file`, its 8-bit experts in shards ``{data_prefix}NNNNN``, every other initializer read
    from the export's own data files. For runtimes that open a graph file and cannot be handed a rewritten graph
    (onnxruntime-genai), and so that ONNX Runtime sessions need not rewrite it each time (`ExportFolder` checks
    it, ``OrtRunner`` runs it); it costs 9 bits per expert weight of disk on top of the export's 4.25."""
    from k3export.artifacts import write_bytes_atomic

    rewritten, _ = ort_model(model, folder, folder, data_prefix, max_shard_bytes, progress, resume_key)
    write_bytes_atomic(folder, model_file, rewritten.SerializeToString())


__all__ = ["EXPERT_FORMATS", "GROUP_SIZE", "PACKED_OP", "choose_experts", "has_mxfp4", "has_nvfp4", "keeps_mxfp4",
           "stored_experts",
           "ort_form_bytes", "ort_form_shards", "ort_model", "ort_moe_function", "packed_model", "q8_from_packed",
           "resolve_experts", "use_mxfp4_function", "write_ort_form"]
