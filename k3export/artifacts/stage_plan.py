"""A stage plan file (``k3export export --stage-plan FILE``, written by ``k3export deploy-plan --write-plan``): the
half-open layer range [start, stop) of each pipeline stage, in order::

    {"format": "k3export.stage_plan", "format_version": 1, "stages": [[0, 6], [6, 12], ...]}

A hand-written file may leave out ``format`` and ``format_version``; nothing else is accepted. Whether the ranges
cover a model's layers once each is checked against the model (`k3export.pipeline.plan.check_ranges`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .codec import Document, fail


@dataclass
class StagePlanFile(Document):
    FILE = "stage_plan.json"
    FORMAT = "k3export.stage_plan"

    stages: list[tuple[int, int]]

    @classmethod
    def of(cls, ranges: list[range]) -> StagePlanFile:
        return cls([(r.start, r.stop) for r in ranges])

    @property
    def ranges(self) -> list[range]:
        return [range(start, stop) for start, stop in self.stages]

    def check(self, file: Any) -> None:
        for n, (start, stop) in enumerate(self.stages):
            if start < 0 or stop < 0:
                raise fail(file, f"stages[{n}]", f"[{start}, {stop}] names a negative layer")

    @classmethod
    def from_json(cls, data: Any, file: Any = None) -> StagePlanFile:
        if isinstance(data, dict):  # a hand-written plan may leave the header out
            data = {"format": cls.FORMAT, "format_version": cls.VERSION, **data}
        return super().from_json(data, file)


__all__ = ["StagePlanFile"]
