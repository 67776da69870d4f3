"""A saved decode state (``*.k3state``): the carried state of a prefix, the tokens it covers and what it belongs to.

One safetensors file (written and read here, byte for byte the safetensors layout: an 8-byte little-endian header
length, a JSON header, the tensor bytes), never a pickle::

    past_key_values.{i}.{kind}   every state of the export's `StateManifest`, by its name, in its manifest dtype,
                                 shape the manifest's with batch B and past T
    k3state.tokens               int64 [B, T]   the token ids the state covers (pads included)
    k3state.attention_mask       int64 [B, T]   the batch layout: 0 marks a (left) pad
    k3state.logits               float32 [B, vocab], optional: the logits after the last token (the next choice)
    __metadata__ {"format": "k3export.saved_state", "format_version": "1", "export_sha256": ..., "manifest_sha256":
                  ..., "dtype": "float32", "batch": "1", "past": "17", "payload_sha256": ...}

``export_sha256`` names what computed the state (`ExportFolder.identity`, or a checkpoint's / pipeline's identity);
``manifest_sha256`` is the sha256 of the manifest's canonical JSON. ``payload_sha256`` covers the header and every
tensor byte, so a tampered file is refused like a truncated one. `State.load` refuses, in one `ArtifactError` line,
a file that is not exactly this, or that belongs to another export, dtype or manifest; `State.save` writes through
a temporary file and a rename (`write_bytes_atomic`): a reader never sees half a state.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3export.dtypes import dtype as as_dtype
from k3export.files import open_regular
from k3export.safety import write_bytes_atomic

from .codec import ArtifactError, check_sha256, fail

FORMAT = "k3export.saved_state"
VERSION = 1
SUFFIX = ".k3state"
TOKENS, MASK, LOGITS = "k3state.tokens", "k3state.attention_mask", "k3state.logits"
_META_KEYS = ("format", "format_version", "export_sha256", "manifest_sha256", "dtype", "batch", "past",
              "payload_sha256")
#: safetensors' dtype codes of the dtypes a state file holds
_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64"}
_NAMES = {v: k for k, v in _CODES.items()}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the JSON header
_MAX_RANK = 8  # a state tensor is [batch, ...] of rank 4 or 5


def manifest_sha256(manifest: Any) -> str:
    """sha256 of a `StateManifest`'s canonical JSON (what a state file records as ``manifest_sha256``)."""
    return hashlib.sha256(json.dumps(manifest.to_json(), sort_keys=True).encode()).hexdigest()


def _host(x: Any, dtype: str) -> np.ndarray:
    """A state tensor (numpy or torch, any device) as a C-contiguous numpy array of the canonical `dtype`."""
    target = as_dtype(dtype).numpy
    if hasattr(x, "detach"):  # torch: through float32 for bfloat16 (numpy has no torch bfloat16 view)
        import torch

        t = x.detach().cpu()
        x = t.float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()
    return np.ascontiguousarray(np.asarray(x).astype(target, copy=False))


