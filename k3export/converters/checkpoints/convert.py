"""Streaming, resumable, atomic conversion of a released K3 / Kimi-Linear folder into our layout.

A source with a MoonViT-V2 vision tower converts image + text: the layout `K3ForConditionalGeneration.save_pretrained`
writes (text tensors under ``language_model.``, vision tensors cast, the processor files carried; `plan.make_plan`
decides), through the same units, records and locks as a text conversion; ``text_only`` writes the text model alone.

Work is cut into units, one per source shard: `convert_unit` reads that shard once, front to back
(hashing every byte for the manifest), turns its tensors into output tensors (cast, MXFP4 decode or byte
copy) and writes the output shards the plan assigns to it. A unit is a pure function of (source shard,
plan), so units run in any order, in any number of processes (or, later, machines), and produce the same
bytes. Inside a unit, reading, decoding, writing and fsyncing overlap in threads (see "the unit's
pipeline" below); output shards are streamed tensor by tensor, so peak memory per unit is the pipeline's
queue budgets plus a few tensors, whatever the output shard size. Every weight and MXFP4 scale is checked
for NaN / Inf on the way (``allow_nonfinite`` opts out).

The output is built in ``.OUT.partial`` beside OUT (`k3export.safety.output_folder`: locked, marked, renamed
into place only when complete). Every output shard is written under a temporary name and renamed when
complete; a record of its size and sha256, and of the source bytes it came from (the sha256 of the source
shard's prefix up to its last tensor, and of the MXFP4 scales it used), then goes to ``.k3export-partial/``.
A re-run with the same plan continues in that folder: it skips every shard whose file still matches its
record once the source is shown unchanged (a finished source shard by its recorded sha256, computed while it
was read; an unfinished one by the prefix and scale digests as it is read again). A changed source is refused,
naming the shard; the partial output is never mixed with it.

Long file: the conversion's one streaming pipeline (plan, per-shard workers, resume records, locks, signals)
reads best in one place.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import datetime as _dt
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from k3export import __version__, switches
from k3export.artifacts import ConversionRecord, ConversionSource, FileDigest
from k3export.dtypes import dtype as dtype_of
from k3export.errors import CheckpointError, K3ExportError
from k3export.files import CONFIG_NAME, INDEX_NAME, file_identity, file_sha256, read_config_json
from k3export.safety import CHECKPOINT, MARKER, output_folder, partial_path, write_json_report

from .layouts import HF_QUANT_CONFIG, NVFP4, PACKED, fit_stored
from .mxfp4 import decode_mxfp4
from .nvfp4 import (cast_exponent, cast_mxfp4, cast_scales, decode_fp8_block, decode_nvfp4, modelopt_configs,
                    modelopt_quantization)
from .plan import DEFAULT_MAX_SHARD_BYTES, OutShard, OutTensor, Plan, make_plan
from .safetensors_io import DTYPES, SafetensorsFile, SafetensorsWriter, safe_source_file
from .safetensors_io import _tensor_bytes, nonfinite_count, nonfinite_note

logger = logging.getLogger(__name__)

STATE_DIR = ".k3export-partial"
MANIFEST_NAME = ConversionRecord.FILE
_SHARD_RX = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# files copied through from the source folder (tokenizer and friends)
_PASSTHROUGH_RX = re.compile(r"(tokenizer.*|tiktoken\.model|.*\.tiktoken|special_tokens_map\.json|added_tokens\.json"
                             r"|vocab\..*|merges\.txt|chat_template\..*|tokenization_.*\.py)")


class ConversionInterrupted(K3ExportError):
    """The conversion stopped before the end (on request or because a worker died); re-run it to resume."""


class SourceChanged(CheckpointError):
    """A source shard differs from the one an interrupted conversion already converted: resuming would mix them."""


def _source_changed(source: str, partial: str | Path, how: str) -> SourceChanged:
    return SourceChanged(f"{source}: source shard changed since the interrupted conversion in {partial} ({how}); "
                         "resuming would mix old and new weights: pass --overwrite to discard the partial output "
                         "and start over")


# ---------------------------------------------------------------------- one unit of work
class _HashingReader:
    """Reads a file front to back, hashing every byte, handing out tensor byte ranges on the way."""

    def __init__(self, path: Path, data_start: int) -> None:
        self.fh = open(path, "rb")  # noqa: SIM115 - closed in finish()
        self.hash = hashlib.sha256()
        self.pos = 0
        self.data_start = data_start
        st = os.fstat(self.fh.fileno())
        self.size = st.st_size
        self.identity = file_identity(st)

    def _skip_to(self, target: int, chunk: int = 1 << 24) -> None:
        buf = bytearray(min(chunk, max(target - self.pos, 1)))
        while self.pos < target:
            n = self.fh.readinto(memoryview(buf)[: min(len(buf), target - self.pos)])
            if not n:
                raise CheckpointError(f"{self.fh.name}: truncated shard (ended at byte {self.pos} of {self.size})")
            self.hash.update(memoryview(buf)[:n])
            self.pos += n

    def read(self, begin: int, nbytes: int, name: str) -> torch.Tensor:
        start = self.data_start + begin
        if start < self.pos:
            raise RuntimeError(f"internal error: tensor {name} read out of order")
        self._skip_to(start)
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            view = memoryview(out.numpy())
            got = 0
            while got < nbytes:
                n = self.fh.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{self.fh.name}: truncated shard: tensor {name!r} cut short")
                got += n
            self.hash.update(view)
            self.pos += nbytes
        return out

    def prefix(self, upto: int | None = None) -> list[Any]:
        """[n, sha256 of the first n bytes]: n = `upto` (read up to there first) or what was read so far."""
        if upto is not None:
            if upto < self.pos or upto > self.size:
                return [upto, None]
            self._skip_to(upto)
        return [self.pos, self.hash.copy().hexdigest()]

    def finish(self) -> str:
        self._skip_to(self.size)
        if file_identity(os.fstat(self.fh.fileno())) != self.identity:
            raise CheckpointError(f"{self.fh.name}: the source shard changed while it was being read")
        self.fh.close()
        return self.hash.hexdigest()


def _as_tensor(raw: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return raw.view(DTYPES[dtype][0]).reshape(shape)


_E8M0_NAN = 255  # an MXFP4 scale byte of 0xFF is NaN
_E8M0_HUGE = 254  # 2^127: a block scaled by it overflows to Inf for E2M1 values >= 2


def _check_finite(value: torch.Tensor, where: str, stored: str) -> None:
    bad = nonfinite_count(value)
    if bad:
        raise CheckpointError(f"{nonfinite_note(where, stored, bad)} (refused; --allow-nonfinite converts it anyway)")


def _check_scales(scale: torch.Tensor, where: str, stored: str) -> int:
    """The largest scale byte (one fast max pass); a 0xFF byte (E8M0 NaN) is refused."""
    top = int(scale.view(torch.uint8).amax()) if scale.numel() else 0
    if top == _E8M0_NAN:
        nan = int((scale.view(torch.uint8) == _E8M0_NAN).sum())
        raise CheckpointError(f"{where}: tensor {stored!r} has {nan} MXFP4 scale bytes 0xFF (E8M0 NaN) (refused; "
                              "--allow-nonfinite converts it anyway)")
    return top


def _produce(ot: OutTensor, raw: torch.Tensor | None, scale: torch.Tensor | None, group_size: int,
             check_finite: bool) -> torch.Tensor:
    src = ot.src
    if ot.op == "cast":
        value = fit_stored(src.name, _as_tensor(raw, src.dtype, src.shape), ot.shape).to(DTYPES[ot.dtype][0])
        if check_finite:  # after the cast: a value beyond the output dtype's range is an Inf too
            _check_finite(value, src.file, src.stored)
        return value
    if ot.op == "decode" and src.kind != PACKED:  # NVFP4 expert (scale, scale_2) or FP8 block weight (scale)
        parts = scale if isinstance(scale, tuple) else (scale,)
        weight = _as_tensor(raw, src.dtype, src.shape)
        name = f"{src.file}: {src.stored.removesuffix('.weight')}"
        value = (decode_nvfp4(weight, *parts, dtype=DTYPES[ot.dtype][0], name=name) if src.kind == NVFP4
                 else decode_fp8_block(weight, *parts, dtype=DTYPES[ot.dtype][0], name=name))
        if check_finite:
            _check_finite(value, src.file, src.stored)
        return value
    if ot.op == "decode":
        top = _check_scales(scale, src.scale_file or src.file, src.scale_stored) if check_finite else 0
        packed = _as_tensor(raw, "U8", src.shape)
        value = decode_mxfp4(packed, scale, DTYPES[ot.dtype][0], group_size,
                             name=f"{src.file}: {src.stored.removesuffix('.weight_packed')}")
        if top >= _E8M0_HUGE:  # E2M1 codes are finite: only a block scaled by 2^127 can overflow
            _check_finite(value, src.file, src.stored)
        return value
    if ot.op == "nvfp4":
        return _cast_part(ot, raw, scale, check_finite)
    # "copy": MXFP4 bytes kept as stored (E2M1 codes are always finite; a NaN can only come from a scale), or a
    # dense tensor as stored (the NVFP4 cast's other tensors)
    if ot.part == "scale":
        if check_finite:
            _check_scales(scale, src.scale_file or src.file, src.scale_stored)
        return scale
    value = _as_tensor(raw, src.dtype, src.shape)
    if check_finite and not ot.part:
        _check_finite(value, src.file, src.stored)
    return value


def _cast_part(ot: OutTensor, raw: torch.Tensor | None, scales: tuple[torch.Tensor, ...],
               check_finite: bool) -> torch.Tensor:
    """One tensor of an MXFP4 expert cast to NVFP4 (`nvfp4.cast_mxfp4`); `scales`: its E8M0 scale bytes, then its
    mate's (w1 and w3 share weight_scale_2)."""
    src = ot.src
    if check_finite:
        for s, t in zip(scales, (src, ot.mate)):
            _check_scales(s, t.scale_file or t.file, t.scale_stored)
    exponent = cast_exponent(*scales)
    if ot.part == "weight":
        return cast_mxfp4(_as_tensor(raw, "U8", src.shape), scales[0], exponent)[0]
    if ot.part == "weight_scale":
        return cast_scales(scales[0], exponent)[0]
    if ot.part == "weight_scale_2":
        return torch.tensor(2.0 ** exponent, dtype=torch.float32)
    return torch.tensor(1.0, dtype=torch.float32)  # input_scale: weight-only, nothing calibrated


