"""Imports point one way: modeling at the bottom (standalone for trust_remote_code), ops never above it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "k3export"


def _unit(module: str) -> str | None:
    """The architectural unit of a k3export module: a subpackage (converters split by kind) or a top module."""
    parts = module.split(".")
    if parts[0] != "k3export" or len(parts) < 2:
        return None
    return f"converters.{parts[2]}" if parts[1] == "converters" and len(parts) > 2 else parts[1]


def import_edges() -> dict[str, set[str]]:
    """unit -> units it imports (lazy imports inside functions included), from the AST of every module."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_init else parts)
        src = _unit(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_init else 0)]
                    targets = [".".join(base + [node.module])] if node.module else \
                        [".".join(base + [a.name]) for a in node.names]
                elif node.module:
                    targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                dst = _unit(target)
                if src and dst and dst != src:
                    edges.setdefault(src, set()).add(dst)
    return edges


def test_no_import_cycles_between_packages():
    edges = import_edges()

    def reaches(a: str, b: str, seen: frozenset = frozenset()) -> bool:
        return b in edges.get(a, ()) or any(x not in seen and reaches(x, b, seen | {x}) for x in edges.get(a, ()))

    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and reaches(b, a))
    assert not cycles, f"import cycles between k3export packages: {cycles}"


def test_modeling_imports_nothing_above_it():
    edges = import_edges()
    assert edges.get("modeling", set()) == set(), edges.get("modeling")
    assert "modeling" not in edges.get("ops", set()) and "plugins" not in edges.get("ops", set())


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(m for m in sys.modules if m.startswith('k3export'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_modeling_loads_no_other_k3export_module():
    loaded = _loaded_after("import k3export.modeling")
    assert all(m == "k3export" or m.startswith("k3export.modeling") for m in loaded), loaded


def test_importing_ops_loads_no_modeling_or_converter():
    loaded = _loaded_after("import k3export.ops")
    assert not [m for m in loaded if m.startswith(("k3export.modeling", "k3export.converters"))], loaded


def test_running_an_mxfp4_export_in_onnxruntime_needs_no_torch():
    """The deploy path (`mxfp4.ort_session`) stays free of torch and transformers: they cost ~430 MiB of RSS."""
    code = ("import sys; from k3export.converters.onnx.mxfp4 import ort_session; import onnxruntime; "
            "print(sorted(m for m in ('torch', 'transformers', 'k3export.ops', 'k3export.modeling') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_test_module_basenames_are_unique():
    """pytest imports test modules by basename (no packages under tests/): two equal names break collection."""
    names = [p.name for p in Path(__file__).parent.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
