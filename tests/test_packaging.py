"""The package list in pyproject.toml must name every package of the library (it is explicit because
./cli installs as `k3export_cli`); `cli` itself must never install as a top-level module."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_library_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        str(p.parent.relative_to(ROOT)).replace("/", ".")
        for p in (ROOT / "k3export").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert on_disk - listed == set(), f"add these to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert "cli" not in listed and "k3export_cli" in listed


def test_library_never_imports_the_cli():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "k3export").rglob("*.py")
        if "k3export_cli" in p.read_text() or "from cli" in p.read_text() or "import cli" in p.read_text()
    ]
    assert offenders == []


def test_every_library_data_file_is_shipped():
    """Files the library reads at run time that are not Python (the C++ kernels' source) match package-data."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["k3export"]
    data = [p for p in (ROOT / "k3export").rglob("*") if p.is_file() and p.suffix in (".cpp", ".h", ".typed")]
    unshipped = [str(p.relative_to(ROOT)) for p in data
                 if not any(p.relative_to(ROOT / "k3export").match(g) for g in globs)]
    assert data and unshipped == [], f"add these to [tool.setuptools.package-data]: {unshipped}"


def test_the_wheel_builds_without_a_warning_and_ships_the_data(tmp_path):
    """setuptools builds the wheel without a warning (it warned that k3export/ops/csrc, a folder of C++ sources, is
    an importable package missing from `packages`), with the data files in it and no top-level `cli`."""
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("k3export", "cli"):
        shutil.copytree(ROOT / folder, src / folder, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-w", str(tmp_path / "wheel")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "Warning:" not in log, log  # setuptools' warnings: SetuptoolsDeprecationWarning:, BuildBackendWarning:
    names = set(zipfile.ZipFile(next((tmp_path / "wheel").glob("k3export-*.whl"))).namelist())
    assert {"k3export/py.typed", "k3export/ops/csrc/cpu_decode.cpp", "k3export_cli/main.py"} <= names
    assert not [n for n in names if n.startswith("cli/")]
