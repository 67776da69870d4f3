"""Reading the small JSON files every artifact carries, with one clear error for a broken one, and a model folder's
``config.json`` (`read_config_json`, the one reader of it above the modeling package); a file's digest and its
identity for resume records; the names of a sharded file's pieces and of a sharded checkpoint's index."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from k3export.errors import CheckpointError, K3ExportError

#: the index of a sharded safetensors checkpoint (tensor name -> shard), as transformers names it
INDEX_NAME = "model.safetensors.index.json"
#: a model folder's configuration, as transformers names it
CONFIG_NAME = "config.json"


def read_json(path: str | os.PathLike[str], error: type[Exception] = K3ExportError, label: str | None = None) -> Any:
    """Parse `path`; a file that is not UTF-8 JSON raises `error` naming it (``label`` or the path)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{label or path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise error(f"{label or path} is nested too deeply to be a JSON file k3export reads") from None


def open_regular(path: str | os.PathLike[str], what: str, max_bytes: int | None = None,
                 error: type[Exception] = K3ExportError) -> tuple[int, int]:
    """(a read-only descriptor, the size) of `path` once it is a regular file (links followed) of at most
    `max_bytes`; else one `error` line naming it as `what`. Checked on the opened file, before any byte is read: a
    FIFO never blocks the reader, a sparse file of terabytes is never read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: the {what} is not a regular file (a folder, FIFO, socket or device)")
        if max_bytes is not None and st.st_size > max_bytes:
            raise error(f"{path}: the {what} is {st.st_size} bytes, larger than the {max_bytes} one may be")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_text_file(path: str | os.PathLike[str], what: str, max_bytes: int,
                   error: type[Exception] = K3ExportError) -> str:
    """The UTF-8 text of `path` (a chat script, a system prompt), size-checked first (`open_regular`); every
    refusal one `error` line naming the file."""
    fd, _ = open_regular(path, what, max_bytes, error)
    try:
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    if len(raw) > max_bytes:  # grew since it was checked
        raise error(f"{path}: the {what} is larger than the {max_bytes} bytes one may be")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: the {what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_config_json(folder: str | os.PathLike[str], error: type[Exception] = CheckpointError) -> dict[str, Any]:
    """The parsed ``config.json`` of model folder `folder`. Read it once and hand the dict on (`scan_checkpoint`,
    `load_pretrained` and `CheckpointSource` take it as ``config_json``).

    One `error` line when the file is missing, leaves the folder (links resolved) or is not a regular file
    (`k3export.safety.confined_file`), is not UTF-8 JSON, or is not a config k3export reads (`check_config_json`)."""
    from k3export.safety import confined_file

    folder = Path(folder)
    if not os.path.lexists(folder / CONFIG_NAME):
        raise error(f"{folder} is not a K3 / Kimi-Linear model folder: no {CONFIG_NAME}")
    path = confined_file(folder, CONFIG_NAME, "config", error=error, label="model folder")
    return check_config_json(read_json(path, error), folder, error)


def check_config_json(data: Any, folder: str | os.PathLike[str], error: type[Exception] = CheckpointError
                      ) -> dict[str, Any]:
    """`data`, the ``config.json`` of `folder`, when it is a JSON object whose ``model_type`` is one k3export reads
    (`k3export.modeling.configuration_k3.MODEL_TYPES`); else one `error` line. Its fields are the config's to
    check (`K3Config.from_released_dict`)."""
    from k3export.modeling.configuration_k3 import MODEL_TYPES

    if not isinstance(data, dict):
        raise error(f"{Path(folder) / CONFIG_NAME} is not a JSON object")
    if data.get("model_type") not in MODEL_TYPES:
        known = ", ".join(repr(t) for t in MODEL_TYPES[:-1]) + f" or {MODEL_TYPES[-1]!r}"
        raise error(f"{folder} is not a K3 / Kimi-Linear model folder: {CONFIG_NAME} has model_type "
                    f"{data.get('model_type')!r} (k3export reads {known})")
    return data


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
