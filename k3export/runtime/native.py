"""Building k3export's native libraries: ONNX Runtime's custom-op library (`ort_ops`) and OpenVINO's extension
(`ov_ext`), each from its binding in ``k3export/ops/csrc/`` over the kernel headers in ``ops/csrc/kernels/`` (one per
op), with the C++ compiler (``$CXX``, else ``g++``), cached by a hash of sources, flags and CPU (`build_cached`).

``python -m k3export.runtime.build_native`` builds both ahead of the first session (CI runs it before the tests).

ONNX Runtime's C/C++ API headers are not in its PyPI wheel, nor in any PyPI package (onnxruntime, onnxruntime-gpu,
-genai, -genai-core, -extensions, -training-cpu, -qnn, -ep-openvino, onnx-extended: none ships them). They come from
Debian's ``libonnxruntime-dev`` 1.21.0 (`ORT_HEADERS`: MIT, Microsoft; the C API is append-only, so a library built
against 1.21's headers loads into any later ORT), one pinned 85 kB file fetched over HTTP with Python's urllib,
checked against its sha256 and unpacked in Python (a .deb is an ``ar`` archive holding ``data.tar.xz``): no apt-get,
no dpkg, so the build runs on any Linux or macOS with a C++17 compiler and a network. The system's headers
(``/usr/include/onnxruntime``) are used where installed; ``apt-get download`` of the package is the fallback when the
pinned file cannot be fetched (Debian replaced it). They are kept under `cache_root` in ``ort-ops/headers/``, with
the package's copyright file.
Nothing here imports torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import logging
import lzma
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3export import switches
from k3export.files import file_sha256
from k3export.safety import write_bytes_atomic

#: ONNX Runtime 1.21's headers: Debian's libonnxruntime-dev (MIT), the file in its archive and its sha256
ORT_HEADERS_PACKAGE, ORT_HEADERS_SUITE = "libonnxruntime-dev", "trixie"
ORT_HEADERS_DEB = "pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
ORT_HEADERS_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
ORT_HEADERS_MIRROR = "http://deb.debian.org/debian/"
#: the header whose presence marks a usable folder, and the folder inside the package
ORT_HEADER = "onnxruntime_lite_custom_op.h"
_INCLUDE = "usr/include/onnxruntime"
#: the compiler flags of the native libraries, less the target (`build_cached`'s ``arch``)
FLAGS = ("-O3", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
#: the target they are built for: the CPU they run on (the cache key holds its model and flags, for a home shared
#: across machines)
ARCH = "native"
_DIGEST_MAX_BYTES = 128  # a recorded digest: 64 hex digits and a newline
_OTHER_FLOATS = frozenset({10, 11, 16})  # TensorProto FLOAT16, DOUBLE, BFLOAT16
_log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """Why the library cannot be built here (one line)."""


def cache_root(folder: str) -> Path:
    """Where a native library (and what its build fetches) is kept: `folder` under ``$K3EXPORT_CACHE``, default
    ``$XDG_CACHE_HOME/k3export`` (``~/.cache/k3export``)."""
    chosen = switches.choice("K3EXPORT_CACHE")
    if chosen:
        return Path(chosen) / folder
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "k3export" / folder


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


def build_cached(root: Path, stem: str, sources: tuple[Path, ...], key: str,
                 command: Callable[[str, Path, tuple[str, ...]], list[str]], arch: str = ARCH) -> Path:
    """``root/lib{stem}-{hash}.so`` of `sources` (the binding first, then the headers it includes), built by
    ``command(compiler, output, flags)`` (`FLAGS` and ``-march={arch}``) unless a build of the same sources, flags,
    `key` and CPU is there; BuildError saying why it cannot be built. Concurrent builders wait on one lock (`command`
    runs under it: it may fetch what it needs into `root`); the file appears by rename. Shared by ONNX Runtime's
    library (`ort_ops`) and OpenVINO's (`ov_ext`).

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


def computes_in_fp32(graph: Any) -> bool:
    """Whether an ONNX graph holds no fp16, bf16 or double initializer, input or output: what the native
    libraries' fp32 kernels take."""
    if any(t.data_type in _OTHER_FLOATS for t in graph.initializer):
        return False
    return not any(v.type.tensor_type.elem_type in _OTHER_FLOATS for v in (*graph.input, *graph.output))


