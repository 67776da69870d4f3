"""Entry point of the `k3export` command.

Each command group lives in its own module of this package and exposes ``register(app)``;
``main`` discovers them so that adding a command never means editing this file.

`main` is the top-level handler: a usage error, a bad option value or any expected failure is one line on stderr
and exit code 2 (`common.describe`); anything else is one "internal error" line and exit code 1.
``K3EXPORT_DEBUG=1`` shows the traceback instead. A Python warning is one ``warning:`` line. An environment switch
set to a value it does not take (`k3export.switches`) is refused the same way, before the command runs.

SIGINT (Ctrl-C) and SIGTERM stop a command promptly: the main thread gets `Stopped` (a `KeyboardInterrupt`) and
unwinds, so worker threads are told to stop, worker processes are terminated, and each output folder being built
is kept resumable (convert, export) or removed (`k3export.safety.stopped_outputs`). The exit code is 128 + the
signal (130, 143), with one line saying what was kept. A run that has not exited `STOP_GRACE_S` seconds after the
signal (the main thread inside a long native call) or that gets a second signal exits at once, leaving the same
(every writer is kill-safe: temporary names, records before renames). The commands in `EXIT_AT_ONCE` never unwind:
TensorRT calls back into Python (the k3 plugins) while it builds, and an exception raised there crashes it; they
write their files atomically, so they exit at the signal.
"""

from __future__ import annotations

import _thread
import importlib
import os
import pkgutil
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import typer

from .common import EXIT_BUG, EXIT_USER, check_options, debug, describe, print_error, scrub

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


# ---------------------------------------------------------------------------------------------- signals
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE_S = 5.0  # how long a signalled run may take to unwind before it exits without unwinding
EXIT_AT_ONCE = frozenset({"build"})  # commands inside native code that calls back into Python (module docstring)


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the command unwinds and exits 128 + `signum`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_stopping: list[int] = []  # the signals received so far
_raised: list[int] = []  # the signal `Stopped` was raised for (once: cleanup is never interrupted again)
_unwind: list[bool] = [True]  # False for a command of `EXIT_AT_ONCE`
_redelivered: list[int] = []  # signals `_deliver_again` tripped, which the watcher does not count as new ones


def _raise_stopped(signum: int, frame: object) -> None:
    """The Python-level handler (main thread): the first signal raises `Stopped`; later ones are the watcher's."""
    if not _raised and _unwind[0]:
        _raised.append(signum)
        raise Stopped(signum)


def _deliver_again(unraisable: Any, hook: Callable[[Any], None]) -> None:
    """``sys.unraisablehook`` while a command runs: a `Stopped` raised where Python swallows exceptions (the signal
    arrived inside a weakref callback, e.g. importlib's module-lock cleanup) is not printed as a traceback; the
    signal is delivered to the main thread again, from another thread once this hook has returned (the main
    thread would run the handler inside it, where it is swallowed again), so `Stopped` is raised where it unwinds
    the command."""
    exc = unraisable.exc_value
    if not isinstance(exc, Stopped):
        hook(unraisable)
        return
    _raised.clear()
    _redelivered.append(exc.signum)
    again = threading.Timer(0.001, _thread.interrupt_main, args=(exc.signum,))
    again.daemon = True
    again.start()


def _watch_signals(read_fd: int) -> None:
    """Woken through `signal.set_wakeup_fd` the moment a signal arrives, even while the main thread sits in native
    code: the first starts the grace period, a second (or the end of the grace period) exits at once."""
    timer: threading.Timer | None = None
    while True:
        try:
            data = os.read(read_fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:  # the command ended: the handlers were put back and the pipe closed
            os.close(read_fd)
            if timer is not None:
                timer.cancel()
            return
        for signum in data:
            if signum not in STOP_SIGNALS:
                continue
            if signum in _redelivered:  # `_deliver_again`'s, not a second signal
                _redelivered.remove(signum)
                continue
            _stopping.append(signum)
            if not _unwind[0]:
                _exit_now(signum)
            if timer is None:
                timer = threading.Timer(STOP_GRACE_S, _exit_now, args=(signum,))
                timer.daemon = True
                timer.start()
            else:
                _exit_now(_stopping[0])


def _stop_line(signum: int, left: list[str]) -> str:
    kept = "; ".join(left) if left else "no output folder was being written"
    return f"stopped by {signal.Signals(signum).name}: {kept}"


def _exit_now(signum: int) -> None:
    """Exit without unwinding: worker processes terminated, unresumable work folders removed, one line."""
    import multiprocessing

    from k3export.safety import abandon_outputs

    for child in multiprocessing.active_children():
        child.kill()
    print_error(_stop_line(signum, abandon_outputs()))
    sys.stdout.flush()
    os._exit(128 + signum)


def _install_signal_handlers(unwind: bool) -> Callable[[], None]:
    """Handle SIGINT / SIGTERM as the module docstring says, for one command; returns what puts back the process's
    previous handlers (`main` runs in-process too: tests, the corpus's forking server)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals reach the main thread only: a command run elsewhere keeps Python's defaults
    _unwind[0] = unwind
    _raised.clear()
    _stopping.clear()
    _redelivered.clear()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = partial(_deliver_again, hook=previous_hook)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_stopped)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch_signals, args=(read_fd,), name="k3export-signals", daemon=True).start()

    def restore() -> None:
        sys.unraisablehook = previous_hook
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        os.close(write_fd)

    return restore


def _one_line_warnings() -> None:
    """A Python warning (a NaN weight loaded, a library's deprecation) as one ``warning:`` line on stderr."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 - warnings' own
        text = " ".join(scrub(str(message)).split())
        sys.stderr.write(f"warning: {text}\n")

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the command, turn every failure into one line (see the module docstring)."""
    # a file size limit (ulimit -f) then fails the write with EFBIG, reported like a full disk, instead of a signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    restore_signals = _install_signal_handlers(unwind=_command_name(argv).strip() not in EXIT_AT_ONCE)
    try:
        code = _run(argv)
    finally:
        restore_signals()
    sys.stdout.flush()
    sys.exit(code)


def _run(argv: list[str] | None) -> int:
    """The command's exit code, every failure told in one line (see the module docstring)."""
    if not debug():
        _one_line_warnings()
    if not sys.stderr.isatty():
        _quiet_progress_bars()
    command = typer.main.get_command(app)
    try:
        from k3export import switches

        switches.check_all()  # a mistyped switch is refused before any work, not found mid-way
        rv = command.main(args=argv, prog_name="k3export", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        print_error("aborted")
        code = 130
    except KeyboardInterrupt:
        code = 130
        if not _raised:  # not one of ours (its line is written below)
            print_error("interrupted")
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
    if _raised:  # a signal stopped the command (typer returns its KeyboardInterrupt as exit code 130)
        from k3export.safety import stopped_outputs

        print_error(_stop_line(_raised[0], stopped_outputs()))
        code = 128 + _raised[0]
    return code


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
