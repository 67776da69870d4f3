"""Helpers shared by the CLI commands: every expected failure becomes one line and exit code 2.

`describe` turns an exception into that line (naming the file, tensor or field the library named), `user_errors`
applies it around a command's body, and `check_options` gives every numeric option of every command a range.
``K3EXPORT_DEBUG=1`` re-raises instead, so the traceback shows. Tokens never reach the output (`scrub`).
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
from rich.console import Console

#: the native kernels of generate, chat, cache and validate (`k3export.runtime.Target.kernels`)
KernelsOption = Annotated[bool | None, typer.Option(
    "--kernels/--no-kernels", help="k3export's native kernels on or off (ort: the k3 ops library; openvino: the k3 "
    "extension). Default: K3EXPORT_ORT_OPS / K3EXPORT_OV_EXT, on.")]

console = Console()
err_console = Console(stderr=True)

EXIT_USER = 2  # a bad input or environment, told in one line
EXIT_BUG = 1  # anything else (K3EXPORT_DEBUG=1 shows its traceback)
_TOKEN_RX = re.compile(r"\bhf_[A-Za-z0-9]{6,}")
_TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN")


@contextlib.contextmanager
def bytes_bar(enabled: bool, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar over bytes, as the callback ``(done, total)`` long library work takes; None when
    disabled. Transient: it leaves the console as it was."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn(f"[bold]{what}[/]"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def debug() -> bool:
    from k3export import switches
    from k3export.errors import K3ExportError

    try:
        return switches.flag("K3EXPORT_DEBUG")
    except K3ExportError:  # reported by the command's own check (`switches.check_all`), not while reporting
        return False


def scrub(text: str) -> str:
    """`text` with every Hugging Face token (the ones in the environment, and anything shaped like one) masked."""
    for var in _TOKEN_VARS:
        token = os.environ.get(var)
        if token and len(token) >= 4:
            text = text.replace(token, "***")
    return _TOKEN_RX.sub("hf_***", text)


def print_error(message: str) -> None:
    """``error: <message>`` as exactly one line on stderr."""
    line = " ".join(scrub(str(message)).split())
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------- describing failures
_OS_HINTS = {
    errno.ENOSPC: "no space left on the device",
    errno.EFBIG: "file too large (disk full or file size limit reached)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
}


def _os_error(exc: OSError) -> str:
    what = _OS_HINTS.get(exc.errno or -1) or exc.strerror or type(exc).__name__
    if exc.filename is not None:
        where = os.fsdecode(exc.filename)
        if exc.filename2 is not None:
            where += f" -> {os.fsdecode(exc.filename2)}"
        return f"{where}: {what}"
    return f"{what} ({exc})" if str(exc) and str(exc) != what else what


def _expected_types() -> tuple[type[BaseException], ...]:
    from k3export.errors import K3ExportError

    types: list[type[BaseException]] = [K3ExportError]
    for module, name in (("k3export.modeling.configuration_k3", "K3ConfigError"),
                         ("k3export.modeling.loading_k3", "K3CheckpointError"), ("safetensors", "SafetensorError")):
        mod = sys.modules.get(module)  # only what the command imported can have been raised
        if mod is not None and isinstance(getattr(mod, name, None), type):
            types.append(getattr(mod, name))
    return tuple(types)


def describe(exc: BaseException) -> str | None:
    """The one line for an expected failure, or None for a bug (which `main` reports as an internal error)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, _expected_types()):
        if type(exc).__name__ == "SafetensorError":
            return f"safetensors: {first}"
        return str(exc)
    if isinstance(exc, OSError):
        return _os_error(exc)
    if type(exc).__module__.startswith("onnxruntime"):
        return f"ONNX Runtime could not load or run the model: {first}"
    if isinstance(exc, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({exc.reason} at byte {exc.start})"
    if isinstance(exc, json.JSONDecodeError):
        return f"a file is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    if isinstance(exc, RecursionError):
        return "an input file is nested too deeply (JSON or protobuf recursion limit)"
    if isinstance(exc, MemoryError):
        return "out of memory: the input asks for more memory than is available (check its sizes and shapes)"
    if isinstance(exc, (ValueError, OverflowError)):
        return first
    return None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Report every expected failure of the block as one line plus exit code 2, never a traceback."""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        if debug() or isinstance(exc, typer.BadParameter):
            raise
        message = describe(exc)
        if message is None:
            raise
        print_error(message)
        raise typer.Exit(code=EXIT_USER) from None
    except MemoryError as exc:  # a BaseException only by accident of history: as above
        if debug():
            raise
        print_error(describe(exc) or "out of memory")
        raise typer.Exit(code=EXIT_USER) from None


# ---------------------------------------------------------------------------------------------- option ranges
INT64 = (-(2**63), 2**63 - 1)
#: ranges and checks by option name, for options that mean the same in every command
SEED_RANGE = (0, 2**32 - 1)
#: tokens one command may generate: more than any context K3 fits on 16 H200s (`k3export deploy-plan --config k3`),
#: far below what an int32 token count (onnxruntime-genai's) or a loop that never ends would make of it
MAX_NEW_TOKENS_RANGE = (1, 1 << 24)
_RANGES = {"seed": SEED_RANGE, "max_new_tokens": MAX_NEW_TOKENS_RANGE}
_DEVICE_RX = re.compile(r"cpu|cuda(:\d{1,2})?")


def _check_value(name: str, annotation: Any, value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if name == "device" and isinstance(value, str):
        if not _DEVICE_RX.fullmatch(value):
            raise typer.BadParameter(f"{value!r} is not a device: use cpu, cuda or cuda:N")
        _check_cuda(value)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_check_value(name, annotation, v) for v in value)
    if isinstance(value, int):
        lo, hi = _RANGES.get(name, INT64)
        if not lo <= value <= hi:
            raise typer.BadParameter(f"{value} is out of range [{lo}, {hi}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _check_cuda(device: str) -> None:
    """A ``cuda[:N]`` device the installed torch can serve (built with CUDA, a device visible, N in range)."""
    if not device.startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        raise typer.BadParameter(f"{device!r}: this torch ({torch.__version__}) is built without CUDA; use --device "
                                 "cpu, or install a CUDA build of torch")
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise typer.BadParameter(f"{device!r}: torch sees {count} CUDA device(s)"
                                 + (f" (cuda:0 to cuda:{count - 1})" if count else "; use --device cpu"))


def _checker(name: str, annotation: Any, previous: Callable[..., Any] | None) -> Callable[..., Any]:
    def check(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
        value = _check_value(name, annotation, value)
        if previous is None:
            return value
        wanted = inspect.signature(previous).parameters
        kwargs = {}
        for pname, p in wanted.items():
            kwargs[pname] = ctx if p.annotation is typer.Context else param if p.annotation is typer.CallbackParam \
                else value
        return previous(**kwargs)

    check._k3export_check = True  # type: ignore[attr-defined]
    return check


def check_options(app: typer.Typer) -> None:
    """Give every option and argument of every command of `app` a range check: integers within int64 (seeds
    within [0, 2**32), ``--max-new-tokens`` within `MAX_NEW_TOKENS_RANGE`), floats finite, ``--device`` cpu /
    cuda[:N] that the installed torch serves. Options' own min / max still apply."""
    for info in app.registered_commands:
        if info.callback is None or getattr(info.callback, "_k3export_checked", False):
            continue
        for name, p in inspect.signature(info.callback, eval_str=True).parameters.items():
            # an option declared once as ``Annotated[T, typer.Option(...)]`` is shared by several commands:
            # its ParameterInfo gets the check once
            infos = [p.default, *getattr(p.annotation, "__metadata__", ())]
            for param_info in infos:
                if isinstance(param_info, typer.models.ParameterInfo) and \
                        not getattr(param_info.callback, "_k3export_check", False):
                    param_info.callback = _checker(name, p.annotation, param_info.callback)
        info.callback._k3export_checked = True  # type: ignore[attr-defined]


def forms_table(config: Any) -> Any:
    """The weight bytes of `config` in each form on the way to a runtime (`k3export.info.weight_bytes_by_form`)."""
    from rich.console import Group
    from rich.table import Table

    from k3export.info import weight_bytes_by_form
    from k3export.units import format_bytes

    forms = Table(title="weight bytes by form")
    forms.add_column("form")
    forms.add_column("bytes", justify="right")
    forms.add_column("bits / parameter", justify="right")
    for name, n, bits in weight_bytes_by_form(config).rows():
        forms.add_row(name, format_bytes(n), f"{bits:.2f}")
    return Group(forms, parts_table(config))


def parts_table(config: Any) -> Any:
    """Bits per weight of each part of `config`'s weights in each export form (`k3export.info.bits_by_part`)."""
    from rich.table import Table

    from k3export.converters.onnx.quantize import quantized_param_names
    from k3export.info import PART_FORMS, bits_by_part

    table = Table(title="bits per weight by part (export --dtype, --quantize; block 32)")
    table.add_column("part")
    table.add_column("parameters", justify="right")
    for form in PART_FORMS:
        table.add_column(form, justify="right")
    for row in bits_by_part(config, quantized_param_names(config)):
        mx = f" ({row.mxfp4_bits:g} with --experts mxfp4)" if row.mxfp4_bits else ""
        table.add_row(row.part, f"{row.params:,}", *(f"{row.bits[f]:.2f}" + (mx if f == PART_FORMS[0] else "")
                                                      for f in PART_FORMS))
    return table
