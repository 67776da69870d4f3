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

**In ONNX Runtime** (`k3export.artifacts.expert_views`): its CPU provider reads neither FP4 nor E8M0, so the
export also writes the ``expert_views.Q8_OVERLOAD`` overload of ``k3::moe_experts`` (`ort_moe_function`) over the
lossless 8-bit form (q = 2v + 128, ``GatherBlockQuantized(bits=8, block_size=32)``); a session converts the bytes
into it (`expert_views.q8_view`), or the k3 library reads the 4-bit bytes retyped (`expert_views.packed_view`).
``export --genai`` persists the 8-bit form in the export folder (`write_ort_form`). The measured alternatives are in
``docs/mxfp4.md``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import onnx
from onnx import helper

from k3export.artifacts.expert_views import Q8_OVERLOAD, q8_tensors, q8_view, write_q8_tensor
from k3export.artifacts.graph_forms import EXPERT_BLOCK
from k3export.errors import ExportError

from .bodies import MS_DOMAIN, Body, moe_experts_nodes
from .shards import DEFAULT_MAX_SHARD_BYTES, plan_shards, write_shards
# has_mxfp4 and EXPERT_FORMATS re-exported: their home is artifacts.graph_forms
from .forms import EXPERT_FORMATS, graph_form, has_mxfp4  # noqa: F401
from .nvfp4 import ort_moe_function as nvfp4_ort_function

GROUP_SIZE = 32


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


def _expert_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The main graph's ``k3::moe_experts`` nodes (the domain of the model's own function of that name)."""
    domain = next((f.domain for f in model.functions if f.name == "moe_experts"), None)
    return [n for n in model.graph.node if n.domain == domain and n.op_type == "moe_experts"]


def _act(node: onnx.NodeProto) -> tuple[str, float, float]:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    act = attrs["act"].decode() if isinstance(attrs["act"], bytes) else attrs["act"]
    return act, float(attrs["beta1"]), float(attrs["beta2"])


def _replace_function(model: onnx.ModelProto, fn: onnx.FunctionProto) -> None:
    """Put `fn` in place of the model's function of the same domain, name and overload, keeping its doc and
    default attributes (a new one is appended)."""
    for i, old in enumerate(model.functions):
        if (old.domain, old.name, old.overload) == (fn.domain, fn.name, fn.overload):
            fn.doc_string = old.doc_string
            fn.attribute_proto.extend(a for a in old.attribute_proto if a.name not in fn.attribute)
            model.functions[i].CopyFrom(fn)
            return
    model.functions.append(fn)


def use_mxfp4_function(model: onnx.ModelProto, opset: int, form: Any = None, nvfp4: bool = False,
                       block: int = EXPERT_BLOCK) -> None:
    """Give a graph built with MXFP4 experts (``K3GraphBuilder.experts = "mxfp4"``) the MXFP4 ``k3::moe_experts``
    body (`bodies.moe_experts_function(mxfp4=True)`) in place of the dense one, written for graph form `form`
    (`forms.graph_form`); `nvfp4`: the NVFP4 body of a graph built with NVFP4 experts (``nvfp4=True``). A form that
    keeps functions also gets ONNX Runtime's ``Q8_OVERLOAD`` of it (`ort_moe_function`, `expert_views.q8_view`),
    over `block` experts a loop iteration (`expert_block`)."""
    from .bodies import moe_experts_function

    form = graph_form(form)
    nodes = _expert_nodes(model)
    if not nodes:
        return
    domain, act = nodes[0].domain, _act(nodes[0])
    _replace_function(model, moe_experts_function(domain, *act, opset, mxfp4=not nvfp4, nvfp4=nvfp4,
                                                  branches=form.branches, sequences=form.sequences,
                                                  unique=form.unique))
    if form.functions:
        q8 = (nvfp4_ort_function if nvfp4 else ort_moe_function)(*act, opset, domain=domain, block=block)
        q8.overload = Q8_OVERLOAD
        _replace_function(model, q8)


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


def ort_form_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the 8-bit experts `ort_model` writes for `model` (alignment padding aside)."""
    return sum(item.nbytes for item in q8_tensors(model))


def ort_form_shards(model: onnx.ModelProto, prefix: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """The names of the shards `ort_model` writes the 8-bit experts of `model` to."""
    return sorted({loc for loc, _ in plan_shards([item.nbytes for item in q8_tensors(model)], max_shard_bytes,
                                                 prefix)})


def ort_model(model: onnx.ModelProto, folder: str | os.PathLike[str], out_dir: str | os.PathLike[str],
              prefix: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              progress: Callable[[int, int], None] | None = None,
              resume_key: str | None = None) -> tuple[onnx.ModelProto, Path]:
    """An MXFP4 / NVFP4 export's graph (weights not loaded; its external data lives in `folder`) as ONNX Runtime
    runs it (`expert_views.q8_view`), its 8-bit experts written, streaming, to shards ``{out_dir}/{prefix}NNNNN``
    cut like the export's data shards (`shards.plan_shards`: at K3's size the form is ~3.1 TB, which no single file
    of a Hub repository may hold); returns it and the folder its external data is relative to.
    ``progress(bytes written, bytes in all)`` follows it. With `resume_key` each finished shard is recorded, and
    one a run with the same key finished is kept (`shards.finished_shard`), as the export's data shards are."""
    todo = q8_tensors(model)
    places = plan_shards([item.nbytes for item in todo], max_shard_bytes, prefix)
    write_shards(Path(out_dir), [(item, item.nbytes) for item in todo], places,
                 lambda fh, item: write_q8_tensor(fh, folder, item), resume_key=resume_key, progress=progress)
    return q8_view(model, folder, out_dir, places)


def write_ort_form(model: onnx.ModelProto, folder: str | os.PathLike[str], model_file: str, data_prefix: str,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   progress: Callable[[int, int], None] | None = None, resume_key: str | None = None) -> None:
    """Write an MXFP4 export's graph (`model`, external data in `folder`) as ONNX Runtime runs it (`ort_model`)
    into `folder`: `model_file`, its 8-bit experts in shards ``{data_prefix}NNNNN``, every other initializer read
    from the export's own data files. For runtimes that open a graph file and cannot be handed a rewritten graph
    (onnxruntime-genai), and so that ONNX Runtime sessions need not convert the experts each time (`ExportFolder`
    checks it, ``OrtRunner`` runs it); it costs 9 bits per expert weight of disk on top of the export's 4.25."""
    from k3export.artifacts import write_bytes_atomic

    rewritten, _ = ort_model(model, folder, folder, data_prefix, max_shard_bytes, progress, resume_key)
    write_bytes_atomic(folder, model_file, rewritten.SerializeToString())


__all__ = ["EXPERT_FORMATS", "GROUP_SIZE", "choose_experts", "has_mxfp4", "keeps_mxfp4",
           "stored_experts", "ort_form_bytes", "ort_form_shards", "ort_model", "ort_moe_function",
           "resolve_experts", "use_mxfp4_function", "write_ort_form"]
