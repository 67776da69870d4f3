"""``<engine>.json`` (``model.engine.json``): how a TensorRT engine was built, written beside it::

    {"format": "k3export.engine_sidecar", "format_version": 1,
     "onnx": graph file, "precision": str, "dtype": canonical dtype name,
     "tensorrt_flavour": "tensorrt" | "tensorrt_rtx", "tensorrt_version": str,
     "gpu": name | "none", "compute_capability": [major, minor] | null, "target_compute_capability": [major, minor],
     "prefer_aot": bool,
     "profiles": [{"name", "limits": {flag: int}, "shapes": {input: [min, opt, max]}}],
     "k3_nodes": [{"index", "name", "op"}],
     "standard_ops": [op] | null, "optimization_level": int | null,
     "plugins": [plugin id] | null, "plugin_api": "tensorrt.plugin" | "IPluginV3" | null,
     "plugin_layers": int | null, "network_layers": int | null}

``compute_capability`` is the building GPU's (null when the build saw none: TensorRT-RTX builds without one);
``target_compute_capability`` the one the engine is built for (null in records that predate it). ``standard_ops``
are the k3 ops built from their standard-op form instead of their plugin. Every field but the build's outcomes
(`OUTCOMES`: the k3 plugins the engine embeds and how, the plugin layers and all layers of the parsed network; null
when not recorded) says what the build was asked to do: two records equal in those (`same_build`) mean an engine
built the same way, which ``k3export build`` keeps.

The profiles themselves are defined here too, below both the build (``k3export.converters.tensorrt``) and the
runner (``k3export.runtime.trt_engine``), which use them: each input axis's role from the manifest's contract
dimensions (`dim_roles`), a profile's ranges (`ProfileSpec`), the profile a call runs in (`select_profile`) and the
check of every feed against it before TensorRT sees it (`check_feed_shapes`: the error names tensor, axis and the
build flag to raise).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from k3export.errors import ExportError
from k3export.modeling.contract import BATCH, PAST, SEQ, TOTAL

from .codec import Document, fail
from .manifest import StateManifest

#: optimisation-profile role of each contract dimension (a static int dim is "static")
ROLE_OF_DIM = {BATCH: "batch", SEQ: "seq", PAST: "past", TOTAL: "total"}


class ProfileError(ExportError, ValueError):
    """A feed whose shape lies outside the engine's optimisation profile (or a bad profile request)."""


def dim_roles(manifest: StateManifest) -> dict[str, list[str]]:
    """Per graph input and axis: 'static', 'batch', 'seq' (new tokens), 'past' (carried tokens) or 'total'
    (past + new), read from the manifest's contract dimensions (never guessed from names)."""
    inputs, _ = manifest.graph_io()
    return {name: [ROLE_OF_DIM[d] if isinstance(d, str) else "static" for d in shape]
            for name, (_, shape) in inputs.items()}


@dataclass(frozen=True)
class ProfileSpec:
    """One optimisation profile: name -> (min, opt, max) shapes."""

    name: str  # "prefill" | "decode"
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    limits: dict[str, int] = field(default_factory=dict)  # max_batch / max_seq / max_context behind it


def select_profile(profiles: Sequence[ProfileSpec], seq_len: int) -> int:
    """Index of the profile a call with `seq_len` new tokens runs in (decode for one token)."""
    names = [p.name for p in profiles]
    if seq_len == 1 and "decode" in names:
        return names.index("decode")
    return names.index("prefill") if "prefill" in names else 0


_FLAG_OF_ROLE = {"batch": "--max-batch", "seq": "--max-seq", "past": "--max-context", "total": "--max-context"}


