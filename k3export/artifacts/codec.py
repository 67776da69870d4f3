"""Strict JSON for artifact files: each file is one dataclass, written and read by the same type.

`Document` subclasses declare their fields with type hints; `decode` reads a JSON value into them field by field
(every field required, none unknown, each of its declared type) and `encode` writes them back, so a write then a
read is the identity. Every file starts with ``{"format": ..., "format_version": ...}``.

The file side is just as strict: `read_json_file` reads only a regular file that resolves inside its folder
(`k3export.safety.confined_file`, which also checks every path an artifact file names), bounded in size, and turns
every JSON failure (syntax, deep nesting, NaN, numbers too long to parse) into one line; `write_bytes_atomic` writes
through a temporary file and a rename in the same folder and never through a symlink.

Every problem is an `ArtifactError` whose message is one line naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

from k3export.errors import K3ExportError
from k3export.safety import confined_file, write_bytes_atomic

MAX_JSON_BYTES = 1 << 30  # no artifact JSON file we write comes near this
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: marks a float field that may hold inf / -inf / nan (written as the strings "inf", "-inf", "nan")
NONFINITE = "nonfinite"
Metric = Annotated[float, NONFINITE]
Scalar = str | int | float | bool | None
_SHA256 = re.compile(r"[0-9a-f]{64}")

D = TypeVar("D", bound="Document")


class ArtifactError(K3ExportError, ValueError):
    """An artifact file that is missing, malformed, or disagrees with the model: one line naming file and field."""


def fail(file: Any, field: str, problem: str) -> ArtifactError:
    return ArtifactError(f"{file}: {f'field {field!r}: ' if field else ''}{problem}")


# ---------------------------------------------------------------------------------------------- files
def check_sha256(digest: str, file: Any, field: str) -> None:
    if not _SHA256.fullmatch(digest):
        raise fail(file, field, "is not a lowercase hex sha256")


def read_json_file(folder: str | os.PathLike[str], name: str, confine: bool = True) -> tuple[Path, Any]:
    """(path, parsed JSON) of the file `name` inside `folder`; `ArtifactError` for anything but valid JSON in a
    regular file inside the folder. ``confine=False``: a file a user names by its path, which may be a link to
    anywhere (still a regular file)."""
    path = confined_file(folder, name, error=ArtifactError, roots=None if confine else [Path("/")])
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise fail(path, "", f"is {size} bytes, more than any k3export JSON file ({MAX_JSON_BYTES})")
    try:
        text = path.read_bytes().decode("utf-8")
        return path, json.loads(text, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise fail(path, "", "is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise fail(path, "", f"is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise fail(path, "", "is nested too deeply to be an artifact file") from None
    except ValueError as exc:  # NaN / Infinity, integers with too many digits
        raise fail(path, "", f"is not valid JSON ({exc})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _what(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return "a list" if isinstance(value, list) else "an object"


def _name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return "a number, 'inf', '-inf' or 'nan'"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_name(a) for a in typing.get_args(tp))
    if origin is list or origin is tuple:
        return "a list"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "an object"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", type(None): "null"}.get(
        tp, str(tp))


class _Mismatch(Exception):
    pass


def decode(tp: Any, value: Any, file: Any, field: str = "") -> Any:
    """`value` (parsed JSON) as type `tp`; `ArtifactError` naming `file` and the field path otherwise."""
    try:
        return _decode(tp, value, file, field)
    except _Mismatch:
        raise fail(file, field, f"expected {_name(tp)}, got {_what(value)}") from None


def _sub(field: str, key: str | int) -> str:
    return f"{field}[{key}]" if isinstance(key, int) else (f"{field}.{key}" if field else key)


def _decode(tp: Any, value: Any, file: Any, field: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return decode_fields(tp, value, file, field)
    if origin is Annotated:  # Metric
        if isinstance(value, str) and value in ("inf", "-inf", "nan"):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Mismatch
        return float(value)
    if origin is Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args):
            raise _Mismatch
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _decode(a, value, file, field)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is list or origin is tuple:
        if not isinstance(value, list):
            raise _Mismatch
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):  # fixed length
            if len(value) != len(args):
                raise fail(file, field, f"expected a list of {len(args)} items, got {len(value)}")
            return tuple(decode(a, v, file, _sub(field, i)) for i, (a, v) in enumerate(zip(args, value)))
        out = [decode(args[0], v, file, _sub(field, i)) for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        return {k: decode(args[1], v, file, _sub(field, k)) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Mismatch
        if not INT64_MIN <= value <= INT64_MAX:
            raise fail(file, field, f"{value} is outside the 64-bit integer range")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Mismatch
        if not math.isfinite(value):
            raise fail(file, field, f"{value} is not finite")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _Mismatch
        return value
    raise TypeError(f"decode: unsupported type {tp!r}")  # a programming error in a Document declaration


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
    return hints


_HINTS: dict[type, dict[str, Any]] = {}


def decode_fields(cls: type, value: Any, file: Any, field: str = "", skip: tuple[str, ...] = ()) -> Any:
    """An instance of dataclass `cls` from a JSON object holding exactly its fields (plus the keys in `skip`); a
    field with a default may be absent (files written before it existed)."""
    if not isinstance(value, dict):
        raise fail(file, field, f"expected an object, got {_what(value)}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in value:
        if key not in names and key not in skip:
            raise fail(file, _sub(field, key), "unknown field")
    optional = {f.name for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    missing = [n for n in names if n not in value and n not in optional]  # a field with a default came later
    if missing:
        raise fail(file, _sub(field, missing[0]), "missing")
    return cls(**{n: decode(hints[n], value[n], file, _sub(field, n)) for n in names if n in value})


def encode(obj: Any) -> Any:
    """The JSON value of a dataclass / list / dict / scalar (non-finite floats as "inf", "-inf", "nan")."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): encode(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


