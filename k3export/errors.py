"""Errors k3export raises for bad input. The CLI prints them as one line and exits non-zero."""

from __future__ import annotations


class K3ExportError(Exception):
    """Base class: a user-facing problem with a clear message (which file, which tensor, what was expected)."""


class ConfigError(K3ExportError, ValueError):
    """An inconsistent or unsupported model configuration."""


class CheckpointError(K3ExportError, ValueError):
    """A checkpoint that is missing, truncated, corrupted or does not match the configuration."""


class ExportError(K3ExportError, RuntimeError):
    """An export (ONNX, TensorRT) that cannot be produced as asked."""


class ValidationFailed(K3ExportError):
    """A cross-runtime comparison exceeded its tolerances."""