def ort_headers(root: Path) -> Path:
    """The folder holding ONNX Runtime's C/C++ API headers: the system's, else those unpacked in `root` before, else
    Debian's package fetched now (`ORT_HEADERS_DEB`, checked by its sha256; ``apt-get download`` where that fails);
    BuildError saying why there are none."""
    for folder in (Path("/usr/include/onnxruntime"), root / "headers" / _INCLUDE):
        if (folder / ORT_HEADER).is_file():
            return folder
    root.mkdir(parents=True, exist_ok=True)
    try:
        deb = _fetch_pinned()
    except BuildError as pinned:
        try:
            deb = _apt_download(root)
        except BuildError as apt:
            raise BuildError(f"no ONNX Runtime headers: {pinned}; {apt}") from None
    with tempfile.TemporaryDirectory(dir=root, prefix="headers-") as tmp:
        _unpack_deb(deb, Path(tmp) / "x")
        shutil.rmtree(root / "headers", ignore_errors=True)
        os.replace(Path(tmp) / "x", root / "headers")
    return root / "headers" / _INCLUDE


def _fetch_pinned() -> bytes:
    url = ORT_HEADERS_MIRROR + ORT_HEADERS_DEB
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            data = r.read()
    except OSError as exc:
        raise BuildError(f"{url}: {getattr(exc, 'reason', None) or exc}") from None
    got = hashlib.sha256(data).hexdigest()
    if got != ORT_HEADERS_SHA256:
        raise BuildError(f"{url}: sha256 {got}, {ORT_HEADERS_SHA256} expected")
    return data


def _apt_download(root: Path) -> bytes:
    """The package of the suite's current version, through apt-get (which checks the archive's signatures)."""
    if shutil.which("apt-get") is None:
        raise BuildError(f"no apt-get to fetch {ORT_HEADERS_PACKAGE}")
    with tempfile.TemporaryDirectory(dir=root, prefix="apt-") as tmp:
        d = Path(tmp)
        (d / "lists" / "partial").mkdir(parents=True)
        (d / "sources.list").write_text(f"deb {ORT_HEADERS_MIRROR} {ORT_HEADERS_SUITE} main\n")
        apt = ["apt-get", "-q", "-o", f"Dir::Etc::sourcelist={d / 'sources.list'}", "-o",
               "Dir::Etc::sourceparts=/dev/null", "-o", f"Dir::State::Lists={d / 'lists'}"]
        _run(apt + ["update"], f"apt-get update (Debian {ORT_HEADERS_SUITE})")
        _run(apt + ["download", ORT_HEADERS_PACKAGE], f"apt-get download {ORT_HEADERS_PACKAGE}", cwd=d)
        debs = sorted(d.glob(f"{ORT_HEADERS_PACKAGE}_*.deb"))
        if not debs:
            raise BuildError(f"apt-get download {ORT_HEADERS_PACKAGE} left no .deb")
        return debs[-1].read_bytes()


def _unpack_deb(deb: bytes, out: Path) -> None:
    """The headers and copyright file of .deb `deb` (an ``ar`` archive: 8-byte magic, then 60-byte member headers)
    into `out`, as ``usr/...``."""
    if not deb.startswith(b"!<arch>\n"):
        raise BuildError(f"{ORT_HEADERS_PACKAGE}: not a .deb")
    at = 8
    while at + 60 <= len(deb):
        name, size = deb[at:at + 16].decode().strip().rstrip("/"), int(deb[at + 48:at + 58])
        body = deb[at + 60:at + 60 + size]
        at += 60 + size + size % 2
        if name.startswith("data.tar"):
            raw = lzma.decompress(body) if name.endswith(".xz") else body
            with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
                keep = [m for m in tar.getmembers() if m.isfile() and m.name.lstrip("./").startswith(
                    (_INCLUDE + "/", f"usr/share/doc/{ORT_HEADERS_PACKAGE}/copyright"))]
                tar.extractall(out, members=keep, filter="data")
            if (out / _INCLUDE / ORT_HEADER).is_file():
                return
            raise BuildError(f"{ORT_HEADERS_PACKAGE} has no {_INCLUDE}/{ORT_HEADER}")
    raise BuildError(f"{ORT_HEADERS_PACKAGE}: no data.tar member")


__all__ = ["ARCH", "FLAGS", "BuildError", "build_cached", "cache_root", "computes_in_fp32", "cpu_flags",
           "digest_path", "ort_headers", "verified"]

