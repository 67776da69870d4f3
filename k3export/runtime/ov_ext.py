"""The k3 extension library of OpenVINO: ``k3::kda``, ``k3::situ_glu``, ``k3::moe_route`` and ``k3::moe_experts``
(dense fp32, or MXFP4 over the export's own FLOAT4E2M1 / FLOAT8E8M0 bytes), and the fused ops the exporter writes
(`k3export.ops.spec.FUSED_SPECS`), as OpenVINO operations with native CPU kernels, and the ONNX frontend
conversions that map an export's ``k3`` nodes onto them, built from the project's C++ source at first use
(`k3export.runtime.native`, which builds ONNX Runtime's library too).

OpenVINO's ONNX frontend expands no model-local function, so without this library it reads only the ``inlined``
graph form (every k3 function inlined into standard ops: KDA chunked, the experts as a ``Loop``). With it
(`add_to` a ``Core``), the frontend turns each ``k3`` node of the ``functions`` form, the file ONNX Runtime runs,
into one operation whose ``evaluate`` calls the kernel. `general_branches` prepares that form for OpenVINO once
read: each ``If`` becomes its else branch, the one that computes at every length (MLA's query blocks: the one-call
attention; a state-window export's one-token KDA: the general window), as TensorRT's form of the graph does
(OpenVINO 2026.4's CPU plugin mis-runs an ``If`` with a dynamically shaped output: ``k3export.artifacts.graph_forms``).

The source is ``k3export/ops/csrc/ov_k3.cpp`` (the entry point), one file per operation under ``ov_k3/`` over
``ops/csrc/kernels/`` (one header per op's kernel, shared with ONNX Runtime's library) and the op table's attribute
structs (`k3export.ops.sources.attributes_header`). It is built with g++ against the headers and libraries that
the ``openvino`` wheel ships (``openvino/include``, ``openvino/libs``), nothing fetched, into ``$K3EXPORT_CACHE`` (default
``$XDG_CACHE_HOME/k3export``, ``~/.cache/k3export``) ``/ov-ext/``; the library's name carries a hash of its sources,
the flags, the OpenVINO version and the CPU (~5 s, once). `OpenVinoRunner` uses it on every fp32
functions-form export (``K3EXPORT_OV_EXT=0`` turns it off): it decodes faster than the inlined form (docs/speed.md has
the figures). When it cannot be built, `unavailable` says why in one line, and the runner reads the functions form
with its function bodies inlined instead (`openvino_session.read_inlined`: standard ops, slower).
Nothing here imports torch.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from k3export import switches

from k3export.ops.sources import CSRC, attributes_header, binding_sources, write_attributes_header
from k3export.ops.spec import FUSED_SPECS

from .native import BuildError, build_cached, cache_root, computes_in_fp32
from .ort_ops import KERNEL_INPUTS

SOURCES = binding_sources(CSRC / "ov_k3.cpp")
ENV_SWITCH = "K3EXPORT_OV_EXT"
#: the library's ONNX nodes of domain k3 with a fixed input count and the counts it converts (moe_experts: dense 6,
#: MXFP4 9; the fused moe_route_experts: dense, or MXFP4 as the export writes it); the other fused ops take theirs
#: from their contracts (`k3export.ops.spec.FUSED_SPECS`, `OpSpec.takes_inputs`)
NODE_INPUTS = {op: (n,) for op, n in KERNEL_INPUTS.items() if op != "moe_experts_mxfp4"} | {
    "moe_experts": (KERNEL_INPUTS["moe_experts"], KERNEL_INPUTS["moe_experts_mxfp4"]),
    "moe_route_experts": tuple(len(FUSED_SPECS[op].inputs) for op in ("moe_route_experts", "moe_route_experts_mxfp4"))}
#: the wheel's libraries the binding links (versioned names: the wheel ships no unversioned symlinks)
_LIBS = ("libopenvino.so", "libopenvino_onnx_frontend.so", "libtbb.so")


def _wheel() -> tuple[str, Path, list[Path]]:
    """(OpenVINO's version, its include folder, the libraries to link) from the installed wheel."""
    try:
        import openvino
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken native library
        raise BuildError(f"openvino is not importable ({type(exc).__name__})") from None
    root = Path(openvino.__file__).resolve().parent
    include, libs = root / "include", root / "libs"
    if not (include / "openvino" / "frontend" / "onnx" / "extension" / "conversion.hpp").is_file():
        raise BuildError(f"the openvino wheel at {root} ships no C++ headers")
    found = []
    for name in _LIBS:
        hits = sorted(libs.glob(name + "*"))
        if not hits:
            raise BuildError(f"the openvino wheel at {root} has no {name}")
        found.append(hits[0])
    return openvino.__version__, include, found


def build(root: Path | None = None, sources: tuple[Path, ...] = SOURCES) -> Path:
    """The library, built into `root` (default ``native.cache_root("ov-ext")``) unless a build of these sources is
    there; raises BuildError saying why it cannot be built. Concurrent builders wait on one lock; the file appears by rename.
    `sources`: the binding and the kernel headers it includes (`binding_sources`: a test builds an edited copy)."""
    version, include, libs = _wheel()
    root = root or cache_root("ov-ext")
    return build_cached(root, "k3_ov_ext", sources, version + attributes_header(), lambda cxx, out, flags: [
        cxx, *flags, f"-I{include}", f"-I{write_attributes_header(root / 'include')}", str(sources[0]), "-o",
        str(out), *map(str, libs), f"-Wl,-rpath,{libs[0].parent}"])


@functools.cache
def _built() -> Path | str:
    try:
        return build()
    except BuildError as exc:
        return str(exc)


def library() -> Path | None:
    """The built library, or None when it cannot be built here (`unavailable` says why)."""
    built = _built()
    return built if isinstance(built, Path) else None


def unavailable() -> str | None:
    """Why the library cannot be built here (one line), or None when it can."""
    built = _built()
    return None if isinstance(built, Path) else built


def enabled() -> bool:
    """Whether `OpenVinoRunner` runs a functions-form export through the library: unless ``K3EXPORT_OV_EXT=0`` (or
    off / false: `k3export.switches`)."""
    return switches.flag(ENV_SWITCH)


def takes(model: Any) -> bool:
    """Whether the library converts every k3 node of `model` (an ``onnx.ModelProto``, weights not needed): each is
    one of its nodes with one of its input counts, and the graph computes in fp32 (no fp16 / bf16 / double
    initializer, input or output: the operations are fp32 only)."""
    graph = model.graph
    for node in graph.node:
        fused = FUSED_SPECS.get(node.op_type)
        n = len(node.input)
        if node.domain == "k3" and n not in NODE_INPUTS.get(node.op_type, ()) and not (fused and fused.takes_inputs(n)):
            return False
    return computes_in_fp32(graph)


def general_branches(graph: Any) -> int:
    """Replace, in place, each ``If`` of `graph` (an ``openvino.Model`` read from the functions form) by its else
    branch; the number replaced. Every ``If`` the graph builder and the k3 function bodies write keeps in its else
    branch the computation valid at every length, and in its then branch a shortcut for some lengths
    (`k3export.artifacts.graph_forms.TRT_SKIPPED_BRANCHES`: MLA's query blocks for a long prompt, a state window's
    one-token KDA; in the bodies, KDA's one-token step and the experts' few-token gather, which matter once the
    bodies are inlined); the frontend keeps no branch names, so the rule is that invariant."""
    done = 0
    for op in graph.get_ordered_ops():
        if op.get_type_name() != "If":
            continue
        body = op.get_else_body()
        params, results = body.get_parameters(), body.get_results()
        for d in op.get_input_descriptions(1):  # the else body's parameters take the If's inputs
            params[d.body_parameter_index].output(0).replace(op.input_value(d.input_index))
        for d in op.get_output_descriptions(1):
            op.output(d.output_index).replace(results[d.body_value_index].input_value(0))
        done += 1
    if done:
        graph.validate_nodes_and_infer_types()
    return done


__all__ = ["ENV_SWITCH", "NODE_INPUTS", "SOURCES", "build", "enabled", "general_branches", "library",
           "takes", "unavailable"]
