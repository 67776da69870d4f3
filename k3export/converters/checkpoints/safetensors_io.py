"""A validating safetensors reader and a streaming writer.

The reader parses the header itself (8-byte little-endian length, then JSON) and checks everything
before any tensor is touched: the header length against the file size, the JSON, each entry's dtype,
shape and ``data_offsets`` (inside the data area, the right number of bytes for the shape). Every
error is a `CheckpointError` naming the file and, when there is one, the tensor. Nothing is ever
unpickled: ``.bin``/``.pt`` files are refused.

The writer streams tensors to disk one by one (no second in-memory copy of a shard), hashes what it
writes (sha256), and only renames the temporary file to its final name once it is complete and flushed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from k3export.errors import CheckpointError
from k3export.files import INDEX_NAME
from k3export.safety import confined_file

logger = logging.getLogger(__name__)

# safetensors dtype names -> (torch dtype, itemsize in bytes)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "U16": (torch.uint16, 2),
    "U32": (torch.uint32, 4),
    "U64": (torch.uint64, 8),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
TORCH_TO_ST: dict[torch.dtype, str] = {v[0]: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
SINGLE_NAME = "model.safetensors"
_UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: where a tensor's bytes are and what they mean."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data area
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


def all_finite(value: torch.Tensor) -> bool:
    """True unless float tensor `value` holds a NaN or an Inf. One min/max pass (NaN propagates through both):
    about 40x faster than ``isfinite().all()`` on CPU, so it can run on every tensor while streaming."""
    if not value.is_floating_point() or value.numel() == 0:
        return True
    lo, hi = torch.aminmax(value.reshape(-1))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def nonfinite_count(value: torch.Tensor) -> int:
    """How many NaN / Inf values float tensor `value` holds (0 after one fast `all_finite` pass when none)."""
    return 0 if all_finite(value) else int((~torch.isfinite(value)).sum())


def nonfinite_note(where: str, stored: str, bad: int) -> str:
    """How every k3export reader names a tensor holding NaN / Inf: `convert` and `export` refuse it with this line
    (plus how to allow it), the Python API loads it with this line as a warning (`warn_nonfinite`)."""
    return f"{where}: tensor {stored!r} has {bad} NaN/Inf values"


class NonFiniteWeightsWarning(UserWarning):
    """A checkpoint tensor holding NaN / Inf was loaded as is (the CLI refuses it without --allow-nonfinite)."""


def warn_nonfinite(where: str, stored: str, bad: int) -> None:
    warnings.warn(f"{nonfinite_note(where, stored, bad)} (loaded as is; k3export convert and export refuse it "
                  "without --allow-nonfinite)", NonFiniteWeightsWarning, stacklevel=3)


class SafetensorsFile:
    """A validated, read-only view of one ``.safetensors`` file.

    ``SafetensorsFile(path)`` parses and checks the header; `read` returns one tensor (a fresh CPU
    tensor owning its memory, read with a single ``readinto``), so that peak memory is one tensor.
    """

    def __init__(self, path: str | os.PathLike[str], display_name: str | None = None) -> None:
        self.path = Path(path)
        self.display = display_name or self.path.name
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._fh: BinaryIO | None = None
        self._parse()

    # ------------------------------------------------------------------ header
    def _fail(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.display}: {msg}")

    def _parse(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise CheckpointError(f"{self.display}: file not found ({self.path})") from None
        if not stat.S_ISREG(st.st_mode):
            raise self._fail("not a regular file (a folder, pipe, socket or device)")
        size = st.st_size
        if size < 8:
            raise self._fail(f"truncated shard: {size} bytes, too short to hold the 8-byte header length")
        with open(self.path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > MAX_HEADER_BYTES:
                raise self._fail(f"corrupted header: header length {header_len} exceeds the "
                                 f"{MAX_HEADER_BYTES}-byte limit (not a safetensors file?)")
            if 8 + header_len > size:
                raise self._fail(f"truncated shard: header says {header_len} header bytes but the file "
                                 f"has only {size - 8} after the length field")
            raw = fh.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._fail(f"corrupted header: not valid UTF-8 JSON ({exc})") from None
        except RecursionError:
            raise self._fail("corrupted header: JSON nested too deeply") from None
        except ValueError as exc:  # integers with too many digits
            raise self._fail(f"corrupted header: {exc}") from None
        if not isinstance(header, dict):
            raise self._fail("corrupted header: the header is not a JSON object")
        self.data_start = 8 + header_len
        self.data_size = size - self.data_start
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._fail("corrupted header: __metadata__ must map strings to strings")
        self.metadata = dict(meta)
        spans: list[tuple[int, int, str]] = []
        for name, entry in header.items():
            info = self._entry(name, entry)
            self.tensors[name] = info
            spans.append((info.begin, info.end, name))
        spans.sort()
        # safetensors stores tensors back to back from the start of the data to the end of the file (its own reader
        # refuses anything else, "invalid offset"): a gap is a removed or edited entry
        prev_end, prev_name = 0, None
        for begin, end, name in spans:
            if begin < prev_end:
                raise self._fail(f"corrupted header: tensor {name!r} overlaps tensor {prev_name!r}")
            if begin > prev_end:
                after = f"after tensor {prev_name!r}" if prev_name else "at the start of the data"
                raise self._fail(f"corrupted header: {begin - prev_end} data bytes {after} belong to no tensor "
                                 f"(tensor {name!r} starts at {begin}); safetensors stores tensors back to back, "
                                 "so an entry is missing from the header")
            prev_end, prev_name = end, name
        if prev_end != self.data_size:
            raise self._fail(f"corrupted header: the last {self.data_size - prev_end} data bytes belong to no tensor "
                             "(safetensors stores tensors back to back to the end of the file, so an entry is "
                             "missing from the header)")

    def _entry(self, name: str, entry: Any) -> TensorInfo:
        if not isinstance(entry, dict):
            raise self._fail(f"corrupted header: entry for tensor {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise self._fail(f"corrupted header: tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise self._fail(f"corrupted header: tensor {name!r} has invalid shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                or offsets[0] > offsets[1]):
            raise self._fail(f"corrupted header: tensor {name!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * DTYPES[dtype][1]
        if end - begin != expected:
            raise self._fail(f"corrupted header: tensor {name!r} ({dtype} {shape}) needs {expected} bytes but "
                             f"data_offsets {offsets} span {end - begin}")
        if end > self.data_size:
            raise self._fail(f"truncated shard or offsets past end: tensor {name!r} data_offsets {offsets} "
                             f"end past the {self.data_size} data bytes in the file")
        return TensorInfo(name, dtype, tuple(shape), begin, end)

    # ------------------------------------------------------------------ data
    def read(self, name: str, finite: bool = False) -> torch.Tensor:
        """Read one tensor into fresh CPU memory; with `finite`, a float tensor holding NaN / Inf is refused."""
        try:
            info = self.tensors[name]
        except KeyError:
            raise self._fail(f"missing tensor {name!r}") from None
        value = self._read(info)
        bad = nonfinite_count(value) if finite else 0
        if bad:
            raise CheckpointError(f"{nonfinite_note(self.display, name, bad)} (refused; --allow-nonfinite reads it "
                                  "anyway)")
        return value

    def _read(self, info: TensorInfo) -> torch.Tensor:
        name = info.name
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        if info.nbytes:
            if self._fh is None:
                self._fh = open(self.path, "rb")  # noqa: SIM115 - closed in close()
            self._fh.seek(self.data_start + info.begin)
            got = self._fh.readinto(memoryview(out.numpy()))
            if got != info.nbytes:
                raise self._fail(f"truncated shard: tensor {name!r} could only read {got} of {info.nbytes} bytes")
        if info.dtype == "BOOL":
            return out.view(torch.bool).reshape(info.shape)
        return out.view(info.torch_dtype).reshape(info.shape)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------- folders
def safe_source_file(src_dir: Path, name: str, what: str = "file") -> Path:
    """``src_dir/name``, refusing names and symlinks that lead outside the source folder, and special files
    (`k3export.safety.confined_file`, refusing with `CheckpointError`)."""
    return confined_file(Path(src_dir), name, what, error=CheckpointError, label="source folder")


MAX_INDEX_BYTES = 256 << 20


def read_index(src_dir: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of ``src_dir``'s index, every shard confined to the folder."""
    path = safe_source_file(src_dir, INDEX_NAME, "index")
    size = path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{INDEX_NAME} in {src_dir}: {size} bytes, too large for an index")
    try:
        index = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{INDEX_NAME} in {src_dir}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{INDEX_NAME} in {src_dir}: not valid JSON ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{INDEX_NAME} in {src_dir}: JSON nested too deeply") from None
    except ValueError as exc:
        raise CheckpointError(f"{INDEX_NAME} in {src_dir}: not valid JSON ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{INDEX_NAME} in {src_dir}: has no 'weight_map' object of tensor name -> file name")
    for name in sorted(set(weight_map.values())):
        if not os.path.lexists(src_dir / name) and not os.path.isabs(name) and ".." not in Path(name).parts:
            example = next(t for t, f in weight_map.items() if f == name)
            raise CheckpointError(f"{INDEX_NAME} names shard {name!r} (e.g. for tensor {example!r}) but "
                                  f"{name} is missing from {src_dir}")
        safe_source_file(src_dir, name, "shard")
    return dict(weight_map)


