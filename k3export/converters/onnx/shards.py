# Copyright 2026 the k3export authors. Apache-2.0.
"""The layout of an export's external data, one rule for every file of it (torch-free: the ONNX Runtime path
imports it): tensors in order, each at a 4 KiB-aligned offset (mmap-friendly), a new shard ``{prefix}NNNNN``
when the next tensor would push the current one past ``max_shard_bytes``; a tensor larger than that gets a shard
of its own. The data shards are ``model.onnx.data.NNNNN`` (`weights`); the 8-bit experts of ONNX Runtime's form
use the same rule and the same writer (`write_shards`, `mxfp4.write_ort_form`).

A resumable export records each shard it finished under `RESUME_DIR` (`record_shard`: a
`k3export.artifacts.ShardRecord` of its size and the sha256 of the bytes written, with the export's resume key); a
later run with the same key keeps a shard whose file still matches (`finished_shard`) instead of writing it
again."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

from k3export.artifacts import ArtifactError, ResumeRecord, ShardRecord
from k3export.files import shard_name

T = TypeVar("T")

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
        out.append((shard_name(prefix, shard), offset))
        pos = offset + size
    return out


#: where a resumable export records each finished shard (removed before the folder is complete)
RESUME_DIR = ".k3export-resume"


def resume_record(work: Path, name: str, key: str, restart: bool, what: str,
                  error: type[Exception]) -> ResumeRecord | None:
    """The record `name` (under `RESUME_DIR`) of resumable partial folder `work` when a run with the same `key`
    started it: what that run finished may be kept. Otherwise None, with `work` emptied but for its marker; a folder
    in which another key wrote output (another source, changed since, or other options) is refused with `error`
    unless `restart` (--overwrite). Records alone are no output: a run stopped while writing its own first record
    (a signal at once) leaves only them. The caller writes its record (`write_resume_record`) before working."""
    from k3export.safety import MARKER, remove_except

    try:
        record = ResumeRecord.read(work / RESUME_DIR, name)
    except ArtifactError:  # none, or unreadable: as another key's
        record = None
    if record is not None and record.key == key:
        return record
    if not restart and any(p.name not in (MARKER, RESUME_DIR) for p in work.iterdir()):
        raise error(f"{work}: holds an interrupted {what} of another source (or the source changed since, or other "
                    "options); pass --overwrite to discard it and start over")
    remove_except(work, {MARKER})
    return None


def write_resume_record(work: Path, name: str, record: ResumeRecord) -> None:
    record.write(work / RESUME_DIR, name)


def _shard_record(folder: Path, location: str, key: str) -> ShardRecord | None:
    """The record of shard `location` a run with `key` wrote when it finished the shard, or None."""
    try:
        rec = ShardRecord.read(folder / RESUME_DIR, f"{location}.json")
    except ArtifactError:  # none, or unreadable: not finished
        return None
    return rec if rec.key == key else None


def finished_shard(folder: Path, location: str, key: str) -> bool:
    """Whether a previous run with the same `key` finished shard `location` and its file still matches the record
    (size and sha256)."""
    from k3export.files import file_sha256

    rec = _shard_record(folder, location, key)
    f = folder / location
    return (rec is not None and f.is_file() and not f.is_symlink() and f.stat().st_size == rec.bytes
            and file_sha256(f) == rec.sha256)


def recorded_digests(folder: Path, locations: list[str], key: str) -> dict[str, str]:
    """sha256 of each shard of `locations` that a run with `key` recorded as finished (computed while writing;
    the files are not read), by location."""
    records = {loc: _shard_record(folder, loc, key) for loc in locations}
    return {loc: rec.sha256 for loc, rec in records.items() if rec is not None}


def record_shard(folder: Path, location: str, key: str, size: int, digest: "hashlib._Hash") -> None:
    """Record shard `location` of `folder` as finished: `size` bytes whose sha256 is `digest` (computed while
    writing, so the file is not read again)."""
    ShardRecord(key, size, digest.hexdigest()).write(folder / RESUME_DIR, f"{location}.json")


class _Hashing:
    """A binary file that hashes what is written to it (a shard's record then needs no second read)."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.digest = fh, hashlib.sha256()

    def write(self, data: Any) -> None:
        self.digest.update(data)
        self.fh.write(data)

    def tell(self) -> int:
        return self.fh.tell()


def write_shards(folder: Path, items: list[tuple[T, int]], places: list[tuple[str, int]],
                 write: Callable[[Any, T], None], *, resume_key: str | None = None,
                 progress: Callable[[int, int], None] | None = None) -> None:
    """Write `items` ((item, bytes) pairs) at their `places` (`plan_shards`) into `folder`: each shard in order,
    zero padding up to each offset, `write(fh, item)` writing the item's bytes, fsynced. With `resume_key` a shard
    a run with the same key finished is kept (`finished_shard`), each one written is recorded (`record_shard`).
    ``progress(bytes done, bytes in all)`` after each item and each kept shard."""
    shards: dict[str, list[tuple[T, int, int]]] = {}
    for (item, nbytes), (location, offset) in zip(items, places):
        shards.setdefault(location, []).append((item, nbytes, offset))
    total, done = sum(n for _, n in items), 0
    for location, entries in shards.items():
        if resume_key is not None and finished_shard(folder, location, resume_key):
            done += sum(n for _, n, _ in entries)
            if progress is not None:
                progress(done, total)
            continue
        with open(folder / location, "wb") as raw:
            fh = _Hashing(raw)
            for item, nbytes, offset in entries:
                fh.write(b"\0" * (offset - fh.tell()))
                write(fh, item)
                done += nbytes
                if progress is not None:
                    progress(done, total)
            raw.flush()
            os.fsync(raw.fileno())
            size = raw.tell()
        if resume_key is not None:
            record_shard(folder, location, resume_key, size, fh.digest)


__all__ = ["ALIGN", "DATA_PREFIX", "DEFAULT_MAX_SHARD_BYTES", "RESUME_DIR", "finished_shard", "plan_shards",
           "record_shard", "recorded_digests", "resume_record", "write_resume_record", "write_shards"]
