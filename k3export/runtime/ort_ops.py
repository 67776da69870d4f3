"""The k3 custom-op library of ONNX Runtime: ``k3::kda``, ``k3::situ_glu``, ``k3::moe_route``, ``k3::moe_experts``
and ``k3::moe_experts_mxfp4`` as native CPU kernels (fp32), built from the project's C++ source at first use.

Registered on a session (`register`), the library makes ORT run each k3 node of an export's functions form as one
kernel instead of expanding its model-local function body into standard ops (ORT 1.32 picks a registered kernel
over the function of the same domain and name; a graph the kernels do not take, e.g. bfloat16, keeps its bodies).
An export's 4-bit experts run through ``moe_route_experts_mxfp4`` / ``moe_experts_nvfp4`` on the file's own bytes
(`takes`, then `k3export.artifacts.expert_views.packed_view`), and the fused ops the exporter writes
(`k3export.ops.spec.FUSED_SPECS`) through kernels of their own. The source is ``k3export/ops/csrc/ort_k3.cpp`` (the
registrations), one file per op under ``ort_k3/`` over ``ops/csrc/kernels/`` (one header per op's kernel) and the op
table's attribute structs (`k3export.ops.sources.attributes_header`, written into the build's include folder), built
with ONNX Runtime's C/C++ headers (`native.ort_headers`: a pinned Debian package, MIT) into ``$K3EXPORT_CACHE`` (default
``$XDG_CACHE_HOME/k3export``, ``~/.cache/k3export``) ``/ort-ops/``; the library's name carries a hash of its sources
(`native.build_cached`; ``python -m k3export.runtime.build_native`` builds it ahead).
Sessions on the CPU provider alone use it on every graph it takes
(``K3EXPORT_ORT_OPS=0`` turns it off; `used` is the rule): it decodes faster than the function bodies and holds MXFP4
experts at 4.25 bits (docs/speed.md has the figures). When it cannot be built (no compiler, no headers, no
network) `library` says why in one logged line and returns None, and sessions run the function bodies.
Nothing here imports torch.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from k3export import switches
from k3export.ops.sources import CSRC, attributes_header, binding_sources, write_attributes_header
from k3export.ops.spec import ALL_SPECS, FUSED_SPECS, LIBRARY_SPECS

from .native import ARCH, BuildError, build_cached, cache_root, computes_in_fp32, ort_headers

SOURCES = binding_sources(CSRC / "ort_k3.cpp")
ENV_SWITCH = "K3EXPORT_ORT_OPS"
#: the library's ops and their input counts, from their contracts (`k3export.ops.spec`). Its kernels are fp32 only.
KERNEL_INPUTS = {name: len(spec.inputs) for name, spec in ALL_SPECS.items()}
#: TensorProto FLOAT4E2M1 and FLOAT8E8M0: the element types of an MXFP4 export's experts and scales
_MXFP4_TYPES = (23,) * 3 + (24,) * 3
#: FLOAT4E2M1, FLOAT8E4M3FN and FLOAT: an NVFP4 export's experts, block scales and global scales
_NVFP4_TYPES = (23,) * 3 + (17,) * 3 + (1,) * 3
_log = logging.getLogger(__name__)


def build(root: Path | None = None, sources: tuple[Path, ...] = SOURCES, arch: str = ARCH) -> Path:
    """The library, built into `root` (default ``cache_root("ort-ops")``) for ``-march={arch}`` unless a build of these
    sources is there (`native.build_cached`); raises BuildError saying why it cannot be built. `sources`: the binding
    and the kernel headers it includes (`binding_sources`: a test builds an edited copy, a bench a git revision's);
    `arch`: a test also builds the kernels'
    portable vector code, which a CPU without AVX-512 runs."""
    root = root or cache_root("ort-ops")
    return build_cached(root, "k3_ort_ops", sources, attributes_header(), lambda cxx, out, flags: [
        cxx, *flags, f"-I{ort_headers(root)}", f"-I{write_attributes_header(root / 'include')}", str(sources[0]),
        "-o", str(out)], arch)


@functools.cache
def library() -> Path | None:
    """The built library, or None (logged once, one line) when it cannot be built here."""
    try:
        return build()
    except BuildError as exc:
        _log.warning("k3export: ONNX Runtime k3 ops unavailable (%s); the k3 function bodies run", exc)
        return None


def takes(model: Any) -> bool:
    """Whether the library's kernels take every k3 node of `model` (an ``onnx.ModelProto``, weights not needed): each
    is one of its ops with that op's inputs, or a 4-bit ``moe_experts`` / ``moe_route_experts`` of an export's file
    (its experts FLOAT4E2M1 with E8M0 or E4M3 scales: the library's kernels take them once
    `expert_views.packed_view` retypes them; ORT's 8-bit form, ``model.genai.onnx``, is not taken), and the graph
    computes in fp32 (no fp16 / bf16 / double initializer, input or output). A registered custom op replaces the
    schema of the function of its name for every node, so ORT would reject a node whose types the kernel lacks."""
    from k3export.artifacts.expert_views import is_expert_node

    graph = model.graph
    types = {t.name: t.data_type for t in graph.initializer}
    for node in graph.node:
        spec = LIBRARY_SPECS.get(node.op_type)
        if node.domain != "k3" or (spec is not None and spec.takes_inputs(len(node.input))):
            continue
        # by its fields: protobuf's Python wrappers are made per access, so an id() names no node for long
        if not is_expert_node(node) or tuple(types.get(n) for n in node.input[3:]) not in (_MXFP4_TYPES, _NVFP4_TYPES):
            return False
    return computes_in_fp32(graph)


#: the export files `note_unfused` has told about
_told: set[str] = set()


def fused(model: Any) -> bool:
    """Whether `model`'s main graph holds any of the library's fused ops (`k3export.ops.spec.FUSED_SPECS`), which
    the exporter writes (``k3export export --kernels``, the default for the forms that keep k3 functions)."""
    return any(n.domain == "k3" and n.op_type in FUSED_SPECS for n in model.graph.node)


def note_unfused(model: Any, where: Any) -> bool:
    """Log once per file that `model` (read from `where`) keeps k3 functions but no fused op (an export written
    before the exporter wrote them, or with ``--no-kernels``): the library runs its k3 ops, the rest as standard
    ops, slower. Whether it did."""
    if fused(model) or not any(n.domain == "k3" for n in model.graph.node) or str(where) in _told:
        return False
    _told.add(str(where))
    _log.warning("k3export: %s holds none of the k3 library's fused ops, so it runs slower; export it again "
                 "(`k3export export ... --kernels`, the default for the functions form) to write them", where)
    return True


def enabled(providers: list[str] | None = None) -> bool:
    """Whether sessions on `providers` (default: the CPU provider) use the library unless told otherwise: those on
    the CPU provider alone (its kernels are CPU kernels; another provider runs the bodies itself), unless
    ``K3EXPORT_ORT_OPS=0`` (or off / false: `k3export.switches`)."""
    cpu_only = (providers or ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    return cpu_only and switches.flag(ENV_SWITCH)


def used(model: Any, providers: list[str] | None = None, switch: bool | None = None) -> bool:
    """Whether a session on `providers` runs `model`'s k3 nodes with the library: it is on (`switch`, else
    `enabled`), takes the graph (`takes`) and is built here."""
    on = enabled(providers) if switch is None else switch
    return on and takes(model) and library() is not None


def register(options: Any) -> bool:
    """Register the library on ``onnxruntime.SessionOptions`` `options`; False when there is none (`library` said
    why)."""
    lib = library()
    if lib is None:
        return False
    options.register_custom_ops_library(str(lib))
    return True


__all__ = ["KERNEL_INPUTS", "SOURCES", "build", "enabled", "fused", "library", "note_unfused", "register", "takes",
           "used"]
