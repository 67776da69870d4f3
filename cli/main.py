"""Entry point of the `k3export` command.

Each command group lives in its own module of this package and exposes ``register(app)``;
``main`` discovers them so that adding a command never means editing this file.

`main` is the top-level handler: a usage error, a bad option value or any expected failure is one line on stderr
and exit code 2 (`common.describe`); anything else is one "internal error" line and exit code 1.
``K3EXPORT_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import signal
import sys

import typer

from .common import EXIT_BUG, EXIT_USER, check_options, debug, describe, print_error

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
    check_options(app)


_register_commands()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the command, turn every failure into one line (see the module docstring)."""
    # a file size limit (ulimit -f) then fails the write with EFBIG, reported like a full disk, instead of a signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if not sys.stderr.isatty():
        _quiet_progress_bars()
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="k3export", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        print_error("aborted")
        code = 130
    except KeyboardInterrupt:
        print_error("interrupted")
        code = 130
    except SystemExit:
        raise
    except BaseException as exc:
        if debug():
            raise
        if isinstance(exc, typer.BadParameter) or type(exc).__name__ in ("UsageError", "NoSuchOption",
                                                                         "MissingParameter", "BadOptionUsage",
                                                                         "BadArgumentUsage", "NoSuchCommand"):
            print_error(f"{exc.format_message()} (see k3export {_command_name(argv)}--help)")
            code = EXIT_USER
        elif hasattr(exc, "format_message") and hasattr(exc, "exit_code"):  # any other click-style exception
            print_error(exc.format_message())
            code = exc.exit_code or EXIT_USER
        else:
            message = describe(exc)
            if message is not None:
                print_error(message)
                code = EXIT_USER
            else:
                print_error(f"internal error (a bug in k3export): {type(exc).__name__}: {exc}; set K3EXPORT_DEBUG=1 "
                            "for the traceback")
                code = EXIT_BUG
    sys.stdout.flush()
    sys.exit(code)


def _quiet_progress_bars() -> None:
    """No library progress bars on a stderr that is not a terminal: there stderr carries the one error line."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # huggingface_hub and transformers, when imported
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _command_name(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    name = next((a for a in args if not a.startswith("-")), "")
    return f"{name} " if name in {c.name for c in app.registered_commands} else ""


if __name__ == "__main__":
    main()