# ---------------------------------------------------------------------- the unit's pipeline
# A unit runs as three stages joined by byte-bounded queues, so that disk reads, MXFP4 decoding and
# hashing + writing overlap (file I/O, hashlib and torch all release the GIL):
#   reader thread:  reads the source shard front to back, hashing it, plus the scales of packed weights
#   calling thread: turns source tensors into output tensors (`_produce`)
#   writer thread:  streams each output shard to disk (header first, then tensor by tensor), hashing it
#   finish thread:  fsyncs each complete shard, writes its record, renames it into place and reports it
#                   (`on_shard`): a shard in place always has its record,
#                   while the writer goes on with the next shard
# Memory: the queues' byte budgets plus the tensor each stage holds, whatever the output shard size.
_QUEUE_BYTES = 96 << 20


class _Stopped(Exception):
    """Another stage failed or the unit was stopped; this stage just ends."""


class _ByteQueue:
    """A FIFO that blocks `put` while it holds more than `capacity` bytes (one item may always enter)."""

    def __init__(self, capacity: int, stop: threading.Event) -> None:
        self._items: collections.deque[tuple[Any, int]] = collections.deque()
        self._used = 0
        self._capacity = capacity
        self._stop = stop
        self._cv = threading.Condition()

    def put(self, item: Any, nbytes: int = 0) -> None:
        with self._cv:
            while self._items and self._used + nbytes > self._capacity:
                if self._stop.is_set():
                    raise _Stopped
                self._cv.wait(0.2)
            if self._stop.is_set():
                raise _Stopped
            self._items.append((item, nbytes))
            self._used += nbytes
            self._cv.notify_all()

    def get(self) -> Any:
        with self._cv:
            while not self._items:
                if self._stop.is_set():
                    raise _Stopped
                self._cv.wait(0.2)
            item, nbytes = self._items.popleft()
            self._used -= nbytes
            self._cv.notify_all()
            return item

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


