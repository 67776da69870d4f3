"""Where the k3 ops' native sources live (torch-free): ``ops/csrc/kernels/`` holds one header per op's CPU kernel
(``kda.h``, ``moe_experts_mxfp4.h``, ...; ``common.h`` what they share), and ``ops/csrc/`` the thin bindings that
include them: ``ort_k3.cpp`` (ONNX Runtime), ``ov_k3.cpp`` (OpenVINO: its entry point, one file per operation under
``ov_k3/``), ``cpu_decode.cpp`` (torch)."""

from __future__ import annotations

from pathlib import Path

CSRC = Path(__file__).resolve().with_name("csrc")


def binding_sources(binding: Path) -> tuple[Path, ...]:
    """`binding`, the kernel headers beside it (``kernels/*.h``) and its own headers (the folder of its stem:
    ``ov_k3/*.hpp``), sorted: what a build of it reads, and so what its cache key hashes. A copy of the folder (a
    test's edited kernels, a bench's git revision) is read the same."""
    return (binding, *sorted((binding.parent / "kernels").glob("*.h")), *sorted(binding.with_suffix("").glob("*.hpp")))


__all__ = ["CSRC", "binding_sources"]