@dataclass
class State:
    """The state of a prefix: `tensors` by manifest name (numpy, manifest dtypes), the `tokens` and `mask`
    [B, T] it covers, the `logits` after its last token (or None) and the identity of what computed it.

    Made by a runner (`Runner.prefill` returns a `StepOutput`; ``out.save(path)`` or ``out.kept()``), read back by
    `State.load`, fed to any runner of the same export (``runner.prefill(new_ids, state)``)."""

    tensors: dict[str, np.ndarray]
    tokens: np.ndarray
    mask: np.ndarray
    export_sha256: str
    manifest_sha256: str
    dtype: str
    logits: np.ndarray | None = None
    #: the file it was read from (None: made in memory)
    path: Path | None = field(default=None, compare=False)

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def past(self) -> int:
        """Tokens the state covers."""
        return int(self.tokens.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the state tensors (what a saved file costs, less its tokens and header)."""
        return int(sum(t.nbytes for t in self.tensors.values()))

    @classmethod
    def capture(cls, manifest: Any, state: dict[str, Any], tokens: np.ndarray, mask: np.ndarray, export_sha256: str,
                logits: Any = None) -> State:
        """A copy of a runner's `state` (numpy or torch) in the manifest's dtypes, checked against `manifest`."""
        tokens = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64))
        mask = np.ascontiguousarray(np.asarray(mask, dtype=np.int64))
        tensors = {}
        for s in manifest.states:
            if s.name not in state:
                raise ArtifactError(f"state {s.name!r} missing from the runner's state: nothing to save")
            tensors[s.name] = _host(state[s.name], s.dtype).copy()
        last = None if logits is None else _host(logits, "float32").copy()
        out = cls(tensors, tokens, mask, export_sha256, manifest_sha256(manifest), manifest.dtype, last)
        out.check(manifest, "the state")
        return out

    def copy(self) -> State:
        """An independent copy (no array shared)."""
        return State({k: v.copy() for k, v in self.tensors.items()}, self.tokens.copy(), self.mask.copy(),
                     self.export_sha256, self.manifest_sha256, self.dtype,
                     None if self.logits is None else self.logits.copy())

    # ------------------------------------------------------------------ checks
    def check(self, manifest: Any, file: Any) -> None:
        """Every tensor the manifest names, of its dtype and shape for this batch and past; tokens and mask agree."""
        if self.tokens.ndim != 2 or self.mask.shape != self.tokens.shape:
            raise fail(file, TOKENS, f"tokens {list(self.tokens.shape)} and attention_mask {list(self.mask.shape)} "
                                     "must both be [batch, past]")
        B, T = self.tokens.shape
        names = {s.name for s in manifest.states}
        extra = sorted(set(self.tensors) - names)
        if extra:
            raise fail(file, extra[0], "is not a state of this export's manifest")
        for s in manifest.states:
            t = self.tensors.get(s.name)
            if t is None:
                raise fail(file, s.name, "missing")
            want = s.concrete_shape(B, T)
            if tuple(t.shape) != want or as_dtype(t.dtype).name != s.dtype:
                raise fail(file, s.name, f"is {as_dtype(t.dtype).name} {list(t.shape)}, the manifest says {s.dtype} "
                                         f"{list(want)} (batch {B}, past {T})")
        if self.logits is not None and (self.logits.ndim != 2 or self.logits.shape[0] != B):
            raise fail(file, LOGITS, f"is {list(self.logits.shape)}, expected [batch {B}, vocab]")

    def check_tokens(self, file: Any, vocab: int | None = None) -> None:
        """The tokens and attention mask as a runner leaves them: token ids in ``[0, vocab)`` (the vocabulary: `vocab`
        when given, else the width of the saved logits); mask values 0 / 1, each row's pads (0) before its tokens
        (left padding), and at least one row without a pad (the batch is padded to its longest row, so a batch of
        one has none). A mask that marked the prefix as padding would silently change what follows."""
        if self.tokens.ndim != 2 or self.mask.shape != self.tokens.shape:
            raise fail(file, TOKENS, f"tokens {list(self.tokens.shape)} and attention_mask {list(self.mask.shape)} "
                                     "must both be [batch, past]")
        width = int(self.logits.shape[-1]) if self.logits is not None and self.logits.ndim == 2 else None
        if vocab is not None and width is not None and width != vocab:
            raise fail(file, LOGITS, f"are {width} wide; the model's vocabulary holds {vocab} tokens")
        limit = vocab if vocab is not None else width
        if self.tokens.size:
            lo, hi = int(self.tokens.min()), int(self.tokens.max())
            if lo < 0 or (limit is not None and hi >= limit):
                bad = lo if lo < 0 else hi
                raise fail(file, TOKENS, f"holds token id {bad}, outside the vocabulary [0, {limit or 'vocab'})")
        if self.mask.size == 0:
            return
        if not np.isin(self.mask, (0, 1)).all():
            raise fail(file, MASK, "holds a value other than 0 (a pad) and 1 (a token)")
        if (np.diff(self.mask, axis=1) < 0).any():
            raise fail(file, MASK, "marks a pad after a token: a row's pads come first (left padding)")
        if not self.mask.all(axis=1).any():
            raise fail(file, MASK, f"pads every row of the batch of {self.batch}: the longest row has no pad (a "
                                   "batch of one none at all)")

    def check_belongs(self, manifest: Any, export_sha256: str, where: str, file: Any = None) -> None:
        """`ArtifactError` (one line) when this state was computed by another export, in another dtype or for
        another manifest than `where`'s."""
        file = file or self.path or "the state"
        if self.dtype != manifest.dtype:
            raise fail(file, "dtype", f"the state was saved in {self.dtype}; {where} runs {manifest.dtype}")
        if self.export_sha256 != export_sha256:
            raise fail(file, "export_sha256", f"the state belongs to another export ({self.export_sha256[:12]}...), "
                                              f"not {where} ({export_sha256[:12]}...)")
        if self.manifest_sha256 != manifest_sha256(manifest):
            raise fail(file, "manifest_sha256", f"the state was saved for another state manifest than {where}'s")
        self.check(manifest, file)

    # ------------------------------------------------------------------ the file
    def _entries(self) -> list[tuple[str, np.ndarray]]:
        out = [(n, self.tensors[n]) for n in self.tensors] + [(TOKENS, self.tokens), (MASK, self.mask)]
        return out + ([(LOGITS, self.logits)] if self.logits is not None else [])

    def to_bytes(self) -> bytes:
        header: dict[str, Any] = {}
        offset = 0
        for name, arr in self._entries():
            header[name] = {"dtype": _CODES[as_dtype(arr.dtype).name], "shape": list(arr.shape),
                            "data_offsets": [offset, offset + arr.nbytes]}
            offset += arr.nbytes
        meta = {"format": FORMAT, "format_version": str(VERSION), "export_sha256": self.export_sha256,
                "manifest_sha256": self.manifest_sha256, "dtype": self.dtype, "batch": str(self.batch),
                "past": str(self.past)}
        data = b"".join(np.ascontiguousarray(a).tobytes() for _, a in self._entries())
        meta["payload_sha256"] = _payload_digest(header, meta, data)
        text = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        return struct.pack("<Q", len(text)) + text + data

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically to `path` (a temporary file renamed over it); returns the path."""
        p = Path(path)
        return write_bytes_atomic(p.parent if str(p.parent) else Path("."), p.name, self.to_bytes())

    @classmethod
    def read(cls, path: str | os.PathLike[str], vocab: int | None = None) -> State:
        """The state file at `path`, strictly read (layout, header, every tensor, the payload digest; its tokens and
        attention mask: `check_tokens`, ids below `vocab` when given), not yet checked against an export (`load`
        does both). The size and header are checked before the tensor bytes are read."""
        p = Path(path)
        fd, size = open_regular(p, "state file", None, ArtifactError)
        with os.fdopen(fd, "rb") as fh:
            head, n = _read_header(fh, p, size)
            meta = _check_meta(head.pop("__metadata__"), p)
            specs, total = _layout(head, p, size - 8 - n)
            data = fh.read(total)
        if len(data) != total:
            raise fail(p, "", f"holds {len(data)} data bytes, its header declares {total}: changed while read")
        if _payload_digest(head, {k: v for k, v in meta.items() if k != "payload_sha256"}, data) != \
                meta["payload_sha256"]:
            raise fail(p, "payload_sha256", "does not match the file's content: the state was changed after it was "
                                            "saved (or is corrupt)")
        arrays = {name: np.frombuffer(data, dtype=dt, count=math.prod(shape), offset=a).reshape(shape)
                  for name, (dt, shape, a) in specs.items()}
        for name in (TOKENS, MASK):
            if name not in arrays or arrays[name].dtype != np.int64:
                raise fail(p, name, "missing (or not int64)")
        tokens, mask, logits = arrays.pop(TOKENS), arrays.pop(MASK), arrays.pop(LOGITS, None)
        if [str(d) for d in tokens.shape] != [meta["batch"], meta["past"]]:
            raise fail(p, TOKENS, f"is {list(tokens.shape)}; the metadata says batch {meta['batch']}, past "
                                  f"{meta['past']}")
        state = cls({k: v.copy() for k, v in arrays.items()}, tokens.copy(), mask.copy(), meta["export_sha256"],
                    meta["manifest_sha256"], meta["dtype"], None if logits is None else logits.copy(), p)
        state.check_tokens(p, vocab)
        return state

    @classmethod
    def load(cls, path: str | os.PathLike[str], export: Any, *, batch: int | None = None) -> State:
        """The state at `path`, checked to belong to `export` (an export folder's path, an `ExportFolder`, or a
        runner: anything with ``manifest`` and ``identity()``); `batch`: the batch it must have."""
        if isinstance(export, (str, os.PathLike)):
            from .export_folder import load_export

            export = load_export(export)
        state = cls.read(path, getattr(export, "vocab_size", None))
        where = str(getattr(export, "root", None) or getattr(export, "name", "this export"))
        state.check_belongs(export.manifest, export.identity(), where)
        if batch is not None and state.batch != batch:
            raise fail(state.path, "batch", f"the state holds batch {state.batch}, expected {batch}")
        return state


def _read_header(fh: Any, p: Path, size: int) -> tuple[dict[str, Any], int]:
    """The JSON header of the state file open as `fh` (`size` bytes) and its length, read without the data."""
    if size < 8:
        raise fail(p, "", f"is {size} bytes: truncated (not a saved state)")
    (n,) = struct.unpack("<Q", fh.read(8))
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise fail(p, "", f"header length {n} runs past the file's {size} bytes: truncated or not a state")
    try:
        head = json.loads(fh.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise fail(p, "", "header is not valid JSON: not a saved state (or tampered)") from None
    if not isinstance(head, dict) or not isinstance(head.get("__metadata__"), dict):
        raise fail(p, "__metadata__", "missing: not a k3export saved state")
    return head, n


def _check_meta(meta: dict[str, Any], p: Path) -> dict[str, str]:
    if meta.get("format") != FORMAT:
        raise fail(p, "format", f"is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("format_version") != str(VERSION):
        raise fail(p, "format_version", f"is {meta.get('format_version')!r}; this k3export reads version {VERSION}")
    if sorted(meta) != sorted(_META_KEYS) or not all(isinstance(v, str) for v in meta.values()):
        raise fail(p, "__metadata__", f"expected exactly the string fields {', '.join(_META_KEYS)}")
    for key in ("export_sha256", "manifest_sha256", "payload_sha256"):
        check_sha256(meta[key], p, key)
    return meta


def _layout(head: dict[str, Any], p: Path, available: int) -> tuple[dict[str, tuple[Any, list[int], int]], int]:
    """name -> (numpy dtype, shape, offset) of every tensor the header declares, and their bytes in all, once each
    follows the previous one and fits in the `available` data bytes (exact integers: a declared ``[2**62, 4]``
    cannot wrap around)."""
    specs: dict[str, tuple[Any, list[int], int]] = {}
    offset = 0
    for name, spec in head.items():
        if not isinstance(spec, dict) or sorted(spec) != ["data_offsets", "dtype", "shape"]:
            raise fail(p, name, "expected {dtype, shape, data_offsets}")
        code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if code not in _NAMES or not isinstance(shape, list) or len(shape) > _MAX_RANK or \
                not all(type(d) is int and d >= 0 for d in shape):
            raise fail(p, name, f"dtype {code!r} / shape {shape!r} is not one a state file holds")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise fail(p, name, f"data_offsets {offsets!r}: expected [begin, end] byte offsets")
        dt = as_dtype(_NAMES[code]).numpy
        size = math.prod(shape) * np.dtype(dt).itemsize
        if size > available - offset:
            raise fail(p, name, f"shape {shape} needs {size} bytes, past the file's {available} data bytes: "
                                "truncated or not a state k3export wrote")
        if offsets != [offset, offset + size]:
            raise fail(p, name, f"data_offsets {offsets} do not follow the previous tensor (expected "
                                f"{[offset, offset + size]})")
        specs[name] = (dt, shape, offset)
        offset += size
    if offset != available:
        raise fail(p, "", f"{available - offset} bytes after the last tensor: not a state k3export wrote")
    return specs, offset


def is_state_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a regular file whose header says it is a k3export saved state (any version): what
    `cache -o` may replace (`k3export.safety.check_output_file`). Reads the header only."""
    try:
        fd, size = open_regular(path, "state file", None, ArtifactError)
    except ArtifactError:
        return False
    with os.fdopen(fd, "rb") as fh:
        try:
            head, _ = _read_header(fh, Path(path), size)
        except (ArtifactError, OSError):
            return False
    return head["__metadata__"].get("format") == FORMAT


def _payload_digest(header: dict[str, Any], meta: dict[str, str], data: bytes) -> str:
    h = hashlib.sha256(json.dumps([meta, header], sort_keys=True).encode())
    h.update(data)
    return h.hexdigest()


__all__ = ["FORMAT", "LOGITS", "MASK", "State", "SUFFIX", "TOKENS", "is_state_file", "manifest_sha256"]
