"""The examples run as documented (the GPU script is syntax-checked only: CI has no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_end_to_end_example(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "end_to_end.py"), str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "validation passed" in out.stdout and "model.onnx" in out.stdout
    report = json.loads((tmp_path / "work" / "onnx" / "validation.json").read_text())
    assert report["passed"] is True and "ort" in report["runtimes"]


def test_gpu_script_parses():
    res = subprocess.run(["bash", "-n", str(ROOT / "examples" / "validate_gpu.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
