"""Scan a checkpoint folder and plan its conversion, checking everything that headers alone can tell.

`scan_checkpoint` reads ``config.json`` and every shard header, maps each stored name through the layout
table, pairs MXFP4 packed weights with their scales and checks the result against the tensors the config
needs (missing tensor, unexpected tensor, wrong shape, wrong dtype, scales not matching packed weights),
all before a single weight byte is read. `make_plan` then decides the output tensors, their dtypes and a
deterministic assignment to output shards: the tensors owned by each source shard (in file order) are cut
into output shards of at most ``max_shard_bytes``, so that the work for one source shard is a pure function
of (source shard, plan) and the output does not depend on how many workers run it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3export.files import read_json
from k3export.errors import CheckpointError

from .layouts import DENSE, PACKED, SCALE, SKIP, Layout, check_quantization, expected_tensors, keeps_fp32, layout_for
from .mxfp4 import check_mxfp4_pair
from .safetensors_io import DTYPES, FLOAT_DTYPES, SafetensorsFile, open_checkpoint, safe_source_file

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
OUT_DTYPES = {"bf16": "BF16", "bfloat16": "BF16", "fp32": "F32", "float32": "F32"}


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of our model as stored in the source: a dense tensor or an MXFP4 (packed, scale) pair."""

    name: str  # ours
    kind: str  # DENSE or PACKED
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

    @property
    def logical_shape(self) -> tuple[int, ...]:
        if self.kind == PACKED:
            return (self.shape[0], self.shape[1] * 2)
        return self.shape


@dataclass
class Scan:
    src_dir: Path
    config_json: dict[str, Any]
    config: Any  # K3Config
    layout: Layout
    group_size: int | None
    files: dict[str, int]  # shard name -> bytes
    tensors: dict[str, SourceTensor]  # our name -> source
    skipped: dict[str, int]  # group -> count
    skipped_bytes: int
    readers: dict[str, SafetensorsFile] = field(repr=False, default_factory=dict)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def read_config_json(src_dir: Path) -> dict[str, Any]:
    path = safe_source_file(Path(src_dir), "config.json", "config")
    data = read_json(path, CheckpointError, f"config.json in {src_dir}")
    if not isinstance(data, dict):
        raise CheckpointError(f"config.json in {src_dir}: not a JSON object")
    return data


def build_config(config_json: dict[str, Any]) -> Any:
    from k3export.modeling.configuration_k3 import K3Config

    try:
        return K3Config.from_released_dict(config_json)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"config.json: {exc}") from None


def scan_checkpoint(src_dir: str | Path, expected: dict[str, tuple[int, ...]] | None = None) -> Scan:
    """Validate a checkpoint folder at the header level (see the module docstring)."""
    src_dir = Path(src_dir)
    config_json = read_config_json(src_dir)
    layout = layout_for(config_json)
    group_size = check_quantization(config_json)
    config = build_config(config_json)
    readers, located = open_checkpoint(src_dir)
    files = {name: r.path.stat().st_size for name, r in readers.items()}

    skipped: Counter[str] = Counter()
    skipped_bytes = 0
    dense: dict[str, SourceTensor] = {}
    packed: dict[str, tuple[str, str]] = {}
    scales: dict[str, tuple[str, str]] = {}
    for stored, fname in located.items():
        kind, ours, group = layout.classify(stored)
        info = readers[fname].tensors[stored]
        if kind == SKIP:
            skipped[group] += 1
            skipped_bytes += info.nbytes
        elif kind == DENSE:
            if ours in dense:
                raise CheckpointError(f"tensor {ours!r} is stored twice ({dense[ours].stored} in {dense[ours].file} "
                                      f"and {stored} in {fname})")
            dense[ours] = SourceTensor(ours, DENSE, fname, stored, info.dtype, info.shape, info.begin, info.nbytes)
        elif kind == PACKED:
            packed[ours] = (stored, fname)
        elif kind == SCALE:
            scales[ours] = (stored, fname)

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
        if t.kind == DENSE and t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{t.file}: tensor {t.stored!r} has wrong dtype {t.dtype}; expected a float dtype "
                                  f"({', '.join(sorted(FLOAT_DTYPES))})")
        if tuple(t.logical_shape) != tuple(shape):
            what = f"packed {list(t.shape)} = " if t.kind == PACKED else ""
            raise CheckpointError(f"{t.file}: tensor {t.stored!r} has wrong shape {what}{list(t.logical_shape)}; "
                                  f"config.json needs {list(shape)}")
    # Keep the order of `expected` (our canonical order) for anything that iterates over all tensors.
    ordered = {n: tensors[n] for n in expected}
    return Scan(src_dir, config_json, config, layout, group_size, files, ordered, dict(sorted(skipped.items())),
                skipped_bytes, readers)


