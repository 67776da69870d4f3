"""Shared helpers for the k3 ops: the input error type and small shape checks."""

from __future__ import annotations

from typing import Sequence

import torch

from k3export.errors import K3ExportError


class OpInputError(K3ExportError, ValueError):
    """A k3 op was called with a tensor of the wrong rank, shape or dtype."""


def check_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise OpInputError(f"{name}: expected a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise OpInputError(f"{name}: expected a {rank}-d tensor of shape {layout}, got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    if tuple(t.shape) != tuple(int(e) for e in expected):
        raise OpInputError(
            f"{name}: expected shape {layout} = {tuple(int(e) for e in expected)}, got {tuple(t.shape)}"
        )


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype], what: str = "") -> None:
    if t.dtype not in tuple(allowed):
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise OpInputError(f"{name}: expected dtype {names}{what}, got {str(t.dtype).replace('torch.', '')}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {n: t.device for n, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise OpInputError(f"all inputs must be on one device, got {devices}")


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
