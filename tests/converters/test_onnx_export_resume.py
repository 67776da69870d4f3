"""A checkpoint folder's export resumes after kill -9: finished data shards (size and sha256 as recorded) are kept,
the rest written; the result is byte for byte a fresh export's. A damaged shard is written again; a source that
changed since is refused, or started over with --overwrite. The partial folder never looks complete."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from k3export.converters.onnx import export_onnx
from k3export.converters.onnx.weights import RESUME_DIR
from k3export.errors import ExportError
from k3export.safety import partial_path
from killed_runs import count_reads, run_killed

SHARD = 1 << 16  # small data shards, so that a run is killed between many of them

_KILLED_HALFWAY = """
import os, signal, sys
from k3export.converters.onnx import export_onnx
def die_halfway(done, total):
    if done > total // 2:
        os.kill(os.getpid(), signal.SIGKILL)
export_onnx(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[3]), progress=die_halfway)
"""


@pytest.fixture(scope="module")
def fresh(released_random, tmp_path_factory) -> Path:
    return export_onnx(released_random, tmp_path_factory.mktemp("fresh") / "out", max_shard_bytes=SHARD).out_dir


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
            if p.is_file() and p.name != ".k3export"}


def _kill_halfway(src: Path, out: Path) -> Path:
    work = run_killed(_KILLED_HALFWAY, src, out, SHARD, out=out)
    assert not (work / "model.onnx").exists()
    return work


def test_killed_export_resumes_to_the_fresh_bytes(released_random, fresh, tmp_path, monkeypatch):
    out = tmp_path / "out"
    work = _kill_halfway(released_random, out)
    finished = sorted(p.stem for p in (work / RESUME_DIR).glob("*.json") if p.stem != "export")
    assert len(finished) >= 2
    calls = count_reads(monkeypatch)
    export_onnx(released_random, out, max_shard_bytes=SHARD)
    resumed = len(calls)
    calls.clear()
    export_onnx(released_random, tmp_path / "again", max_shard_bytes=SHARD)
    assert 0 < resumed < len(calls)  # the finished shards' tensors were not read again
    assert _digests(out) == _digests(fresh)
    assert not (out / RESUME_DIR).exists() and not partial_path(out).exists()


def test_a_damaged_shard_is_written_again(released_random, fresh, tmp_path):
    out = tmp_path / "out"
    work = _kill_halfway(released_random, out)
    first = work / "model.onnx.data.00000"
    data = bytearray(first.read_bytes())
    data[100] ^= 0xFF
    first.write_bytes(bytes(data))
    export_onnx(released_random, out, max_shard_bytes=SHARD)
    assert _digests(out) == _digests(fresh)


def test_a_source_changed_since_is_refused_or_started_over(released_random, fresh, tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "ckpt"
    src.mkdir()
    for p in released_random.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    out = src.parent / "out"
    _kill_halfway(src, out)
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ExportError, match="holds an interrupted export of another source"):
        export_onnx(src, out, max_shard_bytes=SHARD)
    export_onnx(src, out, max_shard_bytes=SHARD, overwrite=True)
    assert _digests(out) == _digests(fresh)
