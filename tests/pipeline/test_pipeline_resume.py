"""A pipeline export streamed from a checkpoint resumes after kill -9: finished stages are kept (not read again),
the stage being written resumes from its finished shards, the rest is written; every stage's files equal a fresh
pipeline's byte for byte. Another plan is refused, or started over with --overwrite; a finished stage whose
stage.json was never written is exported again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from k3export.converters.onnx.shards import RESUME_DIR
from k3export.pipeline import PipelineError, export_pipeline, load_pipeline
from k3export.safety import partial_path, read_marker
from killed_runs import count_reads, run_killed

SHARD = 1 << 16  # small data shards, so that a kill lands between many of them
PLAN = [range(0, 2), range(2, 4), range(4, 6)]
IDS = ("stage.json", "pipeline.json")  # they carry the export id, new in every fresh run

_KILLED = """
import json, os, signal, sys
from k3export.pipeline import export_pipeline
def die(done, total):
    if done > total * float(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
export_pipeline(sys.argv[1], sys.argv[2], stage_plan=[range(*r) for r in json.loads(sys.argv[4])],
                max_shard_bytes=int(sys.argv[5]), bytes_progress=die)
"""


@pytest.fixture(scope="module")
def fresh(released_random, tmp_path_factory) -> Path:
    return export_pipeline(released_random, tmp_path_factory.mktemp("fresh") / "out", stage_plan=PLAN,
                           max_shard_bytes=SHARD).out_dir


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (".k3export", *IDS)}


def _kill(src: Path, out: Path, at: float) -> Path:
    work = run_killed(_KILLED, src, out, at, json.dumps([[r.start, r.stop] for r in PLAN]), SHARD, out=out)
    assert not (work / "pipeline.json").exists()
    return work


def test_killed_pipeline_resumes_to_the_fresh_bytes(released_random, fresh, tmp_path, monkeypatch):
    out = tmp_path / "out"
    work = _kill(released_random, out, 0.6)
    finished = [p.name for p in sorted(work.glob("stage-*")) if (p / "stage.json").is_file()]
    assert finished and len(finished) < len(PLAN)
    export_id = json.loads((work / finished[0] / "stage.json").read_text())["export_id"]
    calls = count_reads(monkeypatch)
    lines: list[str] = []
    export_pipeline(released_random, out, stage_plan=PLAN, max_shard_bytes=SHARD, progress=lines.append)
    resumed = len(calls)
    calls.clear()
    export_pipeline(released_random, tmp_path / "again", stage_plan=PLAN, max_shard_bytes=SHARD)
    assert 0 < resumed < len(calls)  # kept stages (and finished shards) were not read again
    assert sum("kept from the interrupted run" in line for line in lines) == len(finished)
    assert _digests(out) == _digests(fresh)
    pipe = load_pipeline(out)
    assert pipe.export_id == export_id  # the kept stages belong to the finished pipeline
    assert not (out / RESUME_DIR).exists() and not partial_path(out).exists()


def test_a_finished_stage_without_its_stage_file_is_written_again(released_random, fresh, tmp_path):
    out = tmp_path / "out"
    work = _kill(released_random, out, 0.6)
    stage = next(p for p in sorted(work.glob("stage-*")) if (p / "stage.json").is_file())
    (stage / "stage.json").unlink()  # as if killed between the stage's rename and its stage.json
    export_pipeline(released_random, out, stage_plan=PLAN, max_shard_bytes=SHARD)
    assert _digests(out) == _digests(fresh)
    load_pipeline(out)


@pytest.mark.parametrize("damaged", ["model.onnx.data.00000", "model.onnx"])
def test_a_finished_stage_changed_since_is_written_again(released_random, fresh, tmp_path, damaged):
    """A finished stage is kept only while its graph and data shards have the sha256 its stage.json recorded
    (the shards' computed while writing): one flipped byte, which every structural check passes, and the stage
    is exported again; the pipeline equals a fresh one and stage.json records what load_export reads."""
    out = tmp_path / "out"
    work = _kill(released_random, out, 0.6)
    finished = [p for p in sorted(work.glob("stage-*")) if (p / "stage.json").is_file()]
    stage = finished[0]
    recorded = json.loads((stage / "stage.json").read_text())["sha256"]
    assert recorded == {f: hashlib.sha256((stage / f).read_bytes()).hexdigest() for f in recorded}
    assert set(recorded) == {"model.onnx", *json.loads((stage / "runtime_config.json").read_text())["data_files"]}
    with open(stage / damaged, "r+b") as fh:  # a byte of the last initializer / of the graph's doc strings
        fh.seek(-9, 2)
        byte = fh.read(1)
        fh.seek(-9, 2)
        fh.write(bytes([byte[0] ^ 0x01]))
    lines: list[str] = []
    export_pipeline(released_random, out, stage_plan=PLAN, max_shard_bytes=SHARD, progress=lines.append)
    assert sum("kept from the interrupted run" in line for line in lines) == len(finished) - 1
    assert "kept" not in lines[0]  # stage 1, the damaged one
    assert _digests(out) == _digests(fresh)
    load_pipeline(out)


def test_another_plan_is_refused_or_started_over(released_random, tmp_path):
    out, other = tmp_path / "out", [range(0, 3), range(3, 6)]
    _kill(released_random, out, 0.6)
    with pytest.raises(PipelineError, match="holds an interrupted pipeline export of another source"):
        export_pipeline(released_random, out, stage_plan=other, max_shard_bytes=SHARD)
    export_pipeline(released_random, out, stage_plan=other, max_shard_bytes=SHARD, overwrite=True)
    expected = export_pipeline(released_random, tmp_path / "expected", stage_plan=other, max_shard_bytes=SHARD).out_dir
    assert load_pipeline(out).ranges == other
    assert _digests(out) == _digests(expected)  # nothing of the first plan's stages is left


def test_a_single_export_into_an_interrupted_pipeline_names_it(released_random, tmp_path):
    from k3export.converters.onnx import export_onnx
    from k3export.safety import OutputError

    out = tmp_path / "out"
    _kill(released_random, out, 0.3)
    with pytest.raises(OutputError, match="holds an interrupted k3export pipeline, not an export: finish it"):
        export_onnx(released_random, out, max_shard_bytes=SHARD)
    assert read_marker(partial_path(out))["kind"] == "pipeline"  # left as it was
