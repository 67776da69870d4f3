"""The environment variables k3export reads, declared once as data: name, default, accepted values, meaning.

Every reader goes through `flag` (an on / off switch) or `choice` (one of a few words), which refuse any other
value in one `K3ExportError` line naming the variable; `check_all` checks them all at once (the CLI does it before
a command runs, so a mistyped switch is exit code 2 before any work). An on / off switch takes ``1`` / ``0``,
``on`` / ``off``, ``true`` / ``false`` or ``yes`` / ``no`` (any case); unset or empty is its default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from k3export.errors import K3ExportError

ON, OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


@dataclass(frozen=True)
class Switch:
    """One environment variable: `choices` None is an on / off switch (`ON`, `OFF`); a `default` of None means
    unset has a meaning of its own (`meaning` says which); `path` takes any non-empty value (a file or folder)."""

    name: str
    default: str | None
    meaning: str
    choices: tuple[str, ...] | None = None
    path: bool = False

    def accepted(self) -> str:
        if self.path:
            return "a path"
        return ", ".join(self.choices) if self.choices is not None else "/".join(
            f"{a}/{b}" for a, b in zip(ON, OFF))


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("K3EXPORT_ORT_OPS", "on", "ONNX Runtime sessions on the CPU provider run the k3 nodes with k3export's "
           "native custom-op library (k3export.runtime.ort_ops)"),
    Switch("K3EXPORT_OV_EXT", "on", "OpenVinoRunner runs a functions-form export through k3export's OpenVINO extension "
           "library (k3export.runtime.ov_ext)"),
    Switch("K3EXPORT_HUGE_PAGES", "on", "sessions collapse their resident weights into huge pages "
           "(k3export.runtime.pages)"),
    Switch("K3EXPORT_OPS_BACKEND", "auto", "the k3 ops' initial backend (k3export.ops.backend)",
           ("auto", "torch", "triton")),
    Switch("K3EXPORT_DEBUG", "off", "a failure shows its traceback instead of one error line"),
    Switch("K3EXPORT_TENSORRT", None, "the TensorRT to use when both import (unset: datacenter TensorRT first)",
           ("tensorrt", "tensorrt_rtx")),
    Switch("K3EXPORT_MP_START", "fork", "the start method of convert's worker processes", ("fork", "spawn",
                                                                                         "forkserver")),
    Switch("K3EXPORT_CACHE", None, "where native libraries are built and kept (unset: $XDG_CACHE_HOME/k3export)",
           path=True),
    Switch("K3EXPORT_WEBGPU_PYTHON", None, "the Python of a second environment holding onnxruntime-webgpu, which runs "
           "the ort-webgpu runtime's worker (k3export.runtime.webgpu_runner; .ci/webgpu-env makes one)", path=True),
)}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def _refuse(switch: Switch, value: str) -> K3ExportError:
    return K3ExportError(f"environment variable {switch.name}={value!r}: expected {switch.accepted()} "
                         f"({switch.meaning})")


def flag(name: str) -> bool:
    """The on / off switch `name` (`SWITCHES`); one `K3ExportError` line for a value it does not take."""
    switch = SWITCHES[name]
    assert switch.choices is None and not switch.path, name
    value = _raw(name)
    word = (value if value is not None else switch.default or "off").lower()
    if word in ON:
        return True
    if word in OFF:
        return False
    raise _refuse(switch, value or "")


def choice(name: str) -> str | None:
    """The value of `name` (`SWITCHES`): one of its choices, its default when unset, a path as given."""
    switch = SWITCHES[name]
    value = _raw(name)
    if value is None or switch.path:
        return value if value is not None else switch.default
    if switch.choices is not None and value.lower() in switch.choices:
        return value.lower()
    raise _refuse(switch, value)


#: the one prefix of k3export's variables
PREFIX = "K3EXPORT_"


def check_all() -> None:
    """Read every declared variable: the first value one does not take raises its one-line `K3ExportError`; so does
    a variable set under the short prefix ``K3_`` whose ``K3EXPORT_`` name is declared (it would be ignored)."""
    for name in os.environ:
        if name.startswith("K3_") and PREFIX + name[3:] in SWITCHES and _raw(name) is not None:
            raise K3ExportError(f"environment variable {name}: k3export reads {PREFIX + name[3:]}, not {name}")
    for switch in SWITCHES.values():
        (choice if switch.choices is not None or switch.path else flag)(switch.name)


__all__ = ["OFF", "ON", "PREFIX", "SWITCHES", "Switch", "check_all", "choice", "flag"]
