"""Which TensorRT is here: datacenter TensorRT (``tensorrt``) or TensorRT for RTX (``tensorrt_rtx``), one API for both.

`load_flavour()` imports whichever imports (``K3EXPORT_TENSORRT=tensorrt|tensorrt_rtx`` picks one when both do) and
returns a `Flavour`: its module, name and version, the compute capabilities it builds for, and how the k3 plugins
reach it. What differs between the two is said here once:

* datacenter TensorRT builds on a GPU, for that GPU, and takes the k3 plugins through ``tensorrt.plugin`` (AOT: the
  engine embeds the Triton PTX and runs without Python);
* TensorRT-RTX builds with no GPU, for the compute capabilities its ``ComputeCapability`` enum names, and has no
  ``tensorrt.plugin`` (its ``tensorrt_rtx.plugin`` does not import), so the k3 plugins are class-based ``IPluginV3``
  plugins (`k3export.plugins.v3`) whose fields carry the PTX; running such an engine needs Python.

TensorRT-RTX's ONNX parser reaches the plugin registry by ``dlopen("libtensorrt_rtx.so")`` from its own folder, and
the wheel ships only ``libtensorrt_rtx.so.1``: the failed load ends the process (``std::terminate``) at the first
plugin node. Before importing ``tensorrt_rtx``, `load_flavour` therefore loads the parser from a private folder of
links that also holds ``libtensorrt_rtx.so`` (the same files, nothing copied or changed in the install), and
`Flavour.plugin_problem` says when that was not possible (``tensorrt_rtx`` imported before k3export could), so a
build refuses with one line instead of ending the process.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from k3export.errors import ExportError, K3ExportError

#: Python module -> what users call it
FLAVOURS = {"tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT-RTX"}
#: environment variable that picks a flavour when both import
CHOICE_ENV = "K3EXPORT_TENSORRT"
INSTALL_HINT = ("install TensorRT-RTX (`pip install tensorrt-rtx-cu12`, builds engines with no GPU) or datacenter "
                "TensorRT >= 10.9 on a machine with an NVIDIA GPU (`pip install tensorrt-cu12`)")
#: the core library the RTX parser opens by this name, and the parser itself (both in ``tensorrt_rtx_libs``)
RTX_CORE, RTX_PARSER = "libtensorrt_rtx.so", "libtensorrt_onnxparser_rtx.so.1"


class TensorRTUnavailable(ExportError):
    """No TensorRT (of either flavour) can be imported here, or not the part a task needs."""


Capability = tuple[int, int]


def format_cc(cc: Capability) -> str:
    """(8, 6) -> "8.6"."""
    return f"{cc[0]}.{cc[1]}"


def parse_cc(text: str | Capability) -> Capability:
    """"8.6", "86", "sm_86" or (8, 6) -> (8, 6); ExportError otherwise."""
    if isinstance(text, tuple):
        return (int(text[0]), int(text[1]))
    s = str(text).strip().lower().removeprefix("sm_").removeprefix("sm")
    try:
        if "." in s:
            major, minor = s.split(".")
            return (int(major), int(minor))
        if s.isdigit() and len(s) >= 2:
            return (int(s[:-1]), int(s[-1]))
    except ValueError:
        pass
    raise ExportError(f"compute capability {text!r}: expected MAJOR.MINOR, e.g. 8.6 or 12.0")


@dataclass(frozen=True)
class Flavour:
    """One imported TensorRT."""

    name: str  # "tensorrt" | "tensorrt_rtx": the Python module
    version: str
    trt: ModuleType = field(repr=False, compare=False)
    #: why the ONNX parser cannot take plugin nodes in this process (None: it can)
    plugin_problem: str | None = None

    @property
    def label(self) -> str:
        return f"{FLAVOURS[self.name]} {self.version}"

    @property
    def rtx(self) -> bool:
        return self.name == "tensorrt_rtx"

    @property
    def builds_without_gpu(self) -> bool:
        """TensorRT-RTX compiles for a named compute capability; datacenter TensorRT times kernels on its GPU."""
        return self.rtx

    @property
    def targets(self) -> tuple[Capability, ...] | None:
        """The compute capabilities this TensorRT builds engines for (TensorRT-RTX: its ``ComputeCapability`` enum);
        None for datacenter TensorRT, which builds for the GPU it runs on."""
        enum = getattr(self.trt, "ComputeCapability", None)
        if not self.rtx or enum is None:
            return None
        out = []
        for name in enum.__members__:
            if name.startswith("SM") and name[2:].isdigit():
                out.append((int(name[2:-1]), int(name[-1])))
        return tuple(sorted(out))

    def target_enum(self, cc: Capability) -> Any:
        """TensorRT-RTX's ``ComputeCapability`` member of `cc`."""
        return getattr(self.trt.ComputeCapability, f"SM{cc[0]}{cc[1]}")

    @property
    def plugin_api(self) -> str:
        """How the k3 plugins reach this TensorRT: "quick" (``tensorrt.plugin`` decorators, AOT: the engine runs
        without Python) or "v3" (class-based ``IPluginV3``, `k3export.plugins.v3`)."""
        if self.rtx:
            return "v3"
        try:
            trtp = importlib.import_module(f"{self.name}.plugin")
        except Exception:
            return "v3"
        return "quick" if hasattr(trtp, "aot_impl") else "v3"

    def data_type(self, name: str) -> Any:
        """The ``DataType`` member of a canonical dtype name (``k3export.dtypes``), in this TensorRT."""
        from k3export.dtypes import dtype

        d = dtype(name)
        if d.trt_name is None:
            raise ExportError(f"dtype {d.name} has no {FLAVOURS[self.name]} type")
        return getattr(self.trt.DataType, d.trt_name)


