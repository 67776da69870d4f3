"""The raw MXFP4 bytes of a checkpoint folder (shared by the export and pipeline tests that compare them)."""

from __future__ import annotations

from pathlib import Path

from k3export.converters.onnx.weights import CheckpointSource


def mxfp4_bytes(src: Path) -> dict[str, bytes]:
    """Every MXFP4 tensor of the checkpoint by its stored name (..._packed / ..._scale), raw."""
    source = CheckpointSource(src)
    try:
        out = {}
        for t in source.scan.tensors.values():
            if t.scale_stored is not None:
                out[t.stored] = bytes(source.scan.readers[t.file].read(t.stored).numpy())
                out[t.scale_stored] = bytes(source.scan.readers[t.scale_file].read(t.scale_stored).numpy())
        return out
    finally:
        source.close()
