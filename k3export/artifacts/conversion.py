"""``conversion.json``: the provenance of a converted checkpoint (``k3export convert``), written last::

    {"format": "k3export.conversion_record", "format_version": 1,
     "tool": "k3export", "tool_version": str, "created": ISO-8601 UTC,
     "source": {"name": folder name, "repo_id": str | null, "revision": str | null, "layout": str,
                "files": [{"name", "bytes", "sha256"}]},          # every source file that was read
     "options": {str: scalar}, "outputs": [{"name", "bytes", "sha256"}],   # the shards written, in order
     "skipped": {group: tensor count}, "plan_fingerprint": str,
     "nvfp4_cast": {"blocks", "lossless_blocks", "fallback_blocks"} | null}   # convert --experts nvfp4

The source is named by its folder name only (never a local absolute path). Reading checks that every output
lies inside the folder and has its recorded size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from k3export.safety import check_relative, confined_file

from .codec import ArtifactError, Document, Scalar, check_sha256, fail, read_json_file


@dataclass
class FileDigest:
    name: str
    bytes: int
    sha256: str


@dataclass
class ConversionSource:
    name: str
    repo_id: str | None
    revision: str | None
    layout: str
    files: list[FileDigest]


@dataclass
class ConversionRecord(Document):
    FILE = "conversion.json"
    FORMAT = "k3export.conversion_record"

    tool: str
    tool_version: str
    created: str
    source: ConversionSource
    options: dict[str, Scalar]
    outputs: list[FileDigest]
    skipped: dict[str, int]
    plan_fingerprint: str
    #: ``convert --experts nvfp4``: NVFP4 blocks written, those cast bit-exactly and those from an amax scale
    nvfp4_cast: dict[str, int] | None = None

    def check(self, file: Any) -> None:
        for group, files in (("source.files", self.source.files), ("outputs", self.outputs)):
            for n, f in enumerate(files):
                check_relative(f.name, error=ArtifactError, file=file, field=f"{group}[{n}].name")
                if f.bytes < 0:
                    raise fail(file, f"{group}[{n}].bytes", f"{f.bytes} is negative")
                check_sha256(f.sha256, file, f"{group}[{n}].sha256")
        if "/" in self.source.name or self.source.name in ("", ".", ".."):
            raise fail(file, "source.name", f"{self.source.name!r} is not a folder name")

    @classmethod
    def read(cls, folder: str | os.PathLike[str], name: str | None = None) -> ConversionRecord:
        """Read and check; every output must be a regular file inside `folder` of its recorded size."""
        path, data = read_json_file(folder, name or cls.FILE)
        doc = cls.from_json(data, path)
        for n, f in enumerate(doc.outputs):
            real = confined_file(folder, f.name, error=ArtifactError, file=path, field=f"outputs[{n}].name")
            if real.stat().st_size != f.bytes:
                raise fail(path, f"outputs[{n}].bytes", f"{f.name} has {real.stat().st_size} bytes, the record "
                                                        f"says {f.bytes}")
        return doc


__all__ = ["ConversionRecord", "ConversionSource", "FileDigest"]