class _Stage(threading.Thread):
    """A pipeline thread that records its exception and stops the others when it fails."""

    def __init__(self, name: str, target: Callable[[], None], stop: threading.Event,
                 queues: list[_ByteQueue]) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn, self._stop_event, self._queues = target, stop, queues
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._target_fn()
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            self.error = exc
            self._stop_event.set()
            for q in self._queues:
                q.wake()


def convert_unit(src_dir: str, source: str, shards: list[OutShard], out_dir: str, done: dict[str, dict[str, Any]],
                 group_size: int, check_finite: bool, fingerprint: str,
                 on_shard: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Convert one source shard: write its output shards (except those in `done`) and hash the source.

    `done` maps output shards already written by an interrupted run to their records; each is checked against
    the source as it is read again (prefix and scale digests) and a difference raises `SourceChanged`.
    Returns ``{"source": {"name", "bytes", "sha256"}, "outputs": [{"name", "bytes", "sha256"}, ...]}``.
    ``on_shard`` is called (from the finish thread) with each output shard's record once it is in place;
    an exception it raises stops the unit and is raised here.
    """
    src_dir_p, out_dir_p = Path(src_dir), Path(out_dir)
    path = safe_source_file(src_dir_p, source, "shard")
    header = SafetensorsFile(path, display_name=source)
    others: dict[str, SafetensorsFile] = {source: header}
    reader = _HashingReader(path, header.data_start)
    outputs: list[dict[str, Any]] = []
    stop = threading.Event()
    in_q, out_q = _ByteQueue(_QUEUE_BYTES, stop), _ByteQueue(_QUEUE_BYTES, stop)
    fin_q = _ByteQueue(1, stop)  # output shards waiting for their fsync: one (plus the one being synced)
    pending: list[SafetensorsWriter] = []
    pending_lock = threading.Lock()
    digest: list[str] = []
    origin: dict[str, dict[str, Any]] = {}  # output shard -> the source bytes it came from (for its record)
    cast_blocks: dict[str, list[int]] = {}  # output shard -> [NVFP4 blocks, lossless blocks] the cast wrote to it

    def read_from(file: str | None, stored: str | None) -> torch.Tensor:
        sf = file or source
        if sf not in others:
            others[sf] = SafetensorsFile(safe_source_file(src_dir_p, sf, "shard"), display_name=sf)
        return others[sf].read(stored or "")

    def read_scale(ot: OutTensor) -> Any:
        """The scales `ot` is made with: one tensor, an NVFP4 expert's (weight_scale, weight_scale_2), or for the
        NVFP4 cast the MXFP4 expert's scales and its mate's."""
        scale = read_from(ot.src.scale_file, ot.src.scale_stored)
        if ot.op == "nvfp4":
            return (scale,) if ot.mate is None else (scale, read_from(ot.mate.scale_file, ot.mate.scale_stored))
        if ot.src.kind == NVFP4:
            return scale, read_from(ot.src.scale2_file, ot.src.scale2_stored)
        return scale

    def scale_parts(scale: Any) -> tuple[torch.Tensor, ...]:
        return scale if isinstance(scale, tuple) else (scale,)

    def scale_users(shard: OutShard) -> list[OutTensor]:
        return [ot for ot in shard.tensors
                if ot.src.scale_stored and (ot.op in ("decode", "nvfp4") or ot.part == "scale")]

    def verify_done(shard: OutShard) -> None:
        rec = done[shard.name]
        want = rec.get("source_prefix")
        if not (isinstance(want, list) and len(want) == 2) or reader.prefix(want[0]) != want:
            raise _source_changed(source, out_dir_p, f"its first bytes differ from those {shard.name} was made from")
        scales = hashlib.sha256()
        for ot in scale_users(shard):
            for part in scale_parts(read_scale(ot)):
                scales.update(_tensor_bytes(part))
        if rec.get("scales_sha256") != scales.hexdigest():
            raise _source_changed(source, out_dir_p, f"the MXFP4 scales {shard.name} was made from differ")

    def read_stage() -> None:
        started = False
        for shard in shards:
            if shard.name in done:
                verify_done(shard)
                continue
            if not started:  # the shards converted before this one are verified: this unit now writes
                _write_json_atomic(out_dir_p / STATE_DIR / f"source-{source}.json",
                                   {"name": source, "bytes": reader.size, "identity": reader.identity,
                                    "sha256": None, "fingerprint": fingerprint})
                started = True
            in_q.put(("begin", shard))
            scales = hashlib.sha256()
            for ot in shard.tensors:
                needs_seq = (ot.op in ("cast", "decode") or (ot.op == "copy" and ot.part in ("packed", ""))
                             or (ot.op == "nvfp4" and ot.part == "weight"))
                raw = reader.read(ot.src.begin, ot.src.nbytes, ot.src.stored) if needs_seq else None
                scale = None
                if ot.src.scale_stored and (ot.op in ("decode", "nvfp4") or ot.part == "scale"):
                    scale = read_scale(ot)
                    for part in scale_parts(scale):
                        scales.update(_tensor_bytes(part))
                nbytes = (raw.numel() if raw is not None else 0) + (
                    sum(p.numel() * p.element_size() for p in scale_parts(scale)) if scale is not None else 0)
                in_q.put(("tensor", ot, raw, scale), nbytes)
                del raw, scale
            origin[shard.name] = {"source": source, "source_prefix": reader.prefix(),
                                  "scales_sha256": scales.hexdigest()}
            in_q.put(("end", shard))
        digest.append(reader.finish())  # hashes the bytes of skipped shards too
        in_q.put(("done",))

    def write_stage() -> None:
        writer: SafetensorsWriter | None = None
        try:
            while True:
                msg = out_q.get()
                if msg[0] == "begin":
                    shard = msg[1]
                    writer = SafetensorsWriter(out_dir_p / shard.name,
                                               [(t.name, t.dtype, t.shape) for t in shard.tensors], {"format": "pt"})
                elif msg[0] == "tensor":
                    writer.write(msg[1].name, msg[2])
                elif msg[0] == "end":
                    with pending_lock:
                        pending.append(writer)
                    fin_q.put((msg[1], writer), 1)
                    writer = None
                else:
                    fin_q.put(("done",))
                    return
        finally:
            if writer is not None:
                writer.abort()

    def finish_stage() -> None:
        # fsync + rename off the writer's path: the next shard is hashed and written meanwhile
        while True:
            msg = fin_q.get()
            if msg[0] == "done":
                return
            shard, writer = msg
            record: dict[str, Any] = {}

            def write_record(nbytes: int, sha: str) -> None:  # before the rename: a shard in place is recorded
                record.update(name=shard.name, bytes=nbytes, sha256=sha, fingerprint=fingerprint,
                              **origin[shard.name])
                if shard.name in cast_blocks:
                    record["nvfp4_blocks"] = cast_blocks[shard.name]
                _write_json_atomic(out_dir_p / STATE_DIR / f"{shard.name}.json", record)

            writer.finish(before_rename=write_record)
            with pending_lock:
                pending.remove(writer)
            outputs.append(record)
            if on_shard is not None:
                on_shard(record)

    queues = [in_q, out_q, fin_q]
    stages = [_Stage(f"k3export-read-{source}", read_stage, stop, queues),
              _Stage(f"k3export-write-{source}", write_stage, stop, queues),
              _Stage(f"k3export-finish-{source}", finish_stage, stop, queues)]
    for stage in stages:
        stage.start()
    shard_now = ""
    try:
        while True:
            msg = in_q.get()
            if msg[0] == "begin":
                shard_now = msg[1].name
            if msg[0] == "tensor":
                _, ot, raw, scale = msg
                del msg
                value = _produce(ot, raw, scale, group_size, check_finite)
                if ot.op == "nvfp4" and ot.part == "weight_scale":  # the cast's counts, from its scales alone
                    exact = cast_scales(scale[0], cast_exponent(*scale))[1]
                    counts = cast_blocks.setdefault(shard_now, [0, 0])
                    counts[0] += exact.numel()
                    counts[1] += int(exact.sum())
                del raw, scale
                out_q.put(("tensor", ot, value), value.numel() * value.element_size())
                del value
                continue
            out_q.put(msg)
            if msg[0] == "done":
                break
    except _Stopped:
        pass  # a stage failed: its error is raised below
    except BaseException:
        stop.set()
        for q in queues:
            q.wake()
        raise
    finally:
        interrupted = _join_stages(stages, stop, queues)
        for writer in pending:  # handed over but never finished: the unit stopped
            writer.abort()
        for f in others.values():
            f.close()
        if not reader.fh.closed:
            reader.fh.close()
        if interrupted is not None:
            raise interrupted
    for stage in stages:
        if stage.error is not None:
            raise stage.error
    src_record = {"name": source, "bytes": reader.size, "sha256": digest[0]}
    _write_json_atomic(out_dir_p / STATE_DIR / f"source-{source}.json",
                       dict(src_record, identity=reader.identity, fingerprint=fingerprint))
    return {"source": src_record, "outputs": outputs}


def _join_stages(stages: list[_Stage], stop: threading.Event, queues: list[_ByteQueue]) -> BaseException | None:
    """Wait for every stage to end. A Ctrl-C / SIGTERM while waiting (the unit was ending anyway) stops them first;
    it is returned, to be raised once the unit's files are cleaned up."""
    interrupted: BaseException | None = None
    for stage in stages:
        while stage.is_alive():
            try:
                stage.join()
            except KeyboardInterrupt as exc:
                interrupted = exc
                stop.set()
                for q in queues:
                    q.wake()
    return interrupted


def _worker_init() -> None:
    """A pool worker: torch on one thread; stopped by the converting process only. Ctrl-C at a terminal reaches the
    whole process group: the converting process handles it and terminates its workers, so a worker ignores SIGINT,
    dies of SIGTERM, and wakes no signal watcher of its parent (`signal.set_wakeup_fd`, inherited by fork)."""
    torch.set_num_threads(1)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _terminate_workers(pool: cf.Executor) -> None:
    """Stop a process pool's running units now (a kill: every writer is kill-safe), for a conversion that stops."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # ProcessPoolExecutor's, by pid
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        proc.terminate()
    for proc in processes:
        proc.join(timeout=10)


def _write_json_atomic(path: Path, data: Any) -> None:
    write_json_report(path, data)  # temp file + rename, never through a link


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


# ---------------------------------------------------------------------- the whole conversion
def _source_identity(src_dir: Path, repo_id: str | None, revision: str | None) -> tuple[str | None, str | None]:
    """repo_id / revision from a Hugging Face cache path (``models--org--name/snapshots/<rev>``) when not given."""
    real = src_dir.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        repo_id = repo_id or real.parent.parent.name.removeprefix("models--").replace("--", "/")
        revision = revision or real.name
    return repo_id, revision


def _verified_done(plan: Plan, work: Path, fingerprint: str) -> dict[str, dict[str, Any]]:
    """Records of the output shards already in `work` whose file still matches (size and sha256)."""
    records: dict[str, dict[str, Any]] = {}
    state = work / STATE_DIR
    for shard in plan.shards:
        rec = _read_json(state / f"{shard.name}.json")
        f = work / shard.name
        if (isinstance(rec, dict) and rec.get("fingerprint") == fingerprint and f.is_file() and not f.is_symlink()
                and f.stat().st_size == rec.get("bytes") and file_sha256(f) == rec.get("sha256")):
            records[shard.name] = rec
        elif os.path.lexists(f):
            f.unlink()  # stale or damaged: rewrite it
    return records


def _clear(work: Path) -> None:
    """Empty the partial folder `work` (ours: it carries the partial marker), keeping the marker."""
    for p in work.iterdir():
        if p.name == MARKER:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _prepare_work(work: Path, plan: Plan, fingerprint: str, restart: bool) -> None:
    """Make the partial folder ready: a fresh one gets the plan; one left by an interrupted run of the same plan is
    cleaned of what a killed writer left; one of another plan is refused (or cleared when `restart`). A state
    folder without a plan and no output beside it (a run stopped while writing its plan) is a fresh one."""
    state = work / STATE_DIR
    info = _read_json(state / "plan.json")
    started = isinstance(info, dict) or any(p.name not in (MARKER, STATE_DIR) for p in work.iterdir())
    if started and not (isinstance(info, dict) and info.get("fingerprint") == fingerprint):
        if not restart:
            raise CheckpointError(f"{work}: holds an interrupted conversion of another source or with other options; "
                                  "pass --overwrite to discard it and start over")
        started = False
    # never look complete while work is in progress: markers go first, last one first
    for name in (MANIFEST_NAME, INDEX_NAME, CONFIG_NAME):
        if os.path.lexists(work / name):
            (work / name).unlink()
    if not started:
        _clear(work)
        state.mkdir()
        _write_json_atomic(state / "plan.json", {"fingerprint": fingerprint})
    planned = {s.name for s in plan.shards}
    for p in work.iterdir():
        if ".tmp-" in p.name and not p.is_dir():
            p.unlink()  # left by a killed writer
        elif _SHARD_RX.fullmatch(p.name) and p.name not in planned:
            p.unlink()
    for p in state.iterdir():
        if ".tmp-" in p.name:
            p.unlink()


def _finished_sources(plan: Plan, src: Path, work: Path, fingerprint: str,
                      records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Source shards whose unit finished and whose content is shown unchanged: name -> {"name", "bytes", "sha256"}.

    Unchanged identity (size, times, inode) means unchanged content; otherwise the file is hashed again and
    compared with the sha256 recorded while it was converted (a difference raises `SourceChanged`). A unit whose
    record is missing or unfinished runs again, checking its finished shards as it reads."""
    finished: dict[str, dict[str, Any]] = {}
    for source, shards in plan.units().items():
        rec = _read_json(work / STATE_DIR / f"source-{source}.json")
        if not (isinstance(rec, dict) and rec.get("fingerprint") == fingerprint and isinstance(rec.get("sha256"), str)
                and all(s.name in records for s in shards)):
            continue
        path = safe_source_file(src, source, "shard")
        if file_identity(path.stat()) != rec.get("identity"):
            if file_sha256(path) != rec["sha256"]:
                raise _source_changed(source, work, "its sha256 differs from the one recorded while converting it")
            rec["identity"] = file_identity(path.stat())
            _write_json_atomic(work / STATE_DIR / f"source-{source}.json", rec)
        if not _scales_unchanged(src, work, source, shards, fingerprint):
            continue  # scales from another shard that changed or is unfinished: verified by running the unit
        finished[source] = {k: rec[k] for k in ("name", "bytes", "sha256")}
    return finished


def _scales_unchanged(src: Path, work: Path, source: str, shards: list[OutShard], fingerprint: str) -> bool:
    used = {f for s in shards for t in s.tensors
            for f in (t.src.scale_file, t.src.scale2_file, t.mate.scale_file if t.mate else None) if f}
    for other in sorted(used - {source}):
        rec = _read_json(work / STATE_DIR / f"source-{other}.json")
        path = safe_source_file(src, other, "shard")
        if not (isinstance(rec, dict) and rec.get("fingerprint") == fingerprint
                and rec.get("identity") == file_identity(path.stat())):
            return False
    return True


def _passthrough_files(src: Path, vision: bool = False) -> list[str]:
    """The tokenizer (and friends) files copied from the source, each checked to lie inside it; with `vision` (an
    image + text conversion) the image processor's files too."""
    processor = _processor_files() if vision else ()
    names = [p.name for p in sorted(src.iterdir())
             if p.name == "generation_config.json" or _PASSTHROUGH_RX.fullmatch(p.name) or p.name in processor]
    for name in names:
        safe_source_file(src, name, "file")
    return names


def _check_tokenizer(src: Path, vocab_size: int) -> None:
    """The tokenizer files that travel are read as `generate` and `export` read them (`read_tokenizer_source`:
    size, UTF-8, JSON, BPE ranks, special-token ids within the model's vocabulary, a chat template that compiles),
    so a garbage or truncated one is refused before any weight is converted, not after."""
    from k3export.tokenizer import has_tokenizer, read_tokenizer_source

    if has_tokenizer(src):
        read_tokenizer_source(src, vocab_size)


def _finalize(plan: Plan, src: Path, out: Path, records: dict[str, dict[str, Any]],
              sources: dict[str, dict[str, Any]], repo_id: str | None, revision: str | None,
              workers: int, passthrough: list[str]) -> dict[str, Any]:
    state = out / STATE_DIR
    staging = state / "final"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()

    weight_map = {t.name: s.name for s in plan.shards for t in s.tensors}
    total = sum(t.nbytes for t in plan.tensors)
    _write_json_atomic(staging / INDEX_NAME, {"metadata": {"total_size": total, "format": "k3export"},
                                              "weight_map": dict(sorted(weight_map.items()))})
    config = plan.config
    nvfp4 = plan.options.get("experts") == "nvfp4"
    if nvfp4:  # NVIDIA's layout: the source's config, Model-Optimizer's quantization description
        cfg, hf_quant = modelopt_configs(plan.config_json, modelopt_quantization(sorted(
            {t.name.rsplit(".experts.", 1)[0] + ".experts" for t in plan.tensors if t.op == "nvfp4"})),
            {"name": "k3export", "version": __version__})
        _write_json_atomic(staging / CONFIG_NAME, cfg)
        _write_json_atomic(staging / HF_QUANT_CONFIG, hf_quant)
    else:
        _save_config_and_code(plan.vision if plan.vision is not None else config, staging, plan.options["dtype"])
    if plan.options["keep_mxfp4"]:
        cfg = read_config_json(staging)
        q = plan.config_json.get("quantization_config") or (plan.config_json.get("text_config") or {}).get(
            "quantization_config")
        if q is not None:
            cfg["quantization_config"] = q
        _write_json_atomic(staging / CONFIG_NAME, cfg)

    copied: list[str] = []
    for name in passthrough:
        shutil.copyfile(safe_source_file(src, name, "file"), staging / name)
        copied.append(name)
    if "generation_config.json" not in copied:
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
               "pad_token_id": config.pad_token_id}
        _write_json_atomic(staging / "generation_config.json", gen)

    src_files = [sources[name] for name in sorted(sources)]
    for extra in [CONFIG_NAME, INDEX_NAME, *copied]:
        if os.path.lexists(src / extra):
            p = safe_source_file(src, extra, "file")
            src_files.append({"name": extra, "bytes": p.stat().st_size, "sha256": file_sha256(p)})
    record = ConversionRecord(
        tool="k3export", tool_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        source=ConversionSource(name=src.resolve().name, repo_id=repo_id, revision=revision, layout=plan.layout,
                                files=[FileDigest(f["name"], f["bytes"], f["sha256"]) for f in src_files]),
        options=dict(plan.options, workers=workers),
        outputs=[FileDigest(s.name, records[s.name]["bytes"], records[s.name]["sha256"]) for s in plan.shards],
        skipped=dict(plan.skipped), plan_fingerprint=plan.fingerprint(), nvfp4_cast=_cast_counts(plan, records))
    # move into place: everything else, then config.json, the index, and the record last
    order = sorted(p.name for p in staging.iterdir() if p.name not in (CONFIG_NAME, INDEX_NAME))
    for name in [*order, CONFIG_NAME, INDEX_NAME]:
        os.replace(staging / name, out / name)
    record.write(out)
    shutil.rmtree(state, ignore_errors=True)
    return record.to_json()


