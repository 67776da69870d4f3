"""Human-readable sizes (no heavy imports: the CLI uses it before loading torch)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """Binary units, e.g. ``1.5 GiB``; plain bytes below 1 KiB."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if abs(size) < 1024:
            return f"{size:.4g} {unit}"
    return f"{size / 1024:.4g} PiB"
