"""Shared by the resume tests: run a script that kills itself with SIGKILL partway, and count the checkpoint
tensors a later run reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from k3export.converters.onnx.weights import CheckpointSource
from k3export.safety import partial_path, read_marker


def run_killed(script: str, *args: object, out: Path) -> Path:
    """Run `script` (``python -c``) with `args`; it must die by SIGKILL leaving output `out` unfinished: no `out`,
    a partial folder marked partial, which this returns."""
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    work = partial_path(out)
    assert not out.exists() and read_marker(work)["state"] == "partial"
    return work


def count_reads(monkeypatch) -> list[str]:
    """The names `CheckpointSource.get` is asked for from now on (for the rest of the test)."""
    calls: list[str] = []
    get = CheckpointSource.get

    def counting(self, name):
        calls.append(name)
        return get(self, name)

    monkeypatch.setattr(CheckpointSource, "get", counting)
    return calls
