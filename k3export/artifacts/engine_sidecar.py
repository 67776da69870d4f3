"""``<engine>.json`` (``model.engine.json``): how a TensorRT engine was built, written beside it::

    {"format": "k3export.engine_sidecar", "format_version": 1,
     "onnx": graph file, "precision": str, "dtype": canonical dtype name,
     "tensorrt_flavour": "tensorrt" | "tensorrt_rtx", "tensorrt_version": str,
     "gpu": name, "compute_capability": [major, minor], "target_compute_capability": [major, minor] | null,
     "prefer_aot": bool,
     "profiles": [{"name", "limits": {flag: int}, "shapes": {input: [min, opt, max]}}],
     "k3_nodes": [{"index", "name", "op"}],
     "plugins": [plugin id] | null, "network_layers": int | null}

``compute_capability`` is the building GPU's; ``target_compute_capability`` the one the engine is built for when it
is another (TensorRT-RTX can build for a chosen one), null when it is the same. Every field but the build's
outcomes (`OUTCOMES`: the k3 plugins the engine embeds and the layers of the parsed network; null when not
recorded) says what the build was asked to do: two records equal in those (`same_build`) mean an engine built the
same way, which ``k3export build`` keeps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .codec import Document, fail

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
    OUTCOMES = ("plugins", "network_layers")

    onnx: str
    precision: str
    dtype: str
    tensorrt_flavour: Literal["tensorrt", "tensorrt_rtx"]  # TensorRT or TensorRT for RTX, by Python module
    tensorrt_version: str
    gpu: str
    compute_capability: tuple[int, int]
    prefer_aot: bool
    profiles: list[EngineProfile]
    k3_nodes: list[EngineNode]
    target_compute_capability: tuple[int, int] | None = None
    plugins: list[str] | None = None
    network_layers: int | None = None

    def check(self, file: Any) -> None:
        for field in ("compute_capability", "target_compute_capability"):
            cc = getattr(self, field)
            if cc is not None and min(cc) < 0:
                raise fail(file, field, f"{list(cc)} is not a compute capability")
        if self.network_layers is not None and self.network_layers < 0:
            raise fail(file, "network_layers", f"{self.network_layers} is negative")

    def same_build(self, other: EngineSidecar) -> bool:
        """Whether `other` records a build asked to do the same (every field but `OUTCOMES` equal)."""
        mine, theirs = self.to_json(), other.to_json()
        return all(mine[k] == theirs[k] for k in mine if k not in self.OUTCOMES)

    def write_for(self, engine: str | os.PathLike[str]) -> Path:
        """Write the record of `engine` beside it (atomically)."""
        engine = Path(engine)
        return self.write(engine.parent, engine.name + self.SUFFIX)

    @classmethod
    def read_for(cls, engine: str | os.PathLike[str]) -> EngineSidecar:
        """The record beside `engine`; `ArtifactError` when there is none or it is not one this k3export reads."""
        engine = Path(engine)
        return cls.read(engine.parent, engine.name + cls.SUFFIX)


__all__ = ["EngineNode", "EngineProfile", "EngineSidecar"]
