"""Helpers shared by the CLI commands: turning library errors into one clear line and an exit code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Report `K3ExportError` (and friends) as one red line plus a non-zero exit, never a traceback."""
    from k3export.errors import K3ExportError
    from k3export.modeling.configuration_k3 import K3ConfigError
    from k3export.modeling.modeling_k3 import K3CheckpointError

    try:
        yield
    except (K3ExportError, K3ConfigError, K3CheckpointError) as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