def list_shards(src_dir: Path) -> tuple[list[str], dict[str, str] | None]:
    """The shard file names of a checkpoint folder and, if it has one, its index's weight map.

    Every shard named by the index must exist (a clear error otherwise); a folder without an index
    uses ``model.safetensors`` or, failing that, every ``*.safetensors`` file.
    """
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise CheckpointError(f"source folder {src_dir} does not exist or is not a folder")
    if os.path.lexists(src_dir / INDEX_NAME):
        weight_map = read_index(src_dir)
        return sorted(set(weight_map.values())), weight_map
    unsafe = sorted(p.name for p in src_dir.iterdir() if p.name.endswith(_UNSAFE_SUFFIXES))
    if os.path.lexists(src_dir / SINGLE_NAME):
        safe_source_file(src_dir, SINGLE_NAME, "shard")
        others = sorted(p.name for p in src_dir.iterdir() if p.name.endswith(".safetensors") and p.name != SINGLE_NAME)
        if others:  # as transformers: without an index the checkpoint is model.safetensors alone; say so
            logger.warning("%s: reading %s only; %s not read (no %s lists %s)", src_dir, SINGLE_NAME,
                           ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else ""),
                           INDEX_NAME, "them" if len(others) > 1 else "it")
        return [SINGLE_NAME], None
    files = sorted(p.name for p in src_dir.iterdir() if p.name.endswith(".safetensors"))
    if not files:
        extra = f" (found pickle-based {unsafe[:3]}, which k3export never loads)" if unsafe else ""
        raise CheckpointError(f"no .safetensors files in {src_dir}{extra}")
    for name in files:
        safe_source_file(src_dir, name, "shard")
    return files, None


