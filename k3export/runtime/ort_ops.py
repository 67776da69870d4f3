"""The k3 custom-op library of ONNX Runtime: ``k3::kda``, ``k3::situ_glu``, ``k3::moe_route``, ``k3::moe_experts``
and ``k3::moe_experts_mxfp4`` as native CPU kernels (fp32), built from the project's C++ source at first use.

Registered on a session (`register`), the library makes ORT run each k3 node of an export's functions form as one
kernel instead of expanding its model-local function body into standard ops (ORT 1.32 picks a registered kernel
over the function of the same domain and name; a graph the kernels do not take, e.g. bfloat16, keeps its bodies).
An MXFP4 export's experts run through ``moe_experts_mxfp4`` on the file's own 4-bit bytes (`takes`, then
`k3export.converters.onnx.mxfp4.packed_model`); the standard-op patterns of the file that
`k3export.converters.onnx.fusions` knows through kernels of their own.
The source is ``k3export/ops/csrc/ort_k3.cpp`` (the binding) over ``k3_kernels.h`` (the kernels). Its build needs g++
and ONNX Runtime's C/C++ headers, which PyPI's wheel lacks: they come from Debian's ``libonnxruntime-dev`` (MIT;
the C API is append-only, so a library built against its 1.21 headers loads into later ORT), fetched once with
``apt-get download`` and unpacked with ``dpkg -x``, nothing installed. Headers and library are cached under
``$K3EXPORT_CACHE`` (default ``$XDG_CACHE_HOME/k3export``, ``~/.cache/k3export``), in ``ort-ops/``; the library's
name carries a hash of its sources. Sessions on the CPU provider alone use it on every graph it takes
(``K3_ORT_OPS=0`` turns it off; `used` is the rule): it decodes faster than the function bodies and holds MXFP4
experts at 4.25 bits (docs/speed.md has the figures). When it cannot be built (no compiler, no headers, no
network) `library` says why in one logged line and returns None, and sessions run the function bodies.
Nothing here imports torch.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3export import switches
from k3export.files import file_sha256
from k3export.safety import write_bytes_atomic
from k3export.ops.spec import ALL_SPECS

CSRC = Path(__file__).resolve().parent.parent / "ops" / "csrc"
SOURCES = (CSRC / "ort_k3.cpp", CSRC / "k3_kernels.h")
#: Debian's package of ONNX Runtime's headers, and the suite it is taken from
HEADERS_PACKAGE, HEADERS_SUITE = "libonnxruntime-dev", "trixie"
HEADER = "onnxruntime_lite_custom_op.h"
ENV_SWITCH = "K3_ORT_OPS"
#: the library's ops and their input counts, from their contracts (`k3export.ops.spec`). Its kernels are fp32 only.
KERNEL_INPUTS = {name: len(spec.inputs) for name, spec in ALL_SPECS.items()}
#: TensorProto FLOAT4E2M1 and FLOAT8E8M0: the element types of an MXFP4 export's experts and scales
_MXFP4_TYPES = (23,) * 3 + (24,) * 3
#: FLOAT4E2M1, FLOAT8E4M3FN and FLOAT: an NVFP4 export's experts, block scales and global scales
_NVFP4_TYPES = (23,) * 3 + (17,) * 3 + (1,) * 3
#: the compiler flags of the native libraries (this one and OpenVINO's), less the target (`build_cached`'s ``arch``)
FLAGS = ("-O3", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
#: the target they are built for: the CPU they run on (the cache key holds its model and flags, for a home shared
#: across machines)
ARCH = "native"
_DIGEST_MAX_BYTES = 128  # a recorded digest: 64 hex digits and a newline
_OTHER_FLOATS = frozenset({10, 11, 16})  # TensorProto FLOAT16, DOUBLE, BFLOAT16
_log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """Why the library cannot be built here (one line)."""


def cache_root(folder: str = "ort-ops") -> Path:
    """Where a native library (and what its build fetches) is kept: `folder` under ``$K3EXPORT_CACHE``, default
    ``$XDG_CACHE_HOME/k3export`` (``~/.cache/k3export``)."""
    chosen = switches.choice("K3EXPORT_CACHE")
    if chosen:
        return Path(chosen) / folder
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "k3export" / folder


def computes_in_fp32(graph: Any) -> bool:
    """Whether an ONNX graph holds no fp16, bf16 or double initializer, input or output: what the native
    libraries' fp32 kernels take (this one and OpenVINO's, `ov_ext`)."""
    if any(t.data_type in _OTHER_FLOATS for t in graph.initializer):
        return False
    return not any(v.type.tensor_type.elem_type in _OTHER_FLOATS for v in (*graph.input, *graph.output))


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{what}: {exc}") from None
    if done.returncode:
        lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        raise BuildError(f"{what} failed: {lines[-1] if lines else f'exit {done.returncode}'}")


def _cpuinfo() -> list[str]:
    """The first processor's lines of /proc/cpuinfo ([] where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().split("\n\n")[0].splitlines()
    except OSError:
        return []