def _cast_counts(plan: Plan, records: dict[str, dict[str, Any]]) -> dict[str, int] | None:
    """The NVFP4 cast's block counts over every output shard (None for another conversion)."""
    if plan.options.get("experts") != "nvfp4":
        return None
    blocks = lossless = 0
    for shard in plan.shards:
        b, ok = records[shard.name].get("nvfp4_blocks", (0, 0))
        blocks, lossless = blocks + b, lossless + ok
    return {"blocks": blocks, "lossless_blocks": lossless, "fallback_blocks": blocks - lossless}


def _save_config_and_code(config: Any, out_dir: Path, dtype: str) -> None:
    """config.json and the remote-code files: `K3ForCausalLM`'s for a text config, `K3ForConditionalGeneration`'s
    (as its ``save_pretrained`` writes them: ``auto_map``, architectures, the weights' `dtype`, the code files with
    the processor's) for a `K3VLConfig`."""
    from k3export.modeling import save_config_and_code
    from k3export.modeling.configuration_k3 import K3VLConfig

    if not isinstance(config, K3VLConfig):
        save_config_and_code(config, out_dir)
        return
    from k3export.modeling import modeling_k3_vision as vl

    config.architectures = ["K3ForConditionalGeneration"]
    config.auto_map = dict(vl.AUTO_MAP)
    config.dtype = dtype_of(dtype).torch
    config.save_pretrained(out_dir)
    here = Path(vl.__file__).resolve().parent
    for name in vl.CODE_FILES:
        shutil.copyfile(here / name, out_dir / name)