def open_checkpoint(src_dir: Path) -> tuple[dict[str, SafetensorsFile], dict[str, str]]:
    """Open and validate every shard; return (file name -> reader, tensor name -> file name).

    With an index, its weight map must agree with the shard headers both ways.
    """
    src_dir = Path(src_dir)
    files, weight_map = list_shards(src_dir)
    readers = {name: SafetensorsFile(src_dir / name, display_name=name) for name in files}
    located: dict[str, str] = {}
    for fname, reader in readers.items():
        for tname in reader.tensors:
            if tname in located:
                raise CheckpointError(f"tensor {tname!r} appears in both {located[tname]} and {fname}")
            located[tname] = fname
    if weight_map is not None:
        for tname, fname in weight_map.items():
            if tname not in readers[fname].tensors:
                raise CheckpointError(f"{INDEX_NAME} says tensor {tname!r} is in {fname}, but {fname} does not "
                                      "contain it (missing tensor)")
        for tname, fname in located.items():
            if tname not in weight_map:
                raise CheckpointError(f"{fname} holds tensor {tname!r}, which {INDEX_NAME} does not list")
    return readers, located


# ---------------------------------------------------------------------- writing
def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.dim() else memoryview(
        t.reshape(1).view(torch.uint8).numpy()).cast("B")


def build_header(entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[int, int]]]:
    """Serialised header (padded to 8 bytes like the reference implementation) and the data offsets."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets = []
    pos = 0
    for name, dtype, shape in entries:
        st = TORCH_TO_ST[dtype]
        numel = 1
        for d in shape:
            numel *= d
        n = numel * DTYPES[st][1]
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets.append((pos, pos + n))
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def write_safetensors(path: str | os.PathLike[str], tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write tensors (in the given order) atomically; return (bytes, sha256) of the file.

    The data goes to ``<path>.tmp-<pid>``, is flushed and fsynced, then renamed over ``path``.
    """
    items = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
    writer = SafetensorsWriter(path, [(n, TORCH_TO_ST[t.dtype], tuple(t.shape)) for n, t in items], metadata)
    try:
        for name, t in items:
            writer.write(name, t)
        return writer.finish()
    except BaseException:
        writer.abort()
        raise


