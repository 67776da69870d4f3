"""Every script under bench/ and examples/ starts in the test venv (``--help``, in a subprocess, as a user runs it),
and none is named like a module installed outside the repository.

Python puts a script's folder first on ``sys.path``, so ``bench/kernels.py`` once replaced the Hub's ``kernels``
package that transformers imports: every bench script that loaded the model failed before its first line of output.
"""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("examples/*.py")])


def test_the_scripts_are_found():
    assert {"bench/peers.py", "bench/kernel_timings.py", "examples/end_to_end.py"} <= {
        s.relative_to(ROOT).as_posix() for s in SCRIPTS}


def test_no_script_shadows_an_installed_module():
    folders = {s.parent for s in SCRIPTS}
    # the import path without the repository's own folders (its root, the script folders, pytest's tests/ entries;
    # a venv inside the repository, as CI's .venv, stays): whatever resolves there a script's module would hide
    def ours(entry: str) -> bool:
        p = Path(entry or ".").resolve()
        return p == ROOT or p in folders or p.is_relative_to(ROOT / "tests")

    path = [p for p in sys.path if not ours(p)]
    clashes = {}
    for s in SCRIPTS:
        if s.stem in sys.stdlib_module_names or s.stem in sys.builtin_module_names:
            clashes[s.name] = "the standard library"
            continue
        spec = importlib.machinery.PathFinder.find_spec(s.stem, path)
        if spec is not None and spec.origin is not None:  # a namespace portion never wins over a module
            clashes[s.name] = spec.origin
    assert not clashes, f"rename these, python puts {sorted(map(str, folders))} first on sys.path: {clashes}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.relative_to(ROOT).as_posix())
def test_script_starts(script: Path, tmp_path):
    # run from an empty folder: a script that took --help for work would leave something there
    out = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage:" in out.stdout, out.stdout[-2000:]
    assert not any(tmp_path.iterdir()), f"{script.name} --help wrote {sorted(p.name for p in tmp_path.iterdir())}"
