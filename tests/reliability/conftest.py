"""Fixtures of the reliability corpus; the harness itself (running the CLI, checking what a run leaves) is in
`_harness.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import SHARD, Cli  # noqa: E402


@pytest.fixture(scope="session")
def cli():
    runner = Cli()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def released(tmp_path_factory) -> Path:
    """A tiny released-layout (MXFP4 experts) checkpoint in 3 shards, with tokenizer files."""
    from k3export.converters.checkpoints.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("released") / "Kimi-K3-tiny", num_shards=3)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """A tiny checkpoint in our layout, written by `k3export tiny`'s library function."""
    from k3export.checkpoint_io import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "k3-tiny")


@pytest.fixture(scope="session")
def exported(tiny, tmp_path_factory) -> Path:
    """An ONNX export of `tiny` (fp32, with weights)."""
    from k3export.converters.onnx import export_onnx

    out = tmp_path_factory.mktemp("exported") / "k3-tiny-onnx"
    export_onnx(tiny, out)
    return out


@pytest.fixture(scope="session")
def converted(released, tmp_path_factory) -> tuple[Path, dict]:
    """The reference conversion of `released` (what every resumed conversion must equal, byte for byte)."""
    from k3export.converters.checkpoints import convert

    out = tmp_path_factory.mktemp("converted") / "out"
    return out, convert(released, out, max_shard_bytes=SHARD)




@pytest.fixture(scope="session")
def pipelined(tiny, tmp_path_factory) -> Path:
    """A 2-stage pipeline export of `tiny` (fp32, with weights)."""
    from k3export.pipeline import export_pipeline

    out = tmp_path_factory.mktemp("pipelined") / "k3-tiny-pipeline"
    export_pipeline(tiny, out, stages=2)
    return out


@pytest.fixture(scope="session")
def pipelined_other(tiny, tmp_path_factory) -> Path:
    """Another pipeline export of `tiny`, the same stages: only its export id differs from `pipelined`'s."""
    from k3export.pipeline import export_pipeline

    out = tmp_path_factory.mktemp("pipelined-other") / "k3-tiny-pipeline"
    export_pipeline(tiny, out, stages=2)
    return out
