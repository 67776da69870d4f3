"""Pipeline fixtures: the tiny model, its single-graph export, pipeline exports cut inside Attention-Residual blocks
(the local Ray cluster every Ray test shares is `ray_cluster` in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3export.modeling import tiny_model

#: tiny: 6 layers, Attention-Residual blocks [0, 2), [2, 4), [4, 6); every cut here but 2 and 4 lies inside one
TINY_CUTS = {2: [range(0, 3), range(3, 6)], 3: [range(0, 1), range(1, 5), range(5, 6)]}


@pytest.fixture(scope="session")
def tiny():
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def tiny_exports(tiny, tmp_path_factory) -> dict[int, Path]:
    """{1: the single-graph export, 2 and 3: pipeline exports along `TINY_CUTS`}."""
    from k3export.converters.onnx import export_onnx
    from k3export.pipeline import export_pipeline

    root = tmp_path_factory.mktemp("tiny")
    export_onnx(tiny, root / "single")
    out = {1: root / "single"}
    for n, ranges in TINY_CUTS.items():
        export_pipeline(tiny, root / f"stages{n}", stage_plan=ranges)
        out[n] = root / f"stages{n}"
    return out
