"""Imports point one way: modeling at the bottom (standalone for trust_remote_code), ops never above it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_runtimes_import_no_converter():
    """A runtime opens an export and runs it; what both sides need (graph forms, ONNX Runtime's views of the 4-bit
    experts, readers, the contract) lives below both (`k3export.artifacts`, `k3export.modeling.contract`), and the
    PyTorch runner finds the checkpoint reader through its entry point, as `K3ForCausalLM.from_pretrained` does."""
    found: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "runtime").rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                if name.startswith("k3export.converters"):
                    found.setdefault(module, set()).add(name)
    assert found == {}


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


#: the start of a subprocess's code that fails any import of torch or transformers
NO_TORCH = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError("no " + name + " here")
sys.meta_path.insert(0, Refuse())
"""


@pytest.mark.parametrize("runner", ["ort_runner.OrtRunner", "openvino_runner.OpenVinoRunner"])
def test_decoding_an_export_in_onnxruntime_or_openvino_loads_no_torch(runner, tmp_path):
    """`OrtRunner` and `OpenVinoRunner` load, check and decode an export with torch and transformers kept out of the
    process (an import of either fails here), and with the native libraries on: ~500 MiB of RSS they do not need."""
    from k3export.converters.onnx import export_onnx
    from k3export.modeling import tiny_model

    folder = export_onnx(tiny_model(), tmp_path / "export").out_dir
    module, cls = runner.split(".")
    code = NO_TORCH + f"""
import numpy as np
from k3export.runtime.loop import Decoding
from k3export.runtime.{module} import {cls}
runner = {cls}({str(folder)!r})
d = Decoding(runner)
d.feed(np.array([[5, 6, 7, 8]]))
out = d.feed(np.array([[9]]))
print(out.logits.shape, sorted(m for m in sys.modules if m.startswith(("torch", "transformers"))))
"""
    env = {**os.environ, "K3EXPORT_ORT_OPS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == f"(1, 1, {tiny_model().config.vocab_size}) []", out.stdout


@pytest.mark.parametrize("runtime", ["ort", "openvino"])
def test_feeding_an_image_to_an_export_loads_no_torch(runtime, tmp_path):
    """An image fed to an image + text export on ONNX Runtime or OpenVINO (its vision graph, the splice and the
    decoder) runs with torch and transformers refused in the process (issue 62), and its prefill logits are
    PyTorch's `K3ForConditionalGeneration`'s on the same packed patches."""
    import numpy as np
    import torch

    from k3export.converters.onnx import export_onnx
    from k3export.modeling import tiny_vision_model

    if runtime == "openvino":
        pytest.importorskip("openvino")
    model = tiny_vision_model(seed=3)
    folder = export_onnx(model, tmp_path / "export", form="inlined" if runtime == "openvino" else "functions").out_dir
    v = model.config.vision_config
    grid = np.array([[1, 4, 2], [2, 2, 2]], np.int64)  # a picture and a 2-frame chunk: 2 + 1 merged tokens
    pixels = np.random.default_rng(0).standard_normal((int(grid.prod(1).sum()), v.in_channels, v.patch_size,
                                                      v.patch_size)).astype(np.float32)
    ids = np.array([[5, 6, *[model.config.media_placeholder_token_id] * 3, 7, 8]], np.int64)
    np.savez(tmp_path / "feed.npz", pixels=pixels, grid=grid, ids=ids)
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(pixels),
                     grid_thws=torch.from_numpy(grid)).logits.numpy()
    module, cls = {"ort": ("ort_runner", "OrtRunner"), "openvino": ("openvino_runner", "OpenVinoRunner")}[runtime]
    code = NO_TORCH + f"""
import numpy as np
from k3export.runtime.loop import Decoding, Images, with_images
from k3export.runtime.{module} import {cls}
feed = np.load({str(tmp_path / "feed.npz")!r})
out = Decoding(with_images({cls}({str(folder)!r}), Images(feed["pixels"], feed["grid"]))).feed(feed["ids"])
np.save({str(tmp_path / "logits.npy")!r}, out.logits)
print(sorted(m for m in sys.modules if m.startswith(("torch", "transformers"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    got = np.load(tmp_path / "logits.npy")
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-4, np.abs(got - want).max()


def test_running_an_mxfp4_export_in_onnxruntime_needs_no_torch():
    """The deploy path (`runtime.ort_session`) stays free of torch and transformers: they cost ~430 MiB of RSS."""
    code = ("import sys; from k3export.runtime.ort_session import ort_session; import onnxruntime; "
            "print(sorted(m for m in ('torch', 'transformers', 'k3export.ops.registry', "
            "'k3export.modeling.modeling_k3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("module", ["k3export.hub", "k3export.genai"])
def test_publishing_needs_no_torch(module):
    """`push` and genai's config writer read files only: torch and transformers (~300 MiB) stay out (issue 62)."""
    code = (f"import sys; import {module}; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_test_module_basenames_are_unique():
    """pytest imports test modules by basename (no packages under tests/): two equal names break collection."""
    names = [p.name for p in Path(__file__).parent.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


# ------------------------------------------------------------------ file level: no circle, lazy imports included


def module_edges() -> dict[str, set[str]]:
    """k3export module -> the k3export modules it imports, lazy imports inside functions included. ``from pkg
    import sub`` is an edge to the submodule ``pkg.sub`` (to ``pkg`` itself only for names that are not
    submodules); a module importing a package it lives in is no edge (Python runs that ``__init__`` first)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    edges: dict[str, set[str]] = {}
    for module, (path, is_init) in files.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(module.split(".")[: len(module.split(".")) - node.level + is_init])
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module or ""
                subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in files]
                targets = subs + ([source] if len(subs) < len(node.names) else [])
            out.update(t for t in targets if t in files and t != module and not module.startswith(t + "."))
        edges[module] = out
    return edges


def import_circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_between_files():
    edges = module_edges()
    circles = import_circles(edges)
    assert not circles, "import circles: " + "; ".join(
        " ".join(f"{a} -> {sorted(edges[a] & set(c))}" for a in c) for c in circles)


def test_the_circle_finder_finds_a_lazy_circle():
    """The check above can fail: a lazy import inside a function closes a circle as a top-level one does."""
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


#: a file this long must say why in its docstring, with this phrase
LONG_FILE_LINES, LONG_FILE_REASON = 700, "Long file:"


def test_long_files_state_why():
    long = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > LONG_FILE_LINES and LONG_FILE_REASON not in doc:
            long.append(f"{path.relative_to(PACKAGE.parent)} ({text.count(chr(10))} lines)")
    assert not long, f"files over {LONG_FILE_LINES} lines without a {LONG_FILE_REASON!r} line in the docstring: {long}"


def test_modeling_file_is_the_maths():
    """modeling_k3.py reads as K3's maths: the speed machinery lives behind its hooks in k3export.ops, loading in
    loading_k3.py and the cache's named states in contract.py."""
    lines = (PACKAGE / "modeling" / "modeling_k3.py").read_text(encoding="utf-8").count("\n")
    assert lines <= 850, lines


def test_packages_import_only_those_listed_before_them():
    """The order in k3export's package docstring is the architecture: no package imports one listed after it."""
    import k3export

    order: list[str] = []
    for line in (k3export.__doc__ or "").splitlines():
        word = line.strip().split(" ", 1)[0]
        if line.startswith("    ") and (PACKAGE / word).is_dir():
            order.append(word)
    assert order[:2] == ["modeling", "ops"] and "hub" in order, order
    rank = {unit: order.index(unit.split(".")[0]) for unit in import_edges() if unit.split(".")[0] in order}
    up = sorted(f"{a} -> {b}" for a, bs in import_edges().items() for b in bs
                if a in rank and b in rank and rank[b] > rank[a])
    assert not up, f"imports against the order of k3export's docstring: {up}"