def _cpu() -> str:
    """This CPU's model name and flags (the first processor's in /proc/cpuinfo), or the machine type."""
    import platform

    return platform.machine() + "".join(ln for ln in _cpuinfo() if ln.startswith(("model name", "flags")))


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (``avx2``, ``avx512f``, ...; empty where it has none):
    whether it can run a library `build` for another ``arch``."""
    return {w for ln in _cpuinfo() if ln.startswith("flags") for w in ln.split(":", 1)[1].split()}


def headers(root: Path) -> Path:
    """The folder holding ``onnxruntime_lite_custom_op.h``: the system's, else Debian's package unpacked in `root`."""
    for folder in (Path("/usr/include/onnxruntime"), root / "headers" / "usr" / "include" / "onnxruntime"):
        if (folder / HEADER).is_file():
            return folder
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise BuildError(f"no ONNX Runtime headers and no {tool} to fetch {HEADERS_PACKAGE}")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="headers-") as tmp:
        d = Path(tmp)
        (d / "lists" / "partial").mkdir(parents=True)
        (d / "sources.list").write_text(f"deb http://deb.debian.org/debian {HEADERS_SUITE} main\n")
        apt = ["apt-get", "-q", "-o", f"Dir::Etc::sourcelist={d / 'sources.list'}", "-o",
               "Dir::Etc::sourceparts=/dev/null", "-o", f"Dir::State::Lists={d / 'lists'}"]
        _run(apt + ["update"], f"apt-get update (Debian {HEADERS_SUITE}, for {HEADERS_PACKAGE})")
        _run(apt + ["download", HEADERS_PACKAGE], f"apt-get download {HEADERS_PACKAGE}", cwd=d)
        debs = sorted(d.glob(f"{HEADERS_PACKAGE}_*.deb"))
        if not debs:
            raise BuildError(f"apt-get download {HEADERS_PACKAGE} left no .deb")
        _run(["dpkg", "-x", str(debs[-1]), str(d / "x")], f"dpkg -x {debs[-1].name}")
        if not (d / "x" / "usr" / "include" / "onnxruntime" / HEADER).is_file():
            raise BuildError(f"{debs[-1].name} has no usr/include/onnxruntime/{HEADER}")
        shutil.rmtree(root / "headers", ignore_errors=True)
        os.replace(d / "x", root / "headers")
    return root / "headers" / "usr" / "include" / "onnxruntime"


def build_cached(root: Path, stem: str, sources: tuple[Path, ...], key: str,
                 command: Callable[[str, Path, tuple[str, ...]], list[str]], arch: str = ARCH) -> Path:
    """``root/lib{stem}-{hash}.so`` of `sources` (the binding first, then the headers it includes), built by
    ``command(compiler, output, flags)`` (`FLAGS` and ``-march={arch}``) unless a build of the same sources, flags,
    `key` and CPU is there; BuildError saying why it cannot be built. Concurrent builders wait on one lock (`command`
    runs under it: it may fetch what it needs into `root`); the file appears by rename. Shared by this library and
    OpenVINO's (`ov_ext`).

    A build records the library's sha256 beside it (``.so.sha256``), and a cached library is returned only when it
    still has that digest (`verified`): one cut short or overwritten would kill the process that maps it (SIGBUS)
    or fail inside the runtime's loader, so it is built again instead."""
    flags = (*FLAGS, f"-march={arch}")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(flags).encode() + key.encode()
                            + _cpu().encode()).hexdigest()[:16]
    lib = root / f"lib{stem}-{digest}.so"
    if verified(lib):
        return lib
    compiler = shutil.which(os.environ.get("CXX") or "g++") or (None if os.environ.get("CXX") else shutil.which("c++"))
    if compiler is None:
        raise BuildError(f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) found")
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = os.open(root / ".lock", os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError as exc:
        raise BuildError(f"cache folder {root}: {exc.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if verified(lib):
            return lib
        if os.path.lexists(lib):
            _log.warning("k3export: %s does not match the digest recorded when it was built; building it again",
                         lib)
        tmp = lib.with_name(f".{lib.name}.{os.getpid()}.tmp")
        try:
            _run(command(compiler, tmp, flags), f"{Path(compiler).name} {sources[0].name}")
            # the digest first: a run stopped between the two leaves a library that fails `verified`, not one
            # that passes unchecked
            write_bytes_atomic(root, digest_path(lib).name, file_sha256(tmp) + "\n")
            os.replace(tmp, lib)
        except OSError as exc:
            raise BuildError(f"cache folder {root}: {exc.strerror or exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
        if not verified(lib):
            raise BuildError(f"{lib} changed while it was being built (another process writing the cache?)")
        return lib
    finally:
        os.close(lock)


def digest_path(lib: Path) -> Path:
    """Where the sha256 of built library `lib` is recorded (``lib....so.sha256``)."""
    return lib.with_name(lib.name + ".sha256")


def verified(lib: Path) -> bool:
    """Whether `lib` is a regular file with the sha256 recorded when k3export built it (`digest_path`): only then
    is it loaded."""
    try:
        if not stat.S_ISREG(os.lstat(lib).st_mode):
            return False
        with open(digest_path(lib), "rb") as fh:
            recorded = fh.read(_DIGEST_MAX_BYTES).decode("ascii", "replace").strip()
        return recorded == file_sha256(lib)
    except OSError:
        return False


def build(root: Path | None = None, sources: tuple[Path, ...] = SOURCES, arch: str = ARCH) -> Path:
    """The library, built into `root` (default `cache_root`) for ``-march={arch}`` unless a build of these sources is
    there (`build_cached`); raises BuildError saying why it cannot be built. `sources`: the binding and the headers
    it includes (a test builds an edited copy, a bench a git revision's); `arch`: a test also builds the kernels'
    portable vector code, which a CPU without AVX-512 runs."""
    root = root or cache_root()
    return build_cached(root, "k3_ort_ops", sources, "", lambda cxx, out, flags: [
        cxx, *flags, f"-I{headers(root)}", f"-I{sources[0].parent}", str(sources[0]), "-o", str(out)], arch)


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
    is one of its ops with that op's inputs, or an MXFP4 ``moe_experts`` of an export's file (its experts FLOAT4E2M1
    and E8M0 initializers: `moe_experts_mxfp4` on them once `mxfp4.packed_model` retypes them; ORT's 8-bit form,
    ``model.genai.onnx``, is not taken), and the graph computes in fp32 (no fp16 / bf16 / double initializer, input
    or output). A registered custom op replaces the schema of the function of its name for every node, so ORT
    would reject a node whose types the kernel lacks."""
    graph = model.graph
    types = {t.name: t.data_type for t in graph.initializer}
    for node in graph.node:
        if node.domain != "k3" or KERNEL_INPUTS.get(node.op_type) == len(node.input):
            continue
        mxfp4 = len(node.input) == KERNEL_INPUTS["moe_experts_mxfp4"] and node.op_type == "moe_experts"
        nvfp4 = len(node.input) == len(_NVFP4_TYPES) + 3 and node.op_type == "moe_experts"  # moe_experts_nvfp4
        quantized = tuple(types.get(name) for name in node.input[3:])
        if not ((mxfp4 and quantized == _MXFP4_TYPES) or (nvfp4 and quantized == _NVFP4_TYPES)):
            return False
    return computes_in_fp32(graph)


def enabled(providers: list[str] | None = None) -> bool:
    """Whether sessions on `providers` (default: the CPU provider) use the library unless told otherwise: those on
    the CPU provider alone (its kernels are CPU kernels; another provider runs the bodies itself), unless
    ``K3_ORT_OPS=0`` (or off / false: `k3export.switches`)."""
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


__all__ = ["KERNEL_INPUTS", "BuildError", "build", "build_cached", "cache_root", "computes_in_fp32", "cpu_flags",
           "digest_path", "enabled", "headers", "library", "register", "takes", "used", "verified"]
