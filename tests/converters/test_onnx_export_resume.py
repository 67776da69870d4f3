"""A checkpoint folder's export resumes after kill -9: finished data shards (size and sha256 as recorded) are kept,
the rest written; the result is byte for byte a fresh export's. A damaged shard is written again; a source that
changed since is refused, or started over with --overwrite. The partial folder never looks complete."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from k3export.converters.onnx import export_onnx
from k3export.converters.onnx.shards import RESUME_DIR
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


def _copy_then_kill_halfway(released_random: Path, root: Path) -> tuple[Path, Path]:
    """(a copy of the source, the folder of an export of it killed halfway)."""
    src = root / "ckpt"
    src.mkdir()
    for p in released_random.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    out = root / "out"
    _kill_halfway(src, out)
    return src, out


def test_a_source_changed_since_is_refused_or_started_over(released_random, fresh, tmp_path_factory):
    src, out = _copy_then_kill_halfway(released_random, tmp_path_factory.mktemp("src"))
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ExportError, match="holds an interrupted export of another source"):
        export_onnx(src, out, max_shard_bytes=SHARD)
    export_onnx(src, out, max_shard_bytes=SHARD, overwrite=True)
    assert _digests(out) == _digests(fresh)


def test_a_run_stopped_before_any_output_is_started_over(tmp_path):
    """A signal at once can stop a run while it writes its first record (the records' folder made, the record not
    yet renamed into place): records without output are nothing to keep, so the next run starts over instead of
    calling the folder another source's; once an output file is there, it is refused as before."""
    from k3export.converters.onnx.shards import resume_record
    from k3export.safety import MARKER

    work = tmp_path / "work"
    (work / RESUME_DIR).mkdir(parents=True)
    (work / MARKER).write_text("{}")
    (work / RESUME_DIR / ".tmp-export.json").write_text("{")  # the record, cut short before its rename
    assert resume_record(work, "export.json", "key", False, "export", ExportError) is None
    assert sorted(p.name for p in work.iterdir()) == [MARKER]
    (work / RESUME_DIR).mkdir()
    (work / "model.onnx.data.00000").write_bytes(b"x")
    with pytest.raises(ExportError, match="holds an interrupted export of another source"):
        resume_record(work, "export.json", "key", False, "export", ExportError)


def test_a_shard_replaced_with_its_size_and_mtime_kept_is_another_source(released_random, tmp_path_factory):
    """Bytes changed in place, the modification time set back (what ``cp -p`` or ``touch -r`` leave): the change
    time still moves, so the resume refuses the folder instead of mixing old and new weights."""
    src, out = _copy_then_kill_halfway(released_random, tmp_path_factory.mktemp("src"))
    shard = sorted(src.glob("*.safetensors"))[-1]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # a weight's last byte: same size, same header
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(ExportError, match="holds an interrupted export of another source"):
        export_onnx(src, out, max_shard_bytes=SHARD)


_KILLED_IN_THE_8BIT_COPY = """
import os, signal, sys
from k3export.converters.onnx import export_onnx, mxfp4
convert, calls = mxfp4.write_q8_tensor, [0]
def convert_then_die(*a, **k):
    convert(*a, **k)
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
mxfp4.write_q8_tensor = convert_then_die
export_onnx(sys.argv[1], sys.argv[2], genai=True, max_shard_bytes=int(sys.argv[4]))
"""


def test_a_kill_in_the_8bit_copy_resumes_there(released_random, tmp_path, monkeypatch):
    """``export --genai`` of MXFP4 experts killed halfway through genai's 8-bit copy (K3: ~3.1 TB after the
    weights): the next run keeps every data shard and the finished 8-bit shards, converts only the rest, and its
    folder equals a fresh export's byte for byte. A run without --genai drops the 8-bit shards."""
    from k3export.artifacts.export_folder import is_genai_data
    from k3export.converters.onnx import mxfp4

    calls: list[int] = []
    convert = mxfp4.write_q8_tensor
    monkeypatch.setattr(mxfp4, "write_q8_tensor", lambda *a, **k: (calls.append(1), convert(*a, **k)))
    fresh = export_onnx(released_random, tmp_path / "fresh", genai=True, max_shard_bytes=SHARD).out_dir
    n = len(calls)
    assert n > 4
    for out, genai in ((tmp_path / "out", True), (tmp_path / "plain", False)):
        work = run_killed(_KILLED_IN_THE_8BIT_COPY, released_random, out, n // 2, SHARD, out=out)
        assert any(is_genai_data(p.stem) for p in (work / RESUME_DIR).glob("*.json"))  # some finished
        reads = count_reads(monkeypatch)
        calls.clear()
        export_onnx(released_random, out, genai=genai, max_shard_bytes=SHARD)
        assert not reads  # every data shard was kept
        if genai:
            assert 0 < len(calls) < n
            assert _digests(out) == _digests(fresh)
        else:
            assert not calls and not any(is_genai_data(p.name) for p in out.iterdir())
            assert not (out / "model.genai.onnx").exists()