def check_feed_shapes(feeds: Mapping[str, Sequence[int]], profile: ProfileSpec,
                      roles: Mapping[str, Sequence[str]] | None = None) -> None:
    """ProfileError naming the tensor, axis, value and allowed range for any feed outside `profile`
    (and for missing / unexpected inputs), before TensorRT sees it."""
    missing = [n for n in profile.shapes if n not in feeds]
    if missing:
        raise ProfileError(f"missing engine inputs {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    extra = [n for n in feeds if n not in profile.shapes]
    if extra:
        raise ProfileError(f"unknown inputs {extra[:6]}; the engine takes {list(profile.shapes)[:6]} ...")
    for name, (lo, _, hi) in profile.shapes.items():
        shape = tuple(int(s) for s in feeds[name])
        if len(shape) != len(lo):
            raise ProfileError(f"input {name!r}: rank {len(shape)} {list(shape)}, the engine expects rank {len(lo)}")
        for axis, (s, a, b) in enumerate(zip(shape, lo, hi)):
            if a <= s <= b:
                continue
            role = roles[name][axis] if roles and name in roles else None
            if a == b:
                raise ProfileError(f"input {name!r} axis {axis} is {s}; the engine was built for exactly {a} "
                                   f"(shape {list(shape)})")
            hint = f"; rebuild with a larger {_FLAG_OF_ROLE[role]}" if role in _FLAG_OF_ROLE and s > b else ""
            raise ProfileError(
                f"input {name!r} axis {axis} is {s}, outside the {profile.name} profile range [{a}, {b}] "
                f"(shape {list(shape)}){hint}"
            )


@dataclass
class EngineProfile:
    name: str
    limits: dict[str, int]  # max_batch, max_seq, max_context
    shapes: dict[str, tuple[list[int], list[int], list[int]]]  # input -> (min, opt, max) shape


@dataclass
class EngineNode:
    """A k3 node of the graph the engine was built from (a plugin layer in the engine)."""

    index: int
    name: str
    op: str


@dataclass
class EngineSidecar(Document):
    FILE = "model.engine.json"
    FORMAT = "k3export.engine_sidecar"
    #: the record of engine ``E`` is ``E + SUFFIX``
    SUFFIX = ".json"
    #: fields that record what the build produced rather than what it was asked to do
    OUTCOMES = ("plugins", "plugin_api", "plugin_layers", "network_layers")

    onnx: str
    precision: str
    dtype: str
    tensorrt_flavour: Literal["tensorrt", "tensorrt_rtx"]  # TensorRT or TensorRT for RTX, by Python module
    tensorrt_version: str
    gpu: str  # the building GPU's name, "none" when the build saw none
    compute_capability: tuple[int, int] | None
    prefer_aot: bool
    profiles: list[EngineProfile]
    k3_nodes: list[EngineNode]
    target_compute_capability: tuple[int, int] | None = None
    standard_ops: list[str] | None = None
    optimization_level: int | None = None
    plugins: list[str] | None = None
    plugin_api: Literal["tensorrt.plugin", "IPluginV3"] | None = None
    plugin_layers: int | None = None
    network_layers: int | None = None

    def check(self, file: Any) -> None:
        for field in ("compute_capability", "target_compute_capability"):
            cc = getattr(self, field)
            if cc is not None and min(cc) < 0:
                raise fail(file, field, f"{list(cc)} is not a compute capability")
        for field in ("plugin_layers", "network_layers", "optimization_level"):
            if getattr(self, field) is not None and getattr(self, field) < 0:
                raise fail(file, field, f"{getattr(self, field)} is negative")

    def same_build(self, other: EngineSidecar) -> bool:
        """Whether `other` records a build asked to do the same (every field but `OUTCOMES` equal)."""
        mine, theirs = self.to_json(), other.to_json()
        return all(mine[k] == theirs[k] for k in mine if k not in self.OUTCOMES)

    @property
    def needs_python(self) -> bool:
        """Whether running the engine calls back into Python (class-based ``IPluginV3`` k3 plugins)."""
        return self.plugin_api == "IPluginV3" and bool(self.plugins)

    def write_for(self, engine: str | os.PathLike[str]) -> Path:
        """Write the record of `engine` beside it (atomically)."""
        engine = Path(engine)
        return self.write(engine.parent, engine.name + self.SUFFIX)

    @classmethod
    def read_for(cls, engine: str | os.PathLike[str]) -> EngineSidecar:
        """The record beside `engine`; `ArtifactError` when there is none or it is not one this k3export reads."""
        engine = Path(engine)
        return cls.read(engine.parent, engine.name + cls.SUFFIX)


__all__ = ["EngineNode", "EngineProfile", "EngineSidecar", "ProfileError", "ProfileSpec", "ROLE_OF_DIM",
           "check_feed_shapes", "dim_roles", "select_profile"]