_loaded: dict[str, Flavour] = {}
_link_dirs: list[str] = []
_handles: list[Any] = []


def _rtx_libs_dir() -> Path | None:
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _preload_rtx_parser() -> None:
    """Load TensorRT-RTX's parser from a folder where ``libtensorrt_rtx.so`` resolves (module docstring). Only
    before ``tensorrt_rtx`` is imported, and only when its install lacks that name."""
    if "tensorrt_rtx" in sys.modules or _handles:
        return
    libs = _rtx_libs_dir()
    if libs is None or (libs / RTX_CORE).exists() or not (libs / RTX_PARSER).is_file() \
            or not (libs / f"{RTX_CORE}.1").is_file():
        return
    folder = tempfile.mkdtemp(prefix="k3export-trt-rtx-")
    _link_dirs.append(folder)
    atexit.register(shutil.rmtree, folder, True)
    os.symlink(libs / RTX_PARSER, Path(folder) / RTX_PARSER)
    os.symlink(libs / f"{RTX_CORE}.1", Path(folder) / RTX_CORE)
    _handles.append(ctypes.CDLL(str(Path(folder) / RTX_PARSER)))


def _loaded_path(soname: str) -> Path | None:
    """The path the dynamic loader has `soname` loaded under (its ``link_map.l_name``), None when not known."""
    try:
        handle = ctypes.CDLL(soname, mode=getattr(os, "RTLD_NOLOAD", 4) | os.RTLD_LAZY)._handle
        libc = ctypes.CDLL(None)
        lm = ctypes.c_void_p()
        if libc.dlinfo(ctypes.c_void_p(handle), 2, ctypes.byref(lm)) != 0 or not lm.value:  # 2: RTLD_DI_LINKMAP
            return None
        name = ctypes.cast(lm.value + ctypes.sizeof(ctypes.c_void_p), ctypes.POINTER(ctypes.c_char_p))[0]
    except (OSError, AttributeError):  # not loaded, or no dlinfo in this C library
        return None
    return Path(name.decode()) if name else None


def _rtx_plugin_problem() -> str | None:
    """Why TensorRT-RTX's parser would end the process at a plugin node here, or None: it was loaded from the links
    (`_preload_rtx_parser`), or the core library resolves by that name beside it or on ``LD_LIBRARY_PATH``."""
    if _handles:
        return None
    libs = _rtx_libs_dir()
    parser = _loaded_path(RTX_PARSER) or (libs / RTX_PARSER if libs else Path(RTX_PARSER))
    folders = [parser.parent] + [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if any((f / RTX_CORE).exists() for f in folders):
        return None
    return (f"TensorRT-RTX's ONNX parser ({parser}) opens {RTX_CORE} from its folder to find plugins, and that folder "
            f"has only {RTX_CORE}.1; `tensorrt_rtx` was imported before k3export could load the parser from a folder "
            f"that has both. Import k3export.plugins.flavour before tensorrt_rtx, or add the link "
            f"`ln -s {RTX_CORE}.1 {parser.parent / RTX_CORE}`")


def _import(name: str) -> Flavour:
    if name in _loaded:
        return _loaded[name]
    if name == "tensorrt_rtx":
        _preload_rtx_parser()
    trt = importlib.import_module(name)
    if not hasattr(trt, "Builder"):  # the PyPI placeholder packages import but hold no TensorRT
        raise ImportError(f"`{name}` imports but has no Builder (a placeholder package?)")
    flavour = Flavour(name, str(trt.__version__), trt, _rtx_plugin_problem() if name == "tensorrt_rtx" else None)
    _loaded[name] = flavour
    return flavour


def load_flavour(name: str | None = None) -> Flavour:
    """The TensorRT to build and run with: `name` ("tensorrt" / "tensorrt_rtx"), else ``$K3EXPORT_TENSORRT``, else
    datacenter TensorRT when it imports, else TensorRT-RTX. TensorRTUnavailable (one line) when none imports."""
    from k3export import switches

    try:
        choice = name or switches.choice(CHOICE_ENV)
    except K3ExportError as exc:
        raise TensorRTUnavailable(str(exc)) from None
    if choice is not None and choice not in FLAVOURS:
        raise TensorRTUnavailable(f"{CHOICE_ENV}={choice!r}: expected one of {', '.join(FLAVOURS)}")
    errors = []
    for module in ([choice] if choice else list(FLAVOURS)):
        try:
            return _import(module)
        except Exception as exc:  # noqa: BLE001  any import failure: try the other flavour, then say why
            errors.append(f"{module}: {type(exc).__name__}: {exc}")
    raise TensorRTUnavailable(f"TensorRT is not installed ({'; '.join(errors)}); {INSTALL_HINT}")


def flavour_status() -> str | None:
    """None when some TensorRT imports here; otherwise why not (one line)."""
    try:
        load_flavour()
    except TensorRTUnavailable as exc:
        return str(exc)
    return None


__all__ = ["CHOICE_ENV", "FLAVOURS", "Flavour", "TensorRTUnavailable", "format_cc", "load_flavour", "flavour_status",
           "parse_cc"]