def _processor_files() -> tuple[str, ...]:
    """The image processor's files an image + text checkpoint carries (`K3Processor.save_pretrained` writes them)."""
    from transformers.utils import IMAGE_PROCESSOR_NAME

    from k3export.modeling.image_processing_k3 import PROCESSOR_CONFIG

    return IMAGE_PROCESSOR_NAME, PROCESSOR_CONFIG


def convert(src_dir: str | Path, out_dir: str | Path, *, dtype: str = "bf16", keep_mxfp4: bool = False,
            workers: int = 1, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, allow_nonfinite: bool = False,
            overwrite: bool = False, progress: bool = False, repo_id: str | None = None,
            revision: str | None = None, stop_after_shards: int | None = None,
            executor: cf.Executor | None = None, text_only: bool = False,
            experts: str | None = None) -> dict[str, Any]:
    """Convert `src_dir` (released K3, Kimi-Linear or ours) into our layout in `out_dir`; return the manifest.

    A source with a MoonViT-V2 vision tower converts image + text (unless `text_only`): the layout
    `K3ForConditionalGeneration.save_pretrained` writes, its vision tensors cast to `dtype` and its processor files
    carried (`plan.make_plan`); `text_only` writes the text model alone, as from a text-only source.

    The output is built in ``.OUT.partial`` and renamed into place when complete (`k3export.safety.output_folder`):
    an existing non-empty `out_dir` is refused unless `overwrite` and it is a converted checkpoint k3export wrote;
    a second conversion into the same folder at the same time fails at once. An interrupted conversion resumes
    from ``.OUT.partial`` (see the module docstring); `overwrite` also discards a partial output that cannot be
    resumed (other options, changed source). NaN / Inf weights and NaN MXFP4 scales are refused unless
    `allow_nonfinite`. ``stop_after_shards`` interrupts a single-process run after writing that many output shards
    (as a kill would), raising `ConversionInterrupted`; a re-run resumes. ``executor`` runs the units instead of
    the local process pool (`ray_convert.RayExecutor`: Ray tasks across a cluster).

    ``experts="nvfp4"`` casts the MXFP4 release into NVIDIA's NVFP4 layout instead (`plan.nvfp4_plan`; the source's
    config.json with Model-Optimizer's ``quantization_config``, and ``hf_quant_config.json``); the record's
    ``nvfp4_cast`` counts the NVFP4 blocks and those cast bit-exactly.
    """
    src, out = Path(src_dir), Path(out_dir)
    if workers < 1:
        raise CheckpointError(f"--workers must be >= 1, got {workers}")
    with output_folder(out, CHECKPOINT, overwrite=overwrite, sources=[src], resumable=True) as work:
        plan = make_plan(src, dtype=dtype, keep_mxfp4=keep_mxfp4, max_shard_bytes=max_shard_bytes, workers=workers,
                         check_finite=not allow_nonfinite, text_only=text_only, experts=experts)
        nvfp4 = plan.options.get("experts") == "nvfp4"
        passthrough = _passthrough_files(src, vision=plan.vision is not None or nvfp4)
        _check_tokenizer(src, plan.config.vocab_size)
        try:
            return _convert_into(plan, src, work, workers, not allow_nonfinite, overwrite, progress, repo_id,
                                 revision, stop_after_shards, passthrough, executor)
        except SourceChanged:
            if not overwrite:
                raise
            _clear(work)  # --overwrite: the partial output cannot be resumed, start over
            return _convert_into(plan, src, work, workers, not allow_nonfinite, False, progress, repo_id, revision,
                                 stop_after_shards, passthrough, executor)


