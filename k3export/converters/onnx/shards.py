# Copyright 2026 the k3export authors. Apache-2.0.
"""The layout of an export's external data, one rule for every file of it (torch-free: the ONNX Runtime path
imports it): tensors in order, each at a 4 KiB-aligned offset (mmap-friendly), a new shard ``{prefix}NNNNN``
when the next tensor would push the current one past ``max_shard_bytes``; a tensor larger than that gets a shard
of its own. The data shards are ``model.onnx.data.NNNNN`` (`weights`); the 8-bit experts of ONNX Runtime's form
use the same rule (`mxfp4.ort_model`).

A resumable export records each shard it finished under `RESUME_DIR` (`record_shard`: its size and the sha256 of
the bytes written, with the export's resume key); a later run with the same key keeps a shard whose file still
matches (`finished_shard`) instead of writing it again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

ALIGN = 4096
DEFAULT_MAX_SHARD_BYTES = 4 << 30
DATA_PREFIX = "model.onnx.data."


def plan_shards(sizes: list[int], max_shard_bytes: int, prefix: str = DATA_PREFIX) -> list[tuple[str, int]]:
    """(shard file name, offset) of tensors of `sizes` bytes laid out in order by the module's rule."""
    out: list[tuple[str, int]] = []
    shard, pos = 0, 0
    for size in sizes:
        offset = -(-pos // ALIGN) * ALIGN
        if pos > 0 and offset + size > max_shard_bytes:
            shard, offset = shard + 1, 0
        out.append((f"{prefix}{shard:05d}", offset))
        pos = offset + size
    return out


#: where a resumable export records each finished shard (removed before the folder is complete)
RESUME_DIR = ".k3export-resume"


def finished_shard(folder: Path, location: str, key: str) -> bool:
    """Whether a previous run with the same `key` finished shard `location` and its file still matches the record
    (size and sha256)."""
    from k3export.files import file_sha256

    try:
        rec = json.loads((folder / RESUME_DIR / f"{location}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    f = folder / location
    return (isinstance(rec, dict) and rec.get("key") == key and f.is_file() and not f.is_symlink()
            and f.stat().st_size == rec.get("bytes") and file_sha256(f) == rec.get("sha256"))


def record_shard(folder: Path, location: str, key: str, size: int, digest: "hashlib._Hash") -> None:
    """Record shard `location` of `folder` as finished: `size` bytes whose sha256 is `digest` (computed while
    writing, so the file is not read again)."""
    from k3export.safety import write_bytes_atomic

    record = {"key": key, "bytes": size, "sha256": digest.hexdigest()}
    write_bytes_atomic(folder / RESUME_DIR, f"{location}.json", json.dumps(record))


__all__ = ["ALIGN", "DATA_PREFIX", "DEFAULT_MAX_SHARD_BYTES", "RESUME_DIR", "finished_shard", "plan_shards",
           "record_shard"]
