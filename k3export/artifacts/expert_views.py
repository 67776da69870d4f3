# Copyright 2026 the k3export authors. Apache-2.0.
"""ONNX Runtime's two views of an export's 4-bit routed experts, below the exporter and the runtimes.

An export keeps MXFP4 / NVFP4 experts as the standard types (FLOAT4E2M1 values, FLOAT8E8M0 or FLOAT8E4M3FN block
scales) under ``k3::moe_experts`` (or the fused ``k3::moe_route_experts``), whose bodies crop and dequantise them.
ONNX Runtime 1.32 can do neither on its CPU provider (no FP4 ``Pad``, no E8M0 ``DequantizeLinear``), and its
custom-op API refuses FLOAT8E8M0 inputs ("Type 'tensor(float8e8m0)' ... is invalid", measured), so it runs one of
two views, built here from what the exporter wrote, with no exporter code:

* `packed_view` (with the k3 library, `k3export.runtime.ort_ops`): the same bytes retyped uint8 and the nodes
  named as the library's kernels take them (``moe_experts_mxfp4``, ``moe_experts_nvfp4``,
  ``moe_route_experts_mxfp4``); nothing converted, ORT maps the export's own files (4.25 / 4.5 bits a weight).
* `q8_view` (plain ONNX Runtime): the lossless 8-bit form, q = 2v + 128 (uint8; 2v is an integer in [-12, 12] for
  every E2M1 value v) with float scales (2^(e - 128), or NVFP4's E4M3 value / 2), run by the ``Q8_OVERLOAD``
  overload of the experts' function that the exporter writes beside the 4-bit one (``GatherBlockQuantized``,
  `converters.onnx.mxfp4.ort_moe_function`). The converted bytes (`q8_tensors`, `write_q8_tensor`) go where the
  caller places them: a session's temporary file (`k3export.runtime.ort_session`) or an export's persisted ORT
  form (`converters.onnx.mxfp4.write_ort_form`, for onnxruntime-genai).

Exact: GatherBlockQuantized computes (q - 128) * 2^(e-128) = v * 2^(e-127) in fp32, the value ``DequantizeLinear``
gives, for every scale byte but 255 (E8M0 NaN: the 8-bit form gives inf for |v| >= 1, and 0 for v = 0).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from k3export.dtypes import E2M1_VALUES
from k3export.ops import spec

from .codec import ArtifactError

#: the overload of ``k3::moe_experts`` (and of the fused ``k3::moe_route_experts``) over the 8-bit form
Q8_OVERLOAD = "q8"
#: the experts' ops whose 4-bit inputs the views change: the export's node, and the router fused with it
EXPERTS_OP, ROUTE_EXPERTS_OP = spec.MOE_EXPERTS.name, spec.MOE_ROUTE_EXPERTS.name
#: the k3 library's kernels of the 4-bit experts, on the bytes retyped uint8
MXFP4_OP, NVFP4_OP, ROUTE_MXFP4_OP = (spec.MOE_EXPERTS_MXFP4.name, spec.MOE_EXPERTS_NVFP4.name,
                                      spec.MOE_ROUTE_EXPERTS_MXFP4.name)
MS_DOMAIN = "com.microsoft"
_CHUNK = 1 << 23  # bytes converted per step (the transient is a few times this)

_Q8 = (2 * np.array(E2M1_VALUES) + 128).astype(np.uint32)       # E2M1 code -> q = 2v + 128
_w = np.arange(65536, dtype=np.uint32)
#: two packed bytes (a little-endian uint16: four E2M1 codes) -> their four q bytes (a little-endian uint32)
Q8_QUAD = (_Q8[_w & 15] | _Q8[(_w >> 4) & 15] << 8 | _Q8[(_w >> 8) & 15] << 16 | _Q8[_w >> 12] << 24).astype(np.uint32)
#: E8M0 byte -> the float scale of the 8-bit form, 2^(byte - 128) (half the MXFP4 scale: q - 128 = 2v)
Q8_SCALE = np.exp2(np.arange(256, dtype=np.float64) - 128).astype(np.float32)
del _w


def e4m3_to_float(scale: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes (uint8) -> float32 values (exact)."""
    b = np.asarray(scale, dtype=np.uint8)
    exp, man = ((b >> 3) & 15).astype(np.int32), (b & 7).astype(np.float32)
    mag = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(1 + man / 8, exp - 7)).astype(np.float32)
    mag = np.where((exp == 15) & (man == 7), np.float32(np.nan), mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


#: E4M3 byte -> its value / 2: NVFP4's block scales in the 8-bit form (q - 128 = 2v)
E4M3_HALF = (e4m3_to_float(np.arange(256, dtype=np.uint8)) / 2).astype(np.float32)


def q8_from_packed(packed: np.ndarray) -> np.ndarray:
    """uint8 MXFP4 bytes [..., n/2] -> the 8-bit form q = 2v + 128, uint8 [..., n]."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    return np.take(Q8_QUAD, packed.view(np.uint16)).view(np.uint8).reshape(*packed.shape[:-1], -1)


def is_expert_node(node: onnx.NodeProto) -> bool:
    """Whether `node` is a 4-bit experts' node: ``k3::moe_experts`` of 9 (MXFP4) or 12 (NVFP4) inputs, or
    ``k3::moe_route_experts`` of 9 (the router fused with MXFP4 experts)."""
    return node.domain == spec.NAMESPACE and (node.op_type == EXPERTS_OP and len(node.input) in (9, 12)
                                              or node.op_type == ROUTE_EXPERTS_OP and len(node.input) == 9)


def expert_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The main graph's 4-bit experts' nodes (`is_expert_node`)."""
    return [n for n in model.graph.node if is_expert_node(n)]


class Q8Tensor(NamedTuple):
    """A 4-bit experts' initializer and its 8-bit form: ``kind`` False (values: one byte an element, from half),
    True (E8M0 scales: four bytes from one), ``"e4m3"`` (NVFP4's block scales, halved) or ``"copy"`` (NVFP4's fp32
    global scales, as they are); ``nbytes`` in the 8-bit form."""

    tensor: TensorProto
    kind: bool | str
    nbytes: int

    @property
    def source_bytes(self) -> int:
        return self.nbytes if self.kind == "copy" else self.nbytes // 4 if self.kind else self.nbytes // 2


def q8_tensors(model: onnx.ModelProto) -> list[Q8Tensor]:
    """Every 4-bit input of the experts' nodes (`expert_nodes`), in order, each once."""
    inits = {t.name: t for t in model.graph.initializer}
    out: dict[str, Q8Tensor] = {}
    for node in expert_nodes(model):
        nvfp4 = len(node.input) == 12
        for i, name in enumerate(node.input[3:], start=3):
            # w1, w3, w2, then their scales (and NVFP4's global scales); the fused node's first three are the
            # router's logits and bias and z, the experts' z, weights and indices
            kind: bool | str = False if i < 6 else ("e4m3" if nvfp4 else True) if i < 9 else "copy"
            want = {False: TensorProto.FLOAT4E2M1, True: TensorProto.FLOAT8E8M0, "e4m3": TensorProto.FLOAT8E4M3FN,
                    "copy": TensorProto.FLOAT}[kind]
            t = inits.get(name)
            if name not in out and (t is None or t.data_type != want or t.data_location != TensorProto.EXTERNAL):
                raise ArtifactError(f"{node.op_type} input {name!r} is not an external "
                                    f"{TensorProto.DataType.Name(want)} initializer")
            numel = int(np.prod(t.dims))
            out.setdefault(name, Q8Tensor(t, kind, numel if kind is False else numel * 4))
    return list(out.values())


def _external(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _set_external(t: TensorProto, location: str, offset: int, length: int) -> None:
    """Point initializer `t` at `length` bytes of file `location` from `offset`."""
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def write_q8_tensor(out: BinaryIO, folder: str | os.PathLike[str], item: Q8Tensor) -> None:
    """Stream `item`'s bytes from the export's data files (in `folder`) into `out`, in the 8-bit form."""
    ext = _external(item.tensor)
    src, offset, length = Path(folder) / ext["location"], int(ext.get("offset", 0)), item.source_bytes
    table = Q8_SCALE if item.kind is True else E4M3_HALF if item.kind == "e4m3" else None
    with open(src, "rb") as fh:
        fh.seek(offset)
        left = length
        buf = np.empty(_CHUNK, np.uint8)
        while left:
            n = fh.readinto(memoryview(buf)[: min(_CHUNK, left)])
            if not n:
                raise ArtifactError(f"{src}: ends before byte {offset + length} (a truncated export)")
            chunk = buf[:n]
            if item.kind == "copy":
                out.write(chunk.tobytes())
            else:
                out.write(np.take(table, chunk).tobytes() if table is not None else q8_from_packed(chunk).tobytes())
            left -= n


def has_q8_form(model: onnx.ModelProto) -> bool:
    """Whether the export wrote the 8-bit overload of each 4-bit experts' function its main graph calls."""
    want = {(n.domain, n.op_type) for n in expert_nodes(model)}
    have = {(f.domain, f.name) for f in model.functions if f.overload == Q8_OVERLOAD}
    return want <= have


def q8_view(model: onnx.ModelProto, folder: str | os.PathLike[str], out_dir: str | os.PathLike[str],
            places: list[tuple[str, int]]) -> tuple[onnx.ModelProto, Path]:
    """`model` (weights not loaded, its external data in `folder`) as plain ONNX Runtime runs it: each
    `q8_tensors` entry retyped (uint8 [E, out, in], float scales) and pointed at its place (file under `out_dir`,
    offset) where the caller wrote it (`write_q8_tensor`), the experts' ``Q8_OVERLOAD`` functions in place of the
    4-bit ones (which would not type-check on the retyped initializers), every external-data location made
    relative to the returned root (the common ancestor of `folder` and `out_dir`: the session's external-data
    folder). The export must have the overloads (`has_q8_form`)."""
    folder, out_dir = Path(folder).resolve(), Path(out_dir).resolve()
    root = Path(os.path.commonpath([folder, out_dir]))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    todo = q8_tensors(out)
    for item, (location, offset) in zip(todo, places, strict=True):
        item.tensor.data_type = TensorProto.FLOAT if item.kind is not False else TensorProto.UINT8
        _set_external(item.tensor, str((out_dir / location).relative_to(root)), offset, item.nbytes)
    converted = {item.tensor.name for item in todo}
    for t in out.graph.initializer:
        if t.name not in converted and t.data_location == TensorProto.EXTERNAL:
            ext = _external(t)
            where = (folder / ext["location"]).resolve()
            _set_external(t, str(where.relative_to(root)), int(ext.get("offset", 0)),
                         int(ext["length"]) if "length" in ext else where.stat().st_size)
    # the 8-bit overloads become the functions of their names (ONNX Runtime 1.32 resolves a call by domain and
    # name alone inside a function body: "k3:moe_experts(-1) is not a registered function/op")
    ops = {(n.domain, op) for n in expert_nodes(out) for op in (EXPERTS_OP, ROUTE_EXPERTS_OP)}
    _drop_functions(out, ops, keep=Q8_OVERLOAD)
    for f in out.functions:
        if (f.domain, f.name) in ops:
            f.overload = ""
            for node in f.node:
                node.overload = ""
    if not any(o.domain == MS_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return out, root


def packed_view(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (weights not loaded) as ONNX Runtime runs it with the k3 library: every `q8_tensors` entry but the
    fp32 global scales retyped uint8 (values [E, out, in/2], scales [E, out, in/32]) with its external data as it
    is, and each experts' node named as the library's kernel of it (MXFP4: ``moe_experts_mxfp4``, fused with the
    router ``moe_route_experts_mxfp4``; NVFP4 ``moe_experts_nvfp4``). Where the export's dense projections round
    their inputs to int8 (``MatMulNBits`` at accuracy_level 4, ``export --quantize``), the MXFP4 kernels do as
    well (``quantize_activations=1``): integer products, as llama.cpp's MXFP4 experts take Q8_0 activations."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = expert_nodes(out)
    if not nodes:
        return out
    q8 = any(n.op_type == "MatMulNBits" and n.domain == MS_DOMAIN and any(
        a.name == "accuracy_level" and a.i == 4 for a in n.attribute) for n in out.graph.node)
    for item in q8_tensors(out):
        if item.kind is False:
            item.tensor.dims[-1] //= 2
        if item.kind != "copy":
            item.tensor.data_type = TensorProto.UINT8
    ops = {(n.domain, op) for n in nodes for op in (EXPERTS_OP, ROUTE_EXPERTS_OP)}
    for node in nodes:
        node.op_type = ROUTE_MXFP4_OP if node.op_type == ROUTE_EXPERTS_OP else \
            NVFP4_OP if len(node.input) == 12 else MXFP4_OP
        if q8 and node.op_type != NVFP4_OP:
            node.attribute.append(helper.make_attribute(spec.MXFP4_QUANTIZE_ACTIVATIONS, 1))
    _drop_functions(out, ops)
    return out


def _drop_functions(model: onnx.ModelProto, ops: set[tuple[str, str]], keep: str | None = None) -> None:
    """Remove the functions of `ops` (but those of overload `keep`): no node calls them any more, and their 4-bit
    bodies would not type-check on the retyped initializers."""
    kept = [f for f in model.functions if (f.domain, f.name) not in ops or f.overload == keep]
    del model.functions[:]
    model.functions.extend(kept)


__all__ = ["E4M3_HALF", "EXPERTS_OP", "MXFP4_OP", "NVFP4_OP", "Q8Tensor", "Q8_OVERLOAD", "Q8_QUAD", "Q8_SCALE",
           "ROUTE_EXPERTS_OP", "ROUTE_MXFP4_OP", "e4m3_to_float", "expert_nodes", "has_q8_form", "packed_view",
           "q8_from_packed", "q8_tensors", "q8_view", "write_q8_tensor"]