def _convert_into(plan: Plan, src: Path, work: Path, workers: int, check_finite: bool, restart: bool,
                  progress: bool, repo_id: str | None, revision: str | None, stop_after_shards: int | None,
                  passthrough: list[str], executor: cf.Executor | None = None) -> dict[str, Any]:
    fingerprint = plan.fingerprint()
    repo_id, revision = _source_identity(src, repo_id, revision)
    _prepare_work(work, plan, fingerprint, restart)
    records = _verified_done(plan, work, fingerprint)
    sources = _finished_sources(plan, src, work, fingerprint, records)
    todo = [(source, shards) for source, shards in plan.units().items() if source not in sources]
    group_size = 32
    pending_bytes = sum(s.nbytes for _, shards in todo for s in shards if s.name not in records)
    done = {name: rec for name, rec in records.items()}

    bar = _Progress(progress, pending_bytes, len(plan.shards) - len(records))
    try:
        if executor is None and (workers == 1 or len(todo) <= 1):
            written = 0

            def on_shard(record: dict[str, Any]) -> None:
                nonlocal written
                bar.advance(record)
                written += 1
                if stop_after_shards is not None and written >= stop_after_shards:
                    raise ConversionInterrupted(f"conversion interrupted after {written} output shards "
                                                "(re-run to resume)")

            # the unit's own pipeline threads use the cores; torch's intra-op pool would only compete with them
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                for source, shards in todo:
                    result = convert_unit(str(src), source, shards, str(work), done, group_size, check_finite,
                                          fingerprint, on_shard)
                    sources[source] = result["source"]
                    records.update({r["name"]: r for r in result["outputs"]})
            finally:
                torch.set_num_threads(threads)
        else:
            # fork: workers share the parent's imports (torch, transformers) instead of paying them again;
            # K3EXPORT_MP_START=spawn|forkserver picks another start method where fork is unsafe.
            ctx = multiprocessing.get_context(switches.choice("K3EXPORT_MP_START"))
            pool_cm = contextlib.nullcontext(executor) if executor is not None else cf.ProcessPoolExecutor(
                max_workers=min(workers, len(todo)), mp_context=ctx, initializer=_worker_init)
            with pool_cm as pool:
                futures = {pool.submit(convert_unit, str(src), source, shards, str(work), done, group_size,
                                       check_finite, fingerprint): source for source, shards in todo}
                try:
                    for fut in cf.as_completed(futures):
                        result = fut.result()
                        sources[result["source"]["name"]] = result["source"]
                        for r in result["outputs"]:
                            records[r["name"]] = r
                            bar.advance(r)
                except cf.BrokenExecutor as exc:  # BrokenProcessPool (cf.process loads only with the pool)
                    raise ConversionInterrupted(f"a conversion worker died ({exc}); completed shards are kept, "
                                                "re-run the same command to resume") from None
                except BaseException as exc:
                    for f in futures:
                        f.cancel()
                    if isinstance(exc, KeyboardInterrupt) and executor is None:
                        _terminate_workers(pool)  # Ctrl-C / SIGTERM: stop the running units too
                    raise
    finally:
        bar.close()
    missing = [s.name for s in plan.shards if s.name not in records]
    if missing:
        raise ConversionInterrupted(f"output shards {missing[:3]} were not written; re-run to resume")
    return _finalize(plan, src, work, records, sources, repo_id, revision, workers, passthrough)


class _Progress:
    """A rich progress bar over output bytes (or nothing when disabled)."""

    def __init__(self, enabled: bool, total_bytes: int, shards: int) -> None:
        self._p = None
        if enabled:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._p = Progress(TextColumn("[bold]converting[/] {task.fields[shards]}"), BarColumn(), DownloadColumn(),
                               TransferSpeedColumn(), TimeRemainingColumn())
            self._p.start()
            self._task = self._p.add_task("convert", total=total_bytes, shards=f"0/{shards} shards")
            self._done, self._n = 0, shards

    def advance(self, record: dict[str, Any]) -> None:
        if self._p is not None:
            self._done += 1
            self._p.update(self._task, advance=record["bytes"], shards=f"{self._done}/{self._n} shards")

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


__all__ = ["MANIFEST_NAME", "STATE_DIR", "ConversionInterrupted", "SourceChanged", "convert", "convert_unit",
           "partial_path"]
