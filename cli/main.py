"""Entry point of the `k3export` command.

Each command group lives in its own module of this package and exposes ``register(app)``;
``main`` discovers them so that adding a command never means editing this file.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import typer

app = typer.Typer(
    name="k3export",
    help="Turn Kimi K3 checkpoints into validated ONNX and TensorRT artifacts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

_COMMAND_MODULES_SKIP = {"main", "common"}
# Help lists commands in pipeline order: checkpoint -> convert -> export -> engine -> validate -> Hub.
_PIPELINE_ORDER = ["model", "validate", "convert", "export", "build", "hub"]


def _register_commands() -> None:
    package = sys.modules[__package__] if __package__ else None
    if package is None:  # pragma: no cover - run as a plain script
        return
    names = [m.name for m in pkgutil.iter_modules(package.__path__)
             if m.name not in _COMMAND_MODULES_SKIP and not m.name.startswith("_")]
    rank = {name: i for i, name in enumerate(_PIPELINE_ORDER)}
    for name in sorted(names, key=lambda n: (rank.get(n, len(rank)), n)):
        module = importlib.import_module(f"{__package__}.{name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_commands()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