def _stored_name(layout: Layout, ours: str) -> str:
    prefix = "language_model." if layout.name == "kimi_k3" else ""
    return prefix + ours


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class OutTensor:
    name: str
    op: str  # "cast" (dense, cast to dtype), "decode" (MXFP4 -> dtype), "copy" (bytes as stored)
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    nbytes: int
    src: SourceTensor
    part: str = ""  # for "copy" of an MXFP4 pair: "packed" or "scale"

    @property
    def bytes_in(self) -> int:
        if self.op == "decode":
            return self.src.nbytes + self.src.scale_nbytes
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
            "options": {k: v for k, v in self.options.items() if k in ("dtype", "keep_mxfp4", "max_shard_bytes")},
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
            key = {"cast": "dense", "decode": "expert_mxfp4 -> dense", "copy": "expert_mxfp4 (kept)"}[t.op]
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


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def make_plan(src_dir: str | Path, dtype: str = "bf16", keep_mxfp4: bool = False,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, workers: int = 1, check_finite: bool = False,
              scan: Scan | None = None) -> Plan:
    """Plan a conversion of `src_dir` into our layout (see the module docstring)."""
    if dtype not in OUT_DTYPES:
        raise CheckpointError(f"unknown output dtype {dtype!r}; use one of bf16, fp32")
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max shard size must be positive, got {max_shard_bytes}")
    out_dtype = OUT_DTYPES[dtype]
    own_scan = scan is None
    scan = scan if scan is not None else scan_checkpoint(src_dir)
    try:
        by_file: dict[str, list[OutTensor]] = {name: [] for name in scan.files}
        for t in sorted(scan.tensors.values(), key=lambda t: (t.file, t.begin)):
            if t.kind == PACKED and keep_mxfp4:
                base = t.name.removesuffix(".weight")
                by_file[t.file].append(OutTensor(base + ".weight_packed", "copy", "U8", t.shape, t.nbytes, t,
                                                 "packed"))
                by_file[t.file].append(OutTensor(base + ".weight_scale", "copy", "U8", t.scale_shape or (),
                                                 t.scale_nbytes, t, "scale"))
                continue
            dt = "F32" if keeps_fp32(t.name) else out_dtype
            shape = t.logical_shape
            numel = 1
            for d in shape:
                numel *= d
            by_file[t.file].append(OutTensor(t.name, "decode" if t.kind == PACKED else "cast", dt, shape,
                                             numel * DTYPES[dt][1], t))
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
        shards = [OutShard(shard_name(i, len(pending)), f, tuple(ts)) for i, (f, ts) in enumerate(pending)]
        options = {"dtype": "bf16" if out_dtype == "BF16" else "fp32", "keep_mxfp4": bool(keep_mxfp4),
                   "max_shard_bytes": int(max_shard_bytes), "workers": int(workers),
                   "check_finite": bool(check_finite)}
        return Plan(scan.src_dir, scan.layout.name, scan.config_json, scan.config, options, dict(scan.files), shards,
                    dict(scan.skipped), scan.skipped_bytes)
    finally:
        if own_scan:
            scan.close()


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan summary plus every output shard and tensor (for ``k3export plan --json``)."""
    out = plan.summary()
    out["shards"] = [{"name": s.name, "source": s.source, "bytes": s.nbytes,
                      "tensors": [{"name": t.name, "op": t.op, "dtype": t.dtype, "shape": list(t.shape),
                                   "from": t.src.stored if t.part != "scale" else t.src.scale_stored}
                                  for t in s.tensors]} for s in plan.shards]
    return out


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "OutShard", "OutTensor", "Plan", "Scan", "SourceTensor",
           "build_config", "make_plan", "plan_to_json", "read_config_json", "scan_checkpoint", "shard_name"]
