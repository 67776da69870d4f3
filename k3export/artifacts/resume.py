"""The records of a resumable export's progress, in its partial folder's ``.k3export-resume/`` (gone before the
folder is renamed into place; `k3export.converters.onnx.shards` writes and reads them)::

    ResumeRecord  export.json, pipeline.json  {"key": hash of what determines the output, "export_id": str | null}
    ShardRecord   <data shard>.json           {"key", "bytes", "sha256"}: a data shard the run of that key finished

A record that is missing, damaged or of another version counts as none: the work it stood for is done again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .codec import Document, check_sha256, fail


@dataclass
class ResumeRecord(Document):
    FILE = "export.json"
    FORMAT = "k3export.resume_record"

    key: str
    export_id: str | None = None  # a pipeline's: the id its finished stage folders carry


@dataclass
class ShardRecord(Document):
    FILE = "shard.json"  # written as <data shard>.json
    FORMAT = "k3export.shard_record"

    key: str
    bytes: int
    sha256: str  # of the bytes written, computed while writing them

    def check(self, file: Any) -> None:
        if self.bytes < 0:
            raise fail(file, "bytes", f"{self.bytes} is negative")
        check_sha256(self.sha256, file, "sha256")


__all__ = ["ResumeRecord", "ShardRecord"]
