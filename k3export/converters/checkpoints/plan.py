"""Scan a checkpoint folder and plan its conversion, checking everything that headers alone can tell.

`scan_checkpoint` reads ``config.json`` (`k3export.files.read_config_json`, unless the caller has), refuses a
config that needs more bytes than the shards hold, reads every shard header, maps each stored name through the
layout table, pairs MXFP4 packed weights with their scales and checks the result against the tensors the config
needs (missing tensor, unexpected tensor, wrong shape, wrong dtype, scales not matching packed weights), all before
a single weight byte is read. `make_plan` then decides the output tensors, their dtypes and a
deterministic assignment to output shards: the tensors owned by each source shard (in file order) are cut
into output shards of at most ``max_shard_bytes``, so that the work for one source shard is a pure function
of (source shard, plan) and the output does not depend on how many workers run it.

A source with a MoonViT-V2 vision tower (a ``vision_config`` that `K3VLConfig` reads, every ``vision_tower.*`` /
``mm_projector.*`` tensor present with the shape it needs) is planned image + text: the layout
`K3ForConditionalGeneration.save_pretrained` writes, text tensors under ``language_model.`` (`layouts.TEXT_PREFIX`),
vision tensors under their stored names, cast to the output dtype. ``text_only`` (or a ``vision_config`` that is not
MoonViT-V2's, with a warning) plans the text model alone, the vision tensors skipped and counted per group.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from k3export.dtypes import dtype as dtype_of, dtype_among
from k3export.errors import CheckpointError
from k3export.files import CONFIG_NAME, check_config_json, read_config_json
from k3export.modeling.contract import keeps_fp32

from .layouts import (DENSE, FP8_BLOCK, INPUT_SCALE, NVFP4, PACKED, QSCALE, QSCALE_2, SCALE, SKIP, TEXT_PREFIX, Layout,
                      check_stored_shape, expected_tensors, is_expert, layout_for, quantization_format)
from .mxfp4 import check_mxfp4_pair
from .nvfp4 import check_fp8_block, check_nvfp4
from .safetensors_io import DTYPES, FLOAT_DTYPES, TORCH_TO_ST, SafetensorsFile, open_checkpoint, safe_source_file

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
OUT_DTYPES = ("bfloat16", "float32")  # what convert writes (any spelling of k3export.dtypes)


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of our model as stored in the source: a dense tensor, an MXFP4 (packed, scale) pair, an NVFP4
    expert (weight, weight_scale, weight_scale_2; its input_scale checked and left) or an FP8 block weight
    (weight, weight_scale)."""

    name: str  # ours
    kind: str  # DENSE, PACKED, NVFP4 or FP8_BLOCK
    file: str
    stored: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int
    scale_file: str | None = None
    scale_stored: str | None = None
    scale_shape: tuple[int, ...] | None = None
    scale_nbytes: int = 0
    #: the shape our model has, when the source stores the same values in another layout (`layouts.fit_stored`)
    fitted_shape: tuple[int, ...] | None = None
    #: an NVFP4 expert's ``weight_scale_2`` and ``input_scale`` (file, stored name; 4 bytes each)
    scale2_file: str | None = None
    scale2_stored: str | None = None
    input_file: str | None = None
    input_stored: str | None = None

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The shape of the values as stored (an MXFP4 pair or NVFP4 weight: the dense weight's)."""
        if self.kind in (PACKED, NVFP4):
            return (self.shape[0], self.shape[1] * 2)
        return self.shape

    @property
    def model_shape(self) -> tuple[int, ...]:
        """The shape of the values in our model (`layouts.fit_stored` reads them into it)."""
        return self.fitted_shape or self.logical_shape


@dataclass
class Scan:
    src_dir: Path
    config_json: dict[str, Any]
    config: Any  # K3Config
    layout: Layout
    group_size: int | None  # MXFP4's, else None
    files: dict[str, int]  # shard name -> bytes
    tensors: dict[str, SourceTensor]  # our name -> source
    skipped: dict[str, int]  # group -> count
    skipped_bytes: int
    readers: dict[str, SafetensorsFile] = field(repr=False, default_factory=dict)
    #: the skipped ``vision_tower.*`` / ``mm_projector.*`` tensors, by stored name (an image + text plan carries them)
    vision: dict[str, SourceTensor] = field(default_factory=dict)
    #: `layouts.quantization_format`: "mxfp4", "nvfp4" or None
    quant: str | None = None

    def read_value(self, t: SourceTensor, dtype: Any, finite: bool = False) -> Any:
        """Tensor `t`'s values in torch `dtype` (MXFP4 / NVFP4 / FP8 block weights decoded; a dense tensor as
        stored, `dtype` ignored); with `finite`, NaN / Inf stored weights are refused (a decoded weight is checked
        by the caller)."""
        from .mxfp4 import decode_mxfp4
        from .nvfp4 import decode_fp8_block, decode_nvfp4

        data = self.readers[t.file].read(t.stored, finite=finite and t.kind == DENSE)
        if t.kind == DENSE:
            return data
        scale = self.readers[t.scale_file or t.file].read(t.scale_stored or "")
        where = f"{t.file}: {t.stored.removesuffix('.weight_packed').removesuffix('.weight')}"
        if t.kind == PACKED:
            return decode_mxfp4(data, scale, dtype=dtype, group_size=self.group_size or 32, name=where)
        if t.kind == NVFP4:
            scale_2 = self.readers[t.scale2_file or t.file].read(t.scale2_stored or "")
            return decode_nvfp4(data, scale, scale_2, dtype=dtype, name=where)
        return decode_fp8_block(data, scale, dtype=dtype, name=where)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def build_config(config_json: dict[str, Any], where: str = CONFIG_NAME) -> Any:
    from k3export.modeling.configuration_k3 import K3Config

    try:
        return K3Config.from_released_dict(config_json)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


# ---------------------------------------------------------------------- bytes the config implies
# The config fields behind each kind of parameter (`contract.ParamSpec.kind`), named when that kind does not fit.
_KIND_FIELDS = {
    "moe_routed": ("num_experts", "moe_intermediate_size"), "router": ("num_experts",),
    "embedding": ("vocab_size", "hidden_size"), "lm_head": ("vocab_size", "hidden_size"),
    "dense_mlp": ("intermediate_size", "first_k_dense_replace"), "moe_shared": ("num_shared_experts",
                                                                                "moe_intermediate_size"),
    "kda": ("linear_attn_config",), "mla": ("num_attention_heads", "kv_lora_rank"),
    "moe_latent": ("routed_expert_hidden_size",), "layer_norms": ("hidden_size", "num_hidden_layers"),
}


def min_weight_bytes(config: Any, group_size: int | None, nvfp4: bool = False) -> dict[str, int]:
    """A lower bound of the bytes each kind of parameter occupies on disk: every float tensor at least 2 bytes per
    value (1 in an NVFP4 checkpoint, whose attention may be FP8), a routed expert in MXFP4 (when ``group_size`` is
    set) 1/2 + 1/group_size, in NVFP4 1/2 + 1/16. Computed per layer from the contract's specs, one expert times
    ``num_experts``, so an absurd config costs nothing to price."""
    if nvfp4:
        group_size = 16
    from k3export.modeling.contract import expert_param_specs, head_param_specs, layer_param_specs

    dense = 1 if nvfp4 else min(DTYPES[d][1] for d in FLOAT_DTYPES)
    out: Counter[str] = Counter()
    for spec in head_param_specs(config):
        out[spec.kind] += spec.numel * dense
    for i, mlp in enumerate(config.mlp_types):
        for spec in layer_param_specs(config, i, experts=False):
            out[spec.kind] += spec.numel * dense
        if mlp == "moe":
            numel = config.num_experts * sum(s.numel for s in expert_param_specs(config, i, 0))
            out["moe_routed"] += numel * (group_size + 2) // (2 * group_size) if group_size else numel * dense
    return dict(out)


def check_weight_bytes(src_dir: Path, config: Any, group_size: int | None, files: dict[str, int],
                       nvfp4: bool = False) -> None:
    """Refuse, in one line and before anything is allocated, a config that needs more bytes than the shards hold."""
    need = min_weight_bytes(config, group_size, nvfp4)
    total, have = sum(need.values()), sum(files.values())
    if total <= have:
        return
    kind = max(need, key=need.__getitem__)
    fields = ", ".join(f"{f}={getattr(config, f)!r}" for f in _KIND_FIELDS.get(kind, ()) if f != "linear_attn_config")
    raise CheckpointError(
        f"{src_dir}/config.json: the config needs at least {_size(total)} of weights ({kind} alone "
        f"{_size(need[kind])}{': ' + fields if fields else ''}) but the safetensors files hold {_size(have)}; "
        "refusing before allocating anything")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def scan_checkpoint(src_dir: str | Path, expected: dict[str, tuple[int, ...]] | None = None,
                    config_json: dict[str, Any] | None = None) -> Scan:
    """Validate a checkpoint folder at the header level (see the module docstring).

    ``config_json``: the folder's config.json when the caller has read it already (it is not read again)."""
    src_dir = Path(src_dir)
    if config_json is None:
        config_json = read_config_json(src_dir, CheckpointError)
    else:  # checked as the reader checks it: the caller may have read it without k3export (transformers)
        safe_source_file(src_dir, CONFIG_NAME, "config")
        check_config_json(config_json, src_dir, CheckpointError)
    quant = quantization_format(config_json, src_dir)
    layout = layout_for(config_json, quant)
    group_size = 32 if quant == "mxfp4" else None
    config = build_config(config_json, f"{src_dir}/{CONFIG_NAME}")
    readers, located = open_checkpoint(src_dir)
    scan = Scan(src_dir, config_json, config, layout, group_size,
                {name: r.path.stat().st_size for name, r in readers.items()}, {}, {}, 0, readers, quant=quant)
    try:
        # before anything is sized from the config
        check_weight_bytes(src_dir, config, group_size, scan.files, nvfp4=quant == "nvfp4")
        _match_tensors(scan, located, expected)
    except BaseException:
        scan.close()
        raise
    return scan


def _match_tensors(scan: Scan, located: dict[str, str], expected: dict[str, tuple[int, ...]] | None) -> None:
    """Fill ``scan.tensors`` / ``skipped`` / ``vision`` from the shard headers, checked against the tensors the config
    needs (the vision tensors are checked by `make_plan` when it carries them)."""
    from k3export.modeling.modeling_k3_vision import VISION_PREFIXES

    src_dir, config, layout, group_size, readers = scan.src_dir, scan.config, scan.layout, scan.group_size, scan.readers
    skipped: Counter[str] = Counter()
    skipped_bytes = 0
    dense: dict[str, SourceTensor] = {}
    packed: dict[str, tuple[str, str]] = {}
    scales: dict[str, tuple[str, str]] = {}
    qscales: dict[str, dict[str, tuple[str, str]]] = {QSCALE: {}, QSCALE_2: {}, INPUT_SCALE: {}}
    for stored, fname in located.items():
        kind, ours, group = layout.classify(stored)
        info = readers[fname].tensors[stored]
        if kind == SKIP:
            skipped[group] += 1
            skipped_bytes += info.nbytes
            if stored.startswith(VISION_PREFIXES):
                scan.vision[stored] = SourceTensor(stored, DENSE, fname, stored, info.dtype, info.shape, info.begin,
                                                   info.nbytes)
        elif kind == DENSE:
            if ours in dense:
                raise CheckpointError(f"tensor {ours!r} is stored twice ({dense[ours].stored} in {dense[ours].file} "
                                      f"and {stored} in {fname})")
            dense[ours] = SourceTensor(ours, DENSE, fname, stored, info.dtype, info.shape, info.begin, info.nbytes)
        elif kind == PACKED:
            packed[ours] = (stored, fname)
        elif kind == SCALE:
            scales[ours] = (stored, fname)
        elif kind in qscales:
            qscales[kind][ours] = (stored, fname)
    _pair_modelopt(scan, dense, qscales)

    tensors: dict[str, SourceTensor] = {}
    for ours, (stored, fname) in packed.items():
        if ours not in scales:
            raise CheckpointError(f"missing tensor {stored[: -len('_packed')]}_scale: {stored} in {fname} has no "
                                  "MXFP4 scales")
        if ours in dense:
            raise CheckpointError(f"tensor {ours!r} is stored both dense ({dense[ours].stored}) and MXFP4 ({stored})")
        if group_size is None:
            raise CheckpointError(f"{fname}: tensor {stored} is MXFP4-packed but config.json has no "
                                  "quantization_config")
        s_stored, s_file = scales[ours]
        info, sinfo = readers[fname].tensors[stored], readers[s_file].tensors[s_stored]
        check_mxfp4_pair(stored.removesuffix(".weight_packed"), info.shape, info.dtype, sinfo.shape, sinfo.dtype,
                         where=fname if s_file == fname else f"{fname}/{s_file}", group_size=group_size)
        tensors[ours] = SourceTensor(ours, PACKED, fname, stored, info.dtype, info.shape, info.begin, info.nbytes,
                                     s_file, s_stored, sinfo.shape, sinfo.nbytes)
    for ours, (stored, fname) in scales.items():
        if ours not in packed:
            raise CheckpointError(f"{fname}: tensor {stored} has no matching weight_packed (missing tensor "
                                  f"{stored[: -len('_scale')]}_packed)")
    tensors.update(dense)

    if expected is None:
        expected = expected_tensors(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise CheckpointError(f"missing tensor {_stored_name(layout, missing[0])} (our {missing[0]}) required by "
                              f"config.json; {len(missing)} missing in all in {src_dir}")
    unexpected = [n for n in tensors if n not in expected]
    if unexpected:
        t = tensors[unexpected[0]]
        raise CheckpointError(f"{t.file}: unexpected tensor {t.stored!r}, which config.json does not call for "
                              f"({len(unexpected)} unexpected in all)")
    for name, shape in expected.items():
        t = tensors[name]
        if t.kind == DENSE and t.dtype in ("U8", "F8_E4M3") and scan.quant == "nvfp4":
            raise CheckpointError(f"{t.file}: missing tensor {t.stored.removesuffix('.weight')}.weight_scale: "
                                  f"{t.stored} is {t.dtype} ({'NVFP4' if t.dtype == 'U8' else 'FP8'}) and has no "
                                  "scales")
        if t.kind == DENSE and t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{t.file}: tensor {t.stored!r} has wrong dtype {t.dtype}; expected a float dtype "
                                  f"({', '.join(sorted(FLOAT_DTYPES))})")
        check_stored_shape(name, t.stored, t.logical_shape, tuple(shape), config, t.file,
                           packed=t.shape if t.kind in (PACKED, NVFP4) else None)
        if tuple(t.logical_shape) != tuple(shape):
            tensors[name] = replace(t, fitted_shape=tuple(shape))
    # Keep the order of `expected` (our canonical order) for anything that iterates over all tensors.
    scan.tensors = {n: tensors[n] for n in expected}
    scan.skipped, scan.skipped_bytes = dict(sorted(skipped.items())), skipped_bytes


def _pair_modelopt(scan: Scan, dense: dict[str, SourceTensor], qscales: dict[str, dict[str, tuple[str, str]]]) -> None:
    """Give each weight of a Model-Optimizer checkpoint its scales (in `dense`, by our name): a routed expert with
    ``weight_scale`` becomes `NVFP4` (``weight_scale_2`` and ``input_scale`` required; w1 and w3 of an expert must
    share one ``weight_scale_2``), any other weight with one `FP8_BLOCK`. A scale without its weight, or a missing
    scale, is one line naming the tensor."""
    readers = scan.readers
    for kind in (QSCALE_2, INPUT_SCALE, QSCALE):
        for ours, (stored, fname) in qscales[kind].items():
            base = stored[: -len(kind) - 1]
            if ours not in dense:
                raise CheckpointError(f"{fname}: tensor {stored} has no matching weight (missing tensor {base}.weight)")
            if kind != QSCALE and ours not in qscales[QSCALE]:
                raise CheckpointError(f"{fname}: missing tensor {base}.weight_scale ({stored} has no block scales "
                                      "beside it)")

    def info(pair: tuple[str, str]) -> Any:
        return readers[pair[1]].tensors[pair[0]]

    for ours, (stored, fname) in qscales[QSCALE].items():
        w = dense[ours]
        base = stored.removesuffix(".weight_scale")
        sinfo = info((stored, fname))
        where = fname if fname == w.file else f"{w.file}/{fname}"
        if not is_expert(ours):
            extra = qscales[QSCALE_2].get(ours) or qscales[INPUT_SCALE].get(ours)
            if extra is not None:
                raise CheckpointError(f"{extra[1]}: unexpected tensor {extra[0]!r}: only NVFP4 routed experts have "
                                      "weight_scale_2 / input_scale")
            check_fp8_block(base, (w.dtype, w.shape), (sinfo.dtype, sinfo.shape), where)
            dense[ours] = replace(w, kind=FP8_BLOCK, scale_file=fname, scale_stored=stored, scale_shape=sinfo.shape,
                                  scale_nbytes=sinfo.nbytes)
            continue
        parts = {}
        for kind in (QSCALE_2, INPUT_SCALE):
            if ours not in qscales[kind]:
                raise CheckpointError(f"{fname}: missing tensor {base}.{kind} (NVFP4 expert {base} has a weight_scale)")
            parts[kind] = qscales[kind][ours]
        i2, ii = info(parts[QSCALE_2]), info(parts[INPUT_SCALE])
        check_nvfp4(base, (w.dtype, w.shape), (sinfo.dtype, sinfo.shape), (i2.dtype, i2.shape), (ii.dtype, ii.shape),
                    where)
        dense[ours] = replace(w, kind=NVFP4, scale_file=fname, scale_stored=stored, scale_shape=sinfo.shape,
                              scale_nbytes=sinfo.nbytes + i2.nbytes + ii.nbytes, scale2_file=parts[QSCALE_2][1],
                              scale2_stored=parts[QSCALE_2][0], input_file=parts[INPUT_SCALE][1],
                              input_stored=parts[INPUT_SCALE][0])
    _check_global_scales(scan, dense)


def _check_global_scales(scan: Scan, dense: dict[str, SourceTensor]) -> None:
    """Every NVFP4 ``weight_scale_2`` finite and positive, and an expert's w1 and w3 holding the same one (they
    feed one fused GEMM in the engines that read this layout): 4 bytes read each."""
    values: dict[str, float] = {}
    for ours, t in dense.items():
        if t.kind != NVFP4:
            continue
        v = float(scan.readers[t.scale2_file or t.file].read(t.scale2_stored or "").reshape(()))
        if not (v > 0 and v < float("inf")):
            raise CheckpointError(f"{t.scale2_file}: tensor {t.scale2_stored!r} is {v}; an NVFP4 weight_scale_2 is "
                                  "a positive finite fp32")
        values[ours] = v
    for ours, v in values.items():
        if ".w1.weight" not in ours:
            continue
        mate = ours.replace(".w1.weight", ".w3.weight")
        if mate in values and values[mate] != v:
            t, m = dense[ours], dense[mate]
            raise CheckpointError(f"{m.scale2_file}: tensor {m.scale2_stored!r} is {values[mate]!r} but "
                                  f"{t.scale2_stored!r} is {v!r}: an expert's w1 and w3 share one weight_scale_2")


def _stored_name(layout: Layout, ours: str) -> str:
    prefix = TEXT_PREFIX if layout.name.startswith("kimi_k3") else ""
    return prefix + ours


def vision_of(scan: Scan) -> Any:
    """The `K3VLConfig` of a source whose vision tower k3export carries, or None for a text-only source.

    A ``vision_config`` that is not MoonViT-V2's warns and gives None (the text model converts alone, as it exports
    alone). One with a missing, unexpected, misshapen or non-float vision tensor is refused in one line
    (`check_vision_tensors`, from the headers)."""
    from k3export.modeling.configuration_k3 import K3ConfigError, K3VLConfig
    from k3export.modeling.modeling_k3 import K3CheckpointError
    from k3export.modeling.modeling_k3_vision import check_vision_tensors

    if not isinstance(scan.config_json.get("vision_config"), dict):
        return None
    try:
        vl = K3VLConfig.from_released_dict(scan.config_json)
    except (K3ConfigError, TypeError, ValueError) as exc:
        warnings.warn(f"{scan.src_dir}/{CONFIG_NAME}: {exc}; converting the text model alone", stacklevel=3)
        return None
    try:
        where = check_vision_tensors(str(scan.src_dir), vl)
    except K3CheckpointError as exc:
        raise CheckpointError(f"{exc} (--text-only converts the text model alone)") from None
    unread = sorted(set(where) - set(scan.vision))
    if unread:  # an index that maps a vision tensor to a shard the scan did not read it from
        raise CheckpointError(f"{scan.src_dir}: vision tensor {unread[0]!r} is not where the shard headers put it")
    return vl


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class OutTensor:
    name: str
    op: str  # "cast" (dense, cast to dtype), "decode" (MXFP4 / NVFP4 / FP8 block -> dtype), "copy" (bytes as stored)
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    nbytes: int
    src: SourceTensor
    part: str = ""  # "copy" of an MXFP4 pair: "packed" or "scale"; "nvfp4" (the cast): the NVFP4 suffix written
    group: str = ""  # for a carried vision tensor: "vision_tower" or "mm_projector" (its plan row)
    mate: SourceTensor | None = None  # "nvfp4": the MXFP4 expert sharing weight_scale_2 (w1's w3, w3's w1)

    @property
    def bytes_in(self) -> int:
        if self.op == "decode":
            return self.src.nbytes + self.src.scale_nbytes
        if self.op == "nvfp4":
            return {"weight": self.src.nbytes, "weight_scale": self.src.scale_nbytes}.get(self.part, 0)
        if self.part == "scale":
            return self.src.scale_nbytes
        return self.src.nbytes


@dataclass(frozen=True)
class OutShard:
    name: str
    source: str  # the source shard whose work unit writes it
    tensors: tuple[OutTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class Plan:
    src_dir: Path
    layout: str
    config_json: dict[str, Any]
    config: Any
    options: dict[str, Any]
    source_files: dict[str, int]
    shards: list[OutShard]
    skipped: dict[str, int]
    skipped_bytes: int
    #: the `K3VLConfig` of an image + text plan (vision tensors carried), None for a text-only one
    vision: Any = None

    @property
    def tensors(self) -> list[OutTensor]:
        return [t for s in self.shards for t in s.tensors]

    @property
    def bytes_in(self) -> int:
        return sum(self.source_files.values())

    @property
    def bytes_out(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def units(self) -> dict[str, list[OutShard]]:
        """Work units: source shard -> the output shards it writes (every source shard has a unit)."""
        units: dict[str, list[OutShard]] = {name: [] for name in self.source_files}
        for s in self.shards:
            units[s.source].append(s)
        return units

    def fingerprint(self) -> str:
        """A hash of everything that determines the output bytes (names, ops, dtypes, shapes, sharding)."""
        payload = {
            "layout": self.layout,
            "options": {k: v for k, v in self.options.items()
                        if k in ("dtype", "keep_mxfp4", "max_shard_bytes", "experts")},
            "sources": self.source_files,
            "shards": [[s.name, s.source, [[t.name, t.op, t.dtype, list(t.shape), t.src.file, t.src.stored, t.part]
                                           for t in s.tensors]] for s in self.shards],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def summary(self) -> dict[str, Any]:
        """Tensors by kind, bytes in/out, predicted peak memory and disk, skipped tensors."""
        kinds: dict[str, dict[str, int]] = {}
        largest_work = 0
        for t in self.tensors:
            key = t.group or (_DECODED[t.src.kind] if t.op == "decode" else "expert_mxfp4 -> nvfp4"
                              if t.op == "nvfp4" else "dense (as stored)" if t.op == "copy" and not t.part else
                              {"cast": "dense", "copy": "expert_mxfp4 (kept)"}[t.op])
            k = kinds.setdefault(key, {"tensors": 0, "bytes_in": 0, "bytes_out": 0})
            k["tensors"] += 1
            k["bytes_in"] += t.bytes_in
            k["bytes_out"] += t.nbytes
            # decode works on int32 indices (4 bytes per packed byte) plus the output values
            work = t.bytes_in + t.nbytes + (4 * t.src.nbytes if t.op == "decode" else 0)
            largest_work = max(largest_work, work)
        largest_shard = max((s.nbytes for s in self.shards), default=0)
        workers = int(self.options.get("workers", 1))
        return {
            "source": str(self.src_dir),
            "layout": self.layout,
            "vision": self.vision is not None,
            "source_files": len(self.source_files),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "tensors_out": len(self.tensors),
            "output_shards": len(self.shards),
            "by_kind": kinds,
            "skipped": dict(self.skipped),
            "skipped_bytes": self.skipped_bytes,
            "workers": workers,
            "peak_memory_bytes": workers * (largest_shard + largest_work),
            "disk_bytes": self.bytes_out,
            "options": dict(self.options),
        }


#: a decoded source tensor's row in `Plan.summary`, by its kind
_DECODED = {PACKED: "expert_mxfp4 -> dense", NVFP4: "expert_nvfp4 -> dense", FP8_BLOCK: "fp8_block -> dense"}


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _out_dtype(value: str) -> str:
    """The safetensors dtype code that convert writes for `value` (bf16, float32, ...), else a clear error."""
    d = dtype_among(value, OUT_DTYPES)
    if d is None:
        raise CheckpointError(f"unknown output dtype {value!r}; use one of bf16, fp32")
    return TORCH_TO_ST[d.torch]


#: what ``convert --experts`` makes of the routed experts
EXPERT_FORMATS = ("dense", "mxfp4", "nvfp4")


def make_plan(src_dir: str | Path, dtype: str = "bf16", keep_mxfp4: bool = False,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, workers: int = 1, check_finite: bool = False,
              scan: Scan | None = None, text_only: bool = False, experts: str | None = None) -> Plan:
    """Plan a conversion of `src_dir` into our layout, image + text when it has a vision tower k3export carries and
    not `text_only` (see the module docstring). `experts`: ``"dense"`` (decoded, the default), ``"mxfp4"`` (kept
    packed; `keep_mxfp4` says the same) or ``"nvfp4"``: the MXFP4 release cast to NVIDIA's NVFP4 layout
    (`nvfp4_plan`)."""
    out_dtype = _out_dtype(dtype)
    experts = experts or ("mxfp4" if keep_mxfp4 else "dense")
    if experts not in EXPERT_FORMATS:
        raise CheckpointError(f"unknown expert format {experts!r}; choose one of {', '.join(EXPERT_FORMATS)}")
    keep_mxfp4 = experts == "mxfp4"
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max shard size must be positive, got {max_shard_bytes}")
    own_scan = scan is None
    scan = scan if scan is not None else scan_checkpoint(src_dir)
    try:
        if experts == "nvfp4":
            return nvfp4_plan(scan, max_shard_bytes, workers, check_finite, text_only)
        vision = None if text_only else vision_of(scan)
        carried = list(scan.vision.values()) if vision is not None else []
        prefix = TEXT_PREFIX if vision is not None else ""  # K3ForConditionalGeneration keeps the text model there
        by_file: dict[str, list[OutTensor]] = {name: [] for name in scan.files}
        for t in sorted([*scan.tensors.values(), *carried], key=lambda t: (t.file, t.begin)):
            if t.kind == PACKED and keep_mxfp4:
                base = prefix + t.name.removesuffix(".weight")
                by_file[t.file].append(OutTensor(base + ".weight_packed", "copy", "U8", t.shape, t.nbytes, t,
                                                 "packed"))
                by_file[t.file].append(OutTensor(base + ".weight_scale", "copy", "U8", t.scale_shape or (),
                                                 t.scale_nbytes, t, "scale"))
                continue
            group = t.stored.split(".", 1)[0] if t.stored in scan.vision else ""  # a carried vision tensor
            dt = "F32" if not group and keeps_fp32(t.name) else out_dtype
            shape = t.model_shape
            numel = 1
            for d in shape:
                numel *= d
            by_file[t.file].append(OutTensor(t.name if group else prefix + t.name,
                                             "decode" if t.kind in _DECODED else "cast", dt, shape,
                                             numel * DTYPES[dt][1], t, group=group))
        shards = _cut_shards(by_file, max_shard_bytes)
        options = {"dtype": dtype_of(DTYPES[out_dtype][0]).short, "keep_mxfp4": bool(keep_mxfp4),
                   "max_shard_bytes": int(max_shard_bytes), "workers": int(workers),
                   "check_finite": bool(check_finite), "vision": vision is not None}
        skipped = Counter(scan.skipped)
        skipped.subtract(Counter(t.stored.split(".", 1)[0] for t in carried))
        return Plan(scan.src_dir, scan.layout.name, scan.config_json, scan.config, options, dict(scan.files), shards,
                    {g: n for g, n in skipped.items() if n > 0},
                    scan.skipped_bytes - sum(t.nbytes for t in carried), vision)
    finally:
        if own_scan:
            scan.close()


def _cut_shards(by_file: dict[str, list[OutTensor]], max_shard_bytes: int) -> list[OutShard]:
    """Each source shard's output tensors, in order, cut into output shards of at most `max_shard_bytes`."""
    pending: list[tuple[str, list[OutTensor]]] = []
    for fname in sorted(by_file):
        current: list[OutTensor] = []
        size = 0
        for ot in by_file[fname]:
            if current and size + ot.nbytes > max_shard_bytes:
                pending.append((fname, current))
                current, size = [], 0
            current.append(ot)
            size += ot.nbytes
        if current:
            pending.append((fname, current))
    return [OutShard(shard_name(i, len(pending)), f, tuple(ts)) for i, (f, ts) in enumerate(pending)]


#: the tensors of an NVFP4 expert, in the order NVIDIA's release stores them
NVFP4_PARTS = (("weight", "U8"), ("weight_scale", "F8_E4M3"), ("weight_scale_2", "F32"), ("input_scale", "F32"))


def nvfp4_plan(scan: Scan, max_shard_bytes: int, workers: int, check_finite: bool, text_only: bool) -> Plan:
    """The plan of ``convert --experts nvfp4``: the MXFP4 release rewritten in NVIDIA's NVFP4 layout (the layout
    ``nvidia/Kimi-K3-NVFP4`` has, so the engines that load it load this): every tensor under its stored name, the
    non-expert tensors byte for byte (vision tower included), each MXFP4 expert cast (`nvfp4.cast_mxfp4`: w1 and w3
    of an expert share ``weight_scale_2``) into ``weight``, ``weight_scale``, ``weight_scale_2`` and ``input_scale``
    (1.0: weight-only, nothing calibrated)."""
    if scan.quant != "mxfp4":
        raise CheckpointError(f"{scan.src_dir}: --experts nvfp4 casts MXFP4 routed experts (the released Kimi-K3); "
                              f"this source's are {'NVFP4 already' if scan.quant == 'nvfp4' else 'dense'}")
    if text_only:
        raise CheckpointError("--experts nvfp4 writes NVIDIA's layout, which keeps the vision tower: drop "
                              "--text-only")
    by_file: dict[str, list[OutTensor]] = {name: [] for name in scan.files}
    for t in sorted([*scan.tensors.values(), *scan.vision.values()], key=lambda t: (t.file, t.begin)):
        if t.kind != PACKED:
            group = t.stored.split(".", 1)[0] if t.stored in scan.vision else ""
            by_file[t.file].append(OutTensor(t.stored, "copy", t.dtype, t.shape, t.nbytes, t, group=group))
            continue
        base = t.stored.removesuffix(".weight_packed")
        mate = None
        for a, b in ((".w1.weight", ".w3.weight"), (".w3.weight", ".w1.weight")):
            if t.name.endswith(a):
                mate = scan.tensors.get(t.name[: -len(a)] + b)
        out_f, half_in = t.shape
        shapes = {"weight": (out_f, half_in), "weight_scale": (out_f, 2 * half_in // 16), "weight_scale_2": (),
                  "input_scale": ()}
        for part, dt in NVFP4_PARTS:
            shape = shapes[part]
            numel = 1
            for d in shape:
                numel *= d
            by_file[t.file].append(OutTensor(f"{base}.{part}", "nvfp4", dt, shape, numel * DTYPES[dt][1], t, part,
                                             mate=mate))
    shards = _cut_shards(by_file, max_shard_bytes)
    options = {"dtype": "as stored", "keep_mxfp4": False, "experts": "nvfp4", "max_shard_bytes": int(max_shard_bytes),
               "workers": int(workers), "check_finite": bool(check_finite), "vision": bool(scan.vision)}
    return Plan(scan.src_dir, scan.layout.name, scan.config_json, scan.config, options, dict(scan.files), shards, {},
                0, None)


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan summary plus every output shard and tensor (for ``k3export plan --json``)."""
    from k3export.info import weight_bytes_by_form

    out = plan.summary()
    out["weight_bytes_by_form"] = {name: n for name, n, _ in weight_bytes_by_form(plan.config).rows()}
    out["shards"] = [{"name": s.name, "source": s.source, "bytes": s.nbytes,
                      "tensors": [{"name": t.name, "op": t.op, "dtype": t.dtype, "shape": list(t.shape),
                                   "from": t.src.stored if t.part != "scale" else t.src.scale_stored}
                                  for t in s.tensors]} for s in plan.shards]
    return out


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "EXPERT_FORMATS", "NVFP4_PARTS", "OutShard", "OutTensor", "Plan", "Scan",
           "SourceTensor", "build_config", "check_weight_bytes", "make_plan", "min_weight_bytes", "nvfp4_plan",
           "plan_to_json", "scan_checkpoint", "shard_name", "vision_of"]
