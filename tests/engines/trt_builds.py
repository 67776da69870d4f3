"""What the real TensorRT engine builds of tests/engines share: TensorRT-RTX (the test extra installs it) builds
engines with no GPU. Every engine there is the tiny K3 at tiny profiles (batch <= 2, prefill <= 8 tokens, context
<= 16), built for one target (`TARGET`) at builder optimisation level 0, so each build takes seconds."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from k3export.plugins.flavour import flavour_status, load_flavour

#: what every engine is built for, and how
TARGET = "8.6"
LIMITS = {"max_batch": 2, "max_seq": 8, "max_context": 16}
OPTIMIZATION_LEVEL = 0
#: seconds each build took, by engine path
BUILD_SECONDS: dict[str, float] = {}


def rtx_reason() -> str | None:
    """Why the real builds cannot run here (None: they can)."""
    why = flavour_status()
    if why is not None:
        return why
    flavour = load_flavour()
    if not flavour.rtx:
        return f"{flavour.label} is installed: these builds need TensorRT-RTX (it builds with no GPU)"
    return flavour.plugin_problem


def export_fp32(source, tmp_path_factory, name: str, **options) -> Path:
    """`source` exported in fp32 (what every engine here is built from) into a fresh folder named after `name`."""
    from k3export.converters.onnx import export_onnx

    out = tmp_path_factory.mktemp(name) / "onnx"
    export_onnx(source, out, dtype="fp32", **options)
    return out


def build(onnx_dir: Path, engine: Path, **options) -> Path:
    from k3export.converters.tensorrt import build_engine

    t0 = time.perf_counter()
    out = build_engine(onnx_dir, engine, precision="fp32", target_cc=TARGET, optimization_level=OPTIMIZATION_LEVEL,
                       progress=None, **{**LIMITS, **options})
    BUILD_SECONDS[str(engine)] = time.perf_counter() - t0
    return out


def in_child(code: str, *args: object) -> subprocess.CompletedProcess:
    """`code` run by a fresh Python (``sys.argv[1:]`` = `args`, this folder importable), for a build TensorRT-RTX is
    expected to fail: 1.x has been seen to end the process (SIGSEGV) inside ``build_serialized_network`` on a graph
    it cannot build rather than return no engine, which would end the test session with it."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parent)
