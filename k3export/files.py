"""Reading the small JSON files every artifact carries, with one clear error for a broken one; a file's digest and
its identity for resume records; the names of a sharded file's pieces."""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from k3export.errors import K3ExportError


def read_json(path: str | os.PathLike[str], error: type[Exception] = K3ExportError, label: str | None = None) -> Any:
    """Parse `path`; a file that is not UTF-8 JSON raises `error` naming it (``label`` or the path)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{label or path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise error(f"{label or path} is nested too deeply to be a JSON file k3export reads") from None


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks into one buffer."""
    h = hashlib.sha256()
    buf = bytearray(1 << 24)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_identity(st: os.stat_result) -> list[int]:
    """What changes whenever a file's content does, read without its bytes: size, modification and change times,
    inode and device (a copy that keeps the mtime, ``cp -p``, still gets a new ctime and inode). Resume records
    compare it, so a source is not hashed again (terabytes at K3's size)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def shard_name(prefix: str, index: int) -> str:
    """The name of piece `index` of a sharded file (``model.onnx.data.00003``)."""
    return f"{prefix}{index:05d}"


def is_shard(name: str, prefix: str) -> bool:
    """Whether `name` is a piece of the sharded file `prefix` (`shard_name`)."""
    return re.fullmatch(re.escape(prefix) + r"\d{5}", name) is not None
