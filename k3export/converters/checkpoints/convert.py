"""Streaming, resumable, atomic conversion of a released K3 / Kimi-Linear folder into our layout.

Work is cut into units, one per source shard: `convert_unit` reads that shard once, front to back
(hashing every byte for the manifest), turns its tensors into output tensors (cast, MXFP4 decode or byte
copy) and writes the output shards the plan assigns to it. A unit is a pure function of (source shard,
plan), so units run in any order, in any number of processes (or, later, machines), and produce the same
bytes. Inside a unit, reading, decoding, writing and fsyncing overlap in threads (see "the unit's
pipeline" below); output shards are streamed tensor by tensor, so peak memory per unit is the pipeline's
queue budgets plus a few tensors, whatever the output shard size.

Every output shard is written under a temporary name and renamed when complete; a record of its size and
sha256 then goes to ``OUT/.k3export-partial/``. A re-run with the same plan skips every shard whose file
still matches its record, so an interrupted conversion resumes where it stopped. The files that make the
folder look complete (``config.json``, ``model.safetensors.index.json``, ``conversion.json``, in that order)
are written only at the very end; any failure leaves them absent.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import datetime as _dt
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from k3export.errors import CheckpointError, K3ExportError

from .layouts import PACKED
from .mxfp4 import decode_mxfp4
from .plan import DEFAULT_MAX_SHARD_BYTES, OutShard, OutTensor, Plan, make_plan
from .safetensors_io import DTYPES, INDEX_NAME, SafetensorsFile, SafetensorsWriter, safe_source_file, sha256_file

logger = logging.getLogger(__name__)

STATE_DIR = ".k3export-partial"
MANIFEST_NAME = "conversion.json"
_SHARD_RX = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# files copied through from the source folder (tokenizer and friends)
_PASSTHROUGH_RX = re.compile(r"(tokenizer.*|tiktoken\.model|.*\.tiktoken|special_tokens_map\.json|added_tokens\.json"
                             r"|vocab\..*|merges\.txt|chat_template\..*|tokenization_.*\.py)")


class ConversionInterrupted(K3ExportError):
    """The conversion stopped before the end (on request or because a worker died); re-run it to resume."""


# ---------------------------------------------------------------------- one unit of work
class _HashingReader:
    """Reads a file front to back, hashing every byte, handing out tensor byte ranges on the way."""

    def __init__(self, path: Path, data_start: int) -> None:
        self.fh = open(path, "rb")  # noqa: SIM115 - closed in finish()
        self.hash = hashlib.sha256()
        self.pos = 0
        self.data_start = data_start
        self.size = path.stat().st_size

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

    def finish(self) -> str:
        self._skip_to(self.size)
        self.fh.close()
        return self.hash.hexdigest()


def _as_tensor(raw: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return raw.view(DTYPES[dtype][0]).reshape(shape)


def _check_finite(value: torch.Tensor, where: str, stored: str) -> None:
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise CheckpointError(f"{where}: tensor {stored!r} has {bad} NaN/Inf values (--check-finite)")


def _produce(ot: OutTensor, raw: torch.Tensor | None, scale: torch.Tensor | None, group_size: int,
             check_finite: bool) -> torch.Tensor:
    src = ot.src
    if ot.op == "cast":
        value = _as_tensor(raw, src.dtype, src.shape)
        if check_finite:
            _check_finite(value, src.file, src.stored)
        return value.to(DTYPES[ot.dtype][0])
    if ot.op == "decode":
        packed = _as_tensor(raw, "U8", src.shape)
        value = decode_mxfp4(packed, scale, DTYPES[ot.dtype][0], group_size,
                             name=f"{src.file}: {src.stored.removesuffix('.weight_packed')}")
        if check_finite:
            _check_finite(value, src.file, src.stored)
        return value
    # "copy": MXFP4 bytes kept as stored
    if ot.part == "scale":
        if check_finite and bool((scale == 255).any()):
            raise CheckpointError(f"{src.scale_file}: tensor {src.scale_stored!r} has E8M0 byte 255 (NaN scale) "
                                  "(--check-finite)")
        return scale
    return _as_tensor(raw, "U8", src.shape)


# ---------------------------------------------------------------------- the unit's pipeline
# A unit runs as three stages joined by byte-bounded queues, so that disk reads, MXFP4 decoding and
# hashing + writing overlap (file I/O, hashlib and torch all release the GIL):
#   reader thread:  reads the source shard front to back, hashing it, plus the scales of packed weights
#   calling thread: turns source tensors into output tensors (`_produce`)
#   writer thread:  streams each output shard to disk (header first, then tensor by tensor), hashing it
#   finish thread:  fsyncs and renames each complete shard, writes its record and reports it (`on_shard`),
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


def convert_unit(src_dir: str, source: str, shards: list[OutShard], out_dir: str, skip: list[str],
                 group_size: int, check_finite: bool, fingerprint: str,
                 on_shard: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Convert one source shard: write its output shards (except those in `skip`) and hash the source.

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
    todo = [shard for shard in shards if shard.name not in skip]
    stop = threading.Event()
    in_q, out_q = _ByteQueue(_QUEUE_BYTES, stop), _ByteQueue(_QUEUE_BYTES, stop)
    fin_q = _ByteQueue(1, stop)  # output shards waiting for their fsync: one (plus the one being synced)
    pending: list[SafetensorsWriter] = []
    pending_lock = threading.Lock()
    digest: list[str] = []

    def read_stage() -> None:
        for shard in todo:
            in_q.put(("begin", shard))
            for ot in shard.tensors:
                needs_seq = ot.op == "cast" or ot.op == "decode" or (ot.op == "copy" and ot.part == "packed")
                raw = reader.read(ot.src.begin, ot.src.nbytes, ot.src.stored) if needs_seq else None
                scale = None
                if ot.src.kind == PACKED and (ot.op == "decode" or ot.part == "scale"):
                    sf = ot.src.scale_file or source
                    if sf not in others:
                        others[sf] = SafetensorsFile(safe_source_file(src_dir_p, sf, "shard"), display_name=sf)
                    scale = others[sf].read(ot.src.scale_stored)
                nbytes = (raw.numel() if raw is not None else 0) + (scale.numel() if scale is not None else 0)
                in_q.put(("tensor", ot, raw, scale), nbytes)
                del raw, scale
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
            nbytes, sha = writer.finish()
            with pending_lock:
                pending.remove(writer)
            record = {"name": shard.name, "bytes": nbytes, "sha256": sha, "fingerprint": fingerprint}
            _write_json_atomic(out_dir_p / STATE_DIR / f"{shard.name}.json", record)
            outputs.append(record)
            if on_shard is not None:
                on_shard(record)

    queues = [in_q, out_q, fin_q]
    stages = [_Stage(f"k3export-read-{source}", read_stage, stop, queues),
              _Stage(f"k3export-write-{source}", write_stage, stop, queues),
              _Stage(f"k3export-finish-{source}", finish_stage, stop, queues)]
    for stage in stages:
        stage.start()
    try:
        while True:
            msg = in_q.get()
            if msg[0] == "tensor":
                _, ot, raw, scale = msg
                del msg
                value = _produce(ot, raw, scale, group_size, check_finite)
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
        for stage in stages:
            stage.join()
        for writer in pending:  # handed over but never finished: the unit stopped
            writer.abort()
        for f in others.values():
            f.close()
        if not reader.fh.closed:
            reader.fh.close()
    for stage in stages:
        if stage.error is not None:
            raise stage.error
    src_record = {"name": source, "bytes": path.stat().st_size, "sha256": digest[0]}
    _write_json_atomic(out_dir_p / STATE_DIR / f"source-{source}.json", dict(src_record, fingerprint=fingerprint))
    return {"source": src_record, "outputs": outputs}


def _worker_init() -> None:
    torch.set_num_threads(1)


def _write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------- the whole conversion
def _source_identity(src_dir: Path, repo_id: str | None, revision: str | None) -> tuple[str | None, str | None]:
    """repo_id / revision from a Hugging Face cache path (``models--org--name/snapshots/<rev>``) when not given."""
    real = src_dir.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        repo_id = repo_id or real.parent.parent.name.removeprefix("models--").replace("--", "/")
        revision = revision or real.name
    return repo_id, revision


def _tool_version() -> str:
    try:
        from k3export import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def _verified_done(plan: Plan, out: Path, fingerprint: str) -> tuple[set[str], dict[str, dict[str, Any]]]:
    done: set[str] = set()
    records: dict[str, dict[str, Any]] = {}
    state = out / STATE_DIR
    for shard in plan.shards:
        rec = _read_json(state / f"{shard.name}.json")
        f = out / shard.name
        if (isinstance(rec, dict) and rec.get("fingerprint") == fingerprint and f.is_file()
                and f.stat().st_size == rec.get("bytes") and sha256_file(f) == rec.get("sha256")):
            done.add(shard.name)
            records[shard.name] = rec
        elif f.exists():
            f.unlink()  # stale or damaged: rewrite it
    return done, records


def _prepare_out(out: Path, plan: Plan, fingerprint: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # never look complete while work is in progress: markers go first, last one first
    for marker in (MANIFEST_NAME, INDEX_NAME, "config.json"):
        (out / marker).unlink(missing_ok=True)
    state = out / STATE_DIR
    state.mkdir(exist_ok=True)
    info = _read_json(state / "plan.json")
    if not (isinstance(info, dict) and info.get("fingerprint") == fingerprint):
        shutil.rmtree(state)
        state.mkdir()
        _write_json_atomic(state / "plan.json", {"fingerprint": fingerprint})
    planned = {s.name for s in plan.shards}
    for p in out.iterdir():
        if ".tmp-" in p.name and p.is_file():
            p.unlink()  # left by a killed writer
        elif _SHARD_RX.fullmatch(p.name) and p.name not in planned:
            p.unlink()  # from an earlier conversion with another sharding
    for p in state.iterdir():
        if ".tmp-" in p.name:
            p.unlink()


def _finalize(plan: Plan, src: Path, out: Path, records: dict[str, dict[str, Any]],
              sources: dict[str, dict[str, Any]], repo_id: str | None, revision: str | None,
              workers: int) -> dict[str, Any]:
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
    _save_config_and_code(config, staging)
    if plan.options["keep_mxfp4"]:
        cfg = json.loads((staging / "config.json").read_text(encoding="utf-8"))
        q = plan.config_json.get("quantization_config") or (plan.config_json.get("text_config") or {}).get(
            "quantization_config")
        if q is not None:
            cfg["quantization_config"] = q
        _write_json_atomic(staging / "config.json", cfg)

    copied: list[str] = []
    for p in sorted(src.iterdir()):
        if p.name == "generation_config.json" or _PASSTHROUGH_RX.fullmatch(p.name):
            real = safe_source_file(src, p.name, "file")
            if real.resolve().is_file():
                shutil.copyfile(real, staging / p.name)
                copied.append(p.name)
    if "generation_config.json" not in copied:
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
               "pad_token_id": config.pad_token_id}
        _write_json_atomic(staging / "generation_config.json", gen)

    src_files = [sources[name] for name in sorted(sources)]
    for extra in ["config.json", INDEX_NAME, *copied]:
        p = src / extra
        if p.exists():
            src_files.append({"name": extra, "bytes": p.stat().st_size, "sha256": sha256_file(p)})
    outputs = [{k: records[s.name][k] for k in ("name", "bytes", "sha256")} for s in plan.shards]
    manifest = {
        "tool": "k3export",
        "tool_version": _tool_version(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": {"path": str(src), "repo_id": repo_id, "revision": revision, "layout": plan.layout,
                   "files": src_files},
        "options": {k: v for k, v in dict(plan.options, workers=workers).items()},
        "outputs": outputs,
        "skipped": dict(plan.skipped),
        "plan_fingerprint": plan.fingerprint(),
    }
    # move into place: everything else, then config.json, the index, and the manifest last
    order = sorted(p.name for p in staging.iterdir() if p.name not in ("config.json", INDEX_NAME))
    for name in [*order, "config.json", INDEX_NAME]:
        os.replace(staging / name, out / name)
    _write_json_atomic(out / MANIFEST_NAME, manifest)
    shutil.rmtree(state, ignore_errors=True)
    return manifest


def _save_config_and_code(config: Any, out_dir: Path) -> None:
    from k3export.modeling import save_config_and_code

    save_config_and_code(config, out_dir)


def convert(src_dir: str | Path, out_dir: str | Path, *, dtype: str = "bf16", keep_mxfp4: bool = False,
            workers: int = 1, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, check_finite: bool = False,
            progress: bool = False, repo_id: str | None = None, revision: str | None = None,
            stop_after_shards: int | None = None) -> dict[str, Any]:
    """Convert `src_dir` (released K3, Kimi-Linear or ours) into our layout in `out_dir`; return the manifest.

    ``stop_after_shards`` interrupts a single-process run after writing that many output shards (as a
    kill would), raising `ConversionInterrupted`; a re-run resumes.
    """
    src, out = Path(src_dir), Path(out_dir)
    if workers < 1:
        raise CheckpointError(f"--workers must be >= 1, got {workers}")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise CheckpointError(f"output folder {out} must not be the source folder or inside it")
    plan = make_plan(src, dtype=dtype, keep_mxfp4=keep_mxfp4, max_shard_bytes=max_shard_bytes, workers=workers,
                     check_finite=check_finite)
    fingerprint = plan.fingerprint()
    repo_id, revision = _source_identity(src, repo_id, revision)
    _prepare_out(out, plan, fingerprint)
    done, records = _verified_done(plan, out, fingerprint)
    sources: dict[str, dict[str, Any]] = {}
    units = plan.units()
    todo: list[tuple[str, list[OutShard]]] = []
    for source, shards in units.items():
        rec = _read_json(out / STATE_DIR / f"source-{source}.json")
        all_done = all(s.name in done for s in shards)
        if all_done and isinstance(rec, dict) and rec.get("fingerprint") == fingerprint:
            sources[source] = {k: rec[k] for k in ("name", "bytes", "sha256")}
        else:
            todo.append((source, shards))
    group_size = 32
    pending_bytes = sum(s.nbytes for _, shards in todo for s in shards if s.name not in done)
    skip = sorted(done)

    bar = _Progress(progress, pending_bytes, len(plan.shards) - len(done))
    try:
        if workers == 1 or len(todo) <= 1:
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
                    result = convert_unit(str(src), source, shards, str(out), skip, group_size, check_finite,
                                          fingerprint, on_shard)
                    sources[source] = result["source"]
                    records.update({r["name"]: r for r in result["outputs"]})
            finally:
                torch.set_num_threads(threads)
        else:
            # fork: workers share the parent's imports (torch, transformers) instead of paying them again;
            # K3EXPORT_MP_START=spawn|forkserver picks another start method where fork is unsafe.
            ctx = multiprocessing.get_context(os.environ.get("K3EXPORT_MP_START", "fork"))
            with cf.ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx,
                                        initializer=_worker_init) as pool:
                futures = {pool.submit(convert_unit, str(src), source, shards, str(out), skip, group_size,
                                       check_finite, fingerprint): source for source, shards in todo}
                try:
                    for fut in cf.as_completed(futures):
                        result = fut.result()
                        sources[result["source"]["name"]] = result["source"]
                        for r in result["outputs"]:
                            records[r["name"]] = r
                            bar.advance(r)
                except cf.process.BrokenProcessPool as exc:
                    raise ConversionInterrupted(f"a conversion worker died ({exc}); completed shards are kept, "
                                                "re-run the same command to resume") from None
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
    finally:
        bar.close()
    missing = [s.name for s in plan.shards if s.name not in records]
    if missing:
        raise ConversionInterrupted(f"output shards {missing[:3]} were not written; re-run to resume")
    return _finalize(plan, src, out, records, sources, repo_id, revision, workers)


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


__all__ = ["MANIFEST_NAME", "STATE_DIR", "ConversionInterrupted", "convert", "convert_unit"]