class SafetensorsWriter:
    """Streams one safetensors file whose tensors (name, safetensors dtype, shape) are known up front.

    The header is written first, then each tensor as it arrives (in the announced order, checked), so
    only the tensor being written is in memory. Bytes are hashed (sha256) on the way; `finish` flushes,
    fsyncs and renames ``<path>.tmp-<pid>`` to ``path``; `abort` removes the temporary file.
    While writing, the kernel is asked every ``kick_bytes`` to start writing back what is already in the
    page cache (``posix_fadvise(DONTNEED)`` starts asynchronous writeback and drops clean pages), so the
    disk stays busy during the conversion and the final fsync has little left to wait for.
    """

    def __init__(self, path: str | os.PathLike[str], entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, kick_bytes: int = 64 << 20) -> None:
        header, offsets = build_header(((n, DTYPES[d][0], tuple(s)) for n, d, s in entries),
                                       metadata or {"format": "pt"})
        self.path = Path(path)
        self.tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        self._expected = [(n, d, tuple(s), b - a) for (n, d, s), (a, b) in zip(entries, offsets)]
        self._next = 0
        self._hash = hashlib.sha256()
        self.size = 0
        self._kick_bytes = kick_bytes
        self._kicked = self._kick_from = 0
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self._fh: BinaryIO | None = os.fdopen(fd, "wb", buffering=0)  # closed in finish/abort
        try:
            self._put(header)
        except BaseException:
            self.abort()
            raise

    def _put(self, chunk: memoryview | bytes) -> None:
        assert self._fh is not None
        self._hash.update(chunk)
        view = memoryview(chunk)
        try:
            while view:
                n = self._fh.write(view)
                view = view[n:]
        except OSError as exc:  # a full disk (ENOSPC, EFBIG): name the file, the system does not
            raise OSError(exc.errno, exc.strerror, os.fspath(self.path)) from None
        self.size += len(chunk)
        if self._kick_bytes and self.size - self._kicked >= self._kick_bytes:
            # this window starts its writeback; the window before it (written back by now) leaves the cache
            _fadvise_dontneed(self._fh.fileno(), self._kick_from, self.size - self._kick_from)
            self._kick_from, self._kicked = self._kicked, self.size

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._expected):
            raise RuntimeError(f"internal error: {self.path.name}: unexpected extra tensor {name!r}")
        want_name, want_dtype, want_shape, want_bytes = self._expected[self._next]
        got_dtype = TORCH_TO_ST.get(tensor.dtype)
        if (name, got_dtype, tuple(tensor.shape)) != (want_name, want_dtype, want_shape):
            raise RuntimeError(f"internal error: {self.path.name}: tensor {name!r} {got_dtype} {list(tensor.shape)} "
                               f"does not match the header entry {want_name!r} {want_dtype} {list(want_shape)}")
        data = _tensor_bytes(tensor)
        if len(data) != want_bytes:  # pragma: no cover - implied by dtype and shape
            raise RuntimeError(f"internal error: {self.path.name}: tensor {name!r} has {len(data)} bytes, "
                               f"expected {want_bytes}")
        self._put(data)
        self._next += 1

    def finish(self, before_rename: Callable[[int, str], None] | None = None) -> tuple[int, str]:
        """Complete the file (fsync, rename into place); return (bytes, sha256). ``before_rename(bytes, sha256)``
        runs between the two (a resumable writer records the file there, so that a file in place always has
        its record)."""
        if self._next != len(self._expected):
            missing = self._expected[self._next][0]
            self.abort()
            raise RuntimeError(f"internal error: {self.path.name}: tensor {missing!r} was never written")
        assert self._fh is not None
        try:
            os.fsync(self._fh.fileno())
            _fadvise_dontneed(self._fh.fileno(), 0, self.size)
            self._fh.close()
            self._fh = None
            if before_rename is not None:
                before_rename(self.size, self._hash.hexdigest())
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self.abort()
            if exc.filename not in (None, os.fspath(self.tmp)):  # before_rename's own file: its own name
                raise
            raise OSError(exc.errno, exc.strerror, os.fspath(self.path)) from None
        except BaseException:
            self.abort()
            raise
        return self.size, self._hash.hexdigest()

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.tmp.unlink(missing_ok=True)


def _fadvise_dontneed(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):  # pragma: no cover - platforms without it
        pass


