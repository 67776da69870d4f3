# Copyright 2026 the k3export authors. Apache-2.0.
"""The layout of an export's external data, one rule for every file of it (torch-free: the ONNX Runtime path
imports it): tensors in order, each at a 4 KiB-aligned offset (mmap-friendly), a new shard ``{prefix}NNNNN``
when the next tensor would push the current one past ``max_shard_bytes``; a tensor larger than that gets a shard
of its own. The data shards are ``model.onnx.data.NNNNN`` (`weights`); the 8-bit experts of ONNX Runtime's form
use the same rule (`mxfp4.ort_model`)."""

from __future__ import annotations

ALIGN = 4096
DEFAULT_MAX_SHARD_BYTES = 4 << 30
DATA_PREFIX = "model.onnx.data."


def plan_shards(sizes: list[int], max_shard_bytes: int, prefix: str = DATA_PREFIX) -> list[tuple[str, int]]:
    """(shard file name, offset) of tensors of `sizes` bytes laid out in order by the module's rule."""
    out: list[tuple[str, int]] = []
    shard, pos = 0, 0
    for size in sizes:
        offset = -(-pos // ALIGN) * ALIGN
        if pos > 0 and offset + size > max_shard_bytes:
            shard, offset = shard + 1, 0
        out.append((f"{prefix}{shard:05d}", offset))
        pos = offset + size
    return out


__all__ = ["ALIGN", "DATA_PREFIX", "DEFAULT_MAX_SHARD_BYTES", "plan_shards"]
