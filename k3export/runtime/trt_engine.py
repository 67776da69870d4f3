"""A TensorRT engine beside its runner: where it is, which TensorRT built it, and its profiles' checks.

What `TrtSession` (``trt_runner``) needs to find and drive an engine, in one place (as Polygraphy keeps its loaders
beside its runners): `find_engine`, `engine_flavour` (from the engine's sidecar), and, from
``k3export.artifacts.engine_sidecar`` (below both this runner and ``k3export build``, which shares them), each
input axis's role from the manifest's contract dimensions (`dim_roles`), the profiles (`ProfileSpec`), the profile a
call runs in (`select_profile`) and the check of every feed against its ranges before TensorRT sees it
(`check_feed_shapes`). Plain Python (no TensorRT, no torch).
"""

from __future__ import annotations

import os
from pathlib import Path

from k3export.artifacts import ArtifactError, EngineSidecar
from k3export.artifacts.engine_sidecar import (ROLE_OF_DIM, ProfileError, ProfileSpec, check_feed_shapes, dim_roles,
                                               select_profile)
from k3export.errors import ExportError


def find_engine(path: str | os.PathLike[str]) -> Path:
    """`path` when it is a file; the one ``.engine`` / ``.plan`` file in it when it is a folder."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise ExportError(f"{p}: no such engine file (build one with `k3export build`)")
    found = sorted([*p.glob("*.engine"), *p.glob("*.plan")])
    if len(found) != 1:
        raise ExportError(f"{p}: expected one .engine/.plan file (found {[f.name for f in found]})")
    return found[0]


def engine_flavour(engine_path: str | os.PathLike[str]) -> str | None:
    """The TensorRT flavour ("tensorrt" / "tensorrt_rtx") an engine's sidecar records; None without a readable one."""
    try:
        return EngineSidecar.read_for(engine_path).tensorrt_flavour
    except ArtifactError:
        return None


__all__ = ["ProfileError", "ProfileSpec", "ROLE_OF_DIM", "check_feed_shapes", "dim_roles", "engine_flavour",
           "find_engine", "select_profile"]
