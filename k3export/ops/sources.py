"""Where the k3 ops' native sources live (torch-free): ``ops/csrc/kernels/`` holds one header per op's CPU kernel
(``kda.h``, ``moe_experts_mxfp4.h``, ...; ``common.h`` what they share), and ``ops/csrc/`` the thin bindings that
include them: ``ort_k3.cpp`` (ONNX Runtime) and ``ov_k3.cpp`` (OpenVINO), each an entry point with one file per
op under ``ort_k3/`` / ``ov_k3/``, and ``cpu_decode.cpp`` (torch). Both bindings read each op's name and attributes
through ``k3_attributes.h``, which `attributes_header` derives from the op table at build time."""

from __future__ import annotations

from pathlib import Path

CSRC = Path(__file__).resolve().with_name("csrc")


#: the header `attributes_header` writes, which both bindings include (from the build's include folder)
ATTRIBUTES_HEADER = "k3_attributes.h"
_CXX = {int: "int64_t", float: "float", str: "std::string"}


def attributes_header() -> str:
    """C++ of every library op's attributes, derived from the op table (`k3export.ops.spec.LIBRARY_SPECS`): per op a
    struct ``k3::attrs::<Op>`` (``moe_route_experts`` -> ``MoeRouteExperts``) with the op's ``name``, one member per
    attribute and ``visit(v)``, which calls ``v(name, member, required)`` for each. Each binding reads a node's
    attributes through it with a visitor of its runtime's API (ONNX Runtime's kernel info, OpenVINO's attribute visitor
    and ONNX node), so no attribute name is written in C++ by hand. The native builds write it into their include
    folder."""
    from .spec import LIBRARY_SPECS

    out = ["// Generated from k3export/ops/spec.py (k3export.ops.sources.attributes_header) by each native build.",
           "#pragma once", "", "#include <cstdint>", "#include <string>", "", "namespace k3::attrs {", ""]
    for name, spec in sorted(LIBRARY_SPECS.items()):
        fields = [(n, t, True) for n, t in spec.attributes] + [(n, t, False) for n, t in spec.library_attributes]
        calls = "".join(f' v("{n}", {n}, {"true" if req else "false"});' for n, t, req in fields)
        out += [f"struct {''.join(w.capitalize() for w in name.split('_'))} {{",
                f'  static constexpr const char* name = "{name}";',
                *(f"  {_CXX[t]} {n}{{}};" for n, t, _ in fields),
                "  template <class V>",
                f"  void visit(V&&{' v' if fields else ''}) {{{calls}{' ' if fields else ''}}}", "};", ""]
    out += ["}  // namespace k3::attrs", ""]
    return "\n".join(out)


def write_attributes_header(folder: Path) -> Path:
    """`attributes_header` as `folder`/``ATTRIBUTES_HEADER`` (atomically; unchanged when it holds the same text):
    the include folder of a native build."""
    import os

    text = attributes_header()
    path = folder / ATTRIBUTES_HEADER
    if not path.is_file() or path.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return folder


def binding_sources(binding: Path) -> tuple[Path, ...]:
    """`binding`, the kernel headers beside it (``kernels/*.h``) and its own headers (the folder of its stem:
    ``ov_k3/*.hpp``), sorted: what a build of it reads, and so what its cache key hashes. A copy of the folder (a
    test's edited kernels, a bench's git revision) is read the same."""
    return (binding, *sorted((binding.parent / "kernels").glob("*.h")), *sorted(binding.with_suffix("").glob("*.hpp")))


__all__ = ["ATTRIBUTES_HEADER", "CSRC", "attributes_header", "binding_sources", "write_attributes_header"]
