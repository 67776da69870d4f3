"""The package list in pyproject.toml must name every package of the library (it is explicit because
./cli installs as `k3export_cli`); `cli` itself must never install as a top-level module."""

from __future__ import annotations

import tomllib
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