# ---------------------------------------------------------------------------------------------- documents
class Document:
    """Base of every artifact file type (a dataclass): its file name, format name and version, and the one
    encoder / decoder pair. Subclasses add semantic checks in `check`."""

    FILE: ClassVar[str]
    FORMAT: ClassVar[str]
    VERSION: ClassVar[int] = 1

    def check(self, file: Any) -> None:
        """Raise `ArtifactError` for a value that is well typed but wrong (after decoding, before use)."""

    def to_json(self) -> dict[str, Any]:
        return {"format": self.FORMAT, "format_version": self.VERSION, **encode(self)}

    @classmethod
    def from_json(cls: type[D], data: Any, file: Any = None) -> D:
        file = cls.FILE if file is None else file
        if not isinstance(data, dict):
            raise fail(file, "", f"expected a JSON object, got {_what(data)}")
        if data.get("format") != cls.FORMAT:
            problem = "missing" if "format" not in data else f"is {data['format']!r}, expected {cls.FORMAT!r}"
            raise fail(file, "format", problem)
        version = data.get("format_version")
        if "format_version" not in data:
            raise fail(file, "format_version", "missing")
        if version != cls.VERSION or isinstance(version, bool):
            raise fail(file, "format_version", f"is {version!r}; this k3export reads version {cls.VERSION}")
        doc = decode_fields(cls, data, file, skip=("format", "format_version"))
        doc.check(file)
        return doc

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n"

    def write(self, folder: str | os.PathLike[str], name: str | None = None) -> Path:
        """Write atomically to `folder`/`name` (default: the type's file name); returns the path."""
        self.check(Path(folder) / (name or self.FILE))
        return write_bytes_atomic(folder, name or self.FILE, self.dumps().encode("utf-8"))

    @classmethod
    def read(cls: type[D], folder: str | os.PathLike[str], name: str | None = None) -> D:
        """Read and check `folder`/`name` (default: the type's file name)."""
        path, data = read_json_file(folder, name or cls.FILE)
        return cls.from_json(data, path)

    @classmethod
    def read_file(cls: type[D], path: str | os.PathLike[str]) -> D:
        """Read and check a file a user names by its path (`read_json_file` with ``confine=False``)."""
        path = Path(path)
        path, data = read_json_file(path.parent, path.name, confine=False)
        return cls.from_json(data, path)

    @classmethod
    def read_if_present(cls: type[D], folder: str | os.PathLike[str], name: str | None = None) -> D | None:
        """`read`, or None when the folder has no such entry at all (a dangling link counts as present)."""
        return cls.read(folder, name) if os.path.lexists(Path(folder) / (name or cls.FILE)) else None


__all__ = ["ArtifactError", "Document", "Metric", "Scalar", "check_sha256", "decode", "decode_fields", "encode", "fail",
           "read_json_file", "write_bytes_atomic"]
