"""Output folders and user-named paths: a command only ever removes or overwrites what it wrote itself.

`output_folder` is the one way a command writes a folder (a converted checkpoint, an ONNX export, a pipeline):

* the work goes into a hidden sibling (``.OUT.partial-XXXX``, or ``.OUT.partial`` for a resumable conversion)
  marked as partial, and is renamed to OUT only when complete, so nothing complete-looking exists before the end;
* an existing non-empty OUT is refused unless ``overwrite``; ``overwrite`` only replaces a folder that carries
  k3export's marker file (`MARKER`) of the same kind, and never a folder that is, contains or lies inside a
  source (real paths, links resolved);
* a lock file beside OUT (``.OUT.lock``, `fcntl.flock`) makes a second concurrent run into OUT fail at once.

A run stopped by a signal (the CLI turns SIGINT / SIGTERM into `KeyboardInterrupt`) unwinds through
`output_folder` like any failure; `stopped_outputs` then says what each folder it was building left: the partial
folder of a resumable run kept (a re-run resumes it), any other removed. `abandon_outputs` does the same without
unwinding, for a process that must exit at once.

`confined_file` is the one check for every path read from a file (an index's ``weight_map``, an ONNX external-data
location, an artifact's data files, a push's file list): it must be relative, stay inside its folder with links
resolved, and name a regular file. `write_bytes_atomic` writes a file (a report, a marker) without following a
link at its name. `check_output_file` is `check_output`'s rule for a single file a command writes (a saved state):
absent, or a file of that kind k3export wrote, or any regular file with ``--overwrite``; never an input, a link or
a special file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from k3export.errors import K3ExportError

MARKER = ".k3export"
CHECKPOINT, EXPORT, PIPELINE = "checkpoint", "export", "pipeline"
KINDS = (CHECKPOINT, EXPORT, PIPELINE)
PARTIAL, COMPLETE = "partial", "complete"
_MARKER_FORMAT = "k3export.output_marker"
_MARKER_MAX_BYTES = 4096


class OutputError(K3ExportError):
    """An output folder that cannot be written as asked (in use, not ours to replace, overlapping a source)."""


# ---------------------------------------------------------------------------------------------- paths
def real(path: str | os.PathLike[str]) -> Path:
    """`path` absolute with every link resolved (what a source and an output are compared by)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def is_within(path: Path, root: Path) -> bool:
    """True when real path `path` is `root` or lies inside it (both already resolved)."""
    return path == root or root in path.parents


def hub_cache_roots(folder: str | os.PathLike[str]) -> list[Path]:
    """Folders a file of `folder` may resolve into: the folder and, for a Hugging Face cache snapshot
    (``.../models--org--name/snapshots/<rev>``), that repository's ``blobs`` folder its links point into."""
    root = real(folder)
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--")):
        roots.append(root.parent.parent / "blobs")
    return roots


def confined_file(folder: str | os.PathLike[str], name: Any, what: str = "file", *,
                  error: type[Exception] = K3ExportError, roots: Iterable[Path] | None = None,
                  label: str = "folder", must_exist: bool = True, file: Any = None, field: str | None = None) -> Path:
    """``folder/name`` once `name` is spelled as a path inside its folder (`check_relative`), resolves (links
    followed) inside `roots` (default: `hub_cache_roots(folder)`) and, when `must_exist`, names an existing regular
    file.

    Every refusal is one `error` line naming `name` (see `check_relative`); the folder is called `label` in it."""
    folder = Path(folder)
    where = check_relative(name, what, error=error, label=label, folder=folder, file=file, field=field)
    path = folder / name
    if must_exist and not os.path.lexists(path):
        raise error(f"{where} is missing")
    target = real(path)
    if not any(is_within(target, r) for r in (roots if roots is not None else hub_cache_roots(folder))):
        raise error(f"{where} resolves to {target}: symlink escapes the {label}")
    if must_exist:
        try:
            mode = os.stat(target).st_mode
        except FileNotFoundError:
            raise error(f"{where} is a dangling symlink (its target is missing)") from None
        except OSError as exc:
            raise error(f"{where} cannot be read ({exc.strerror})") from None
        if not stat.S_ISREG(mode):
            raise error(f"{where} is not a regular file (a folder, pipe, socket or device)")
    return path


def check_relative(name: Any, what: str = "file", *, error: type[Exception] = K3ExportError, label: str = "folder",
                   folder: Any = None, file: Any = None, field: str | None = None) -> str:
    """How a refusal names `name` (returned) once its spelling keeps it inside its folder: a non-empty relative
    '/'-separated path with no ``..`` component, NUL, backslash or drive letter; else one `error` line.

    `name` is named as "`what` 'name' in `folder`", or, when it was read from field `field` of file `file` (an
    artifact's data file, an ONNX external-data location), as "`file`: field 'field': 'name'"."""
    where = (f"{file}: field {field!r}: {name!r}" if field is not None else
             f"{what} {name!r}" + (f" in {folder}" if folder is not None else ""))
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise error(f"{where} is not a relative '/'-separated file path")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise error(f"{where} is an absolute path; a path named in a file is relative to its folder")
    if ".." in name.split("/"):
        raise error(f"{where} leaves the {label} (a '..' path)")
    return where


def open_nofollow(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of regular file `path`, refusing a link at its last component or a special file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---------------------------------------------------------------------------------------------- reports
def write_bytes_atomic(folder: str | os.PathLike[str], name: str, payload: bytes | str) -> Path:
    """Write `payload` to `folder`/`name` atomically and never through a link: a new temporary file created with
    ``O_EXCL | O_NOFOLLOW`` beside it, fsynced and renamed over the name. A reader sees the old file or the new
    one; a symlink at `name` is replaced, the file it points to is never touched. Disk errors name the file."""
    if not name or "/" in name or name in (".", ".."):
        raise OutputError(f"{name!r} is not a file name")
    payload = payload.encode("utf-8") if isinstance(payload, str) else payload
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    tmp = f".{name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        os.fsync(dfd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, os.fspath(target)) from None
    finally:
        os.close(dfd)
    return target


def write_json_report(path: str | os.PathLike[str], data: Any) -> Path:
    path = Path(path)
    return write_bytes_atomic(path.parent, path.name, json.dumps(data, indent=2) + "\n")


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_REPORT_MAX_BYTES = 1 << 28  # a report read back to see whether it is one of ours


def _is_our_report(path: Path, fmt: str | None) -> bool:
    """Whether the file at `path` is a report k3export writes of this kind: JSON whose ``format`` is `fmt`, or,
    with `fmt` None, a PNG picture (a plot)."""
    try:
        fd = open_nofollow(path)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as fh:
        if fmt is None:
            return fh.read(len(_PNG_SIGNATURE)) == _PNG_SIGNATURE
        raw = fh.read(_REPORT_MAX_BYTES + 1)
    try:
        data = json.loads(raw) if len(raw) <= _REPORT_MAX_BYTES else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == fmt


def check_report_path(path: str | os.PathLike[str], fmt: str | None) -> Path:
    """`path` once a report (JSON of ``format`` `fmt`, or a PNG plot with `fmt` None) may be written there: its
    folder exists, and an existing file is replaced only when it is a report of the same kind k3export wrote,
    so a mistyped path never replaces a model file, a checkpoint shard or a user's file. Called before the work
    that produces the report, so that a bad path fails in a second, not after it."""
    path = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    what = f"a {fmt} file" if fmt else "a PNG plot"
    if path.is_dir() and not path.is_symlink():
        raise K3ExportError(f"{path}: is a folder; give the file path for {what}")
    if not path.parent.is_dir():
        raise K3ExportError(f"{path.parent}: no such folder (for {what} at {path})")
    if path.is_symlink() and not path.exists():  # a user who links to a missing place meant the file to land there
        raise K3ExportError(f"{path}: is a symbolic link to {os.readlink(path)}, which does not exist; k3export "
                            f"replaces a link rather than writing through it, so give the path for {what} itself")
    # a link is replaced, never written through (write_bytes_atomic), so it may stand there
    if os.path.lexists(path) and not path.is_symlink() and not _is_our_report(path, fmt):
        raise K3ExportError(f"{path}: exists and is not {what}; refusing to replace it (remove it, or choose "
                            "another path)")
    check_writable(path, what)
    return path


def check_output_file(path: str | os.PathLike[str], what: str, ours: Callable[[Path], bool], *,
                      overwrite: bool = False, sources: Iterable[Any] = ()) -> Path:
    """`path` (absolute) once a command may write the file `what` there (atomically, `write_bytes_atomic`): the file
    analogue of `check_output`, called before the work and again just before the write.

    Refused, with or without `overwrite`: a path that is, or lies inside, one of `sources` (the files and folders
    the command reads: links resolved), a link, anything but a regular file (a folder, FIFO, socket or device), a
    folder that cannot be written. An existing regular file is replaced only when `ours(path)` says k3export wrote
    it (a file of this kind, any version), or with `overwrite`."""
    path = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    target = real(path)
    for src in sources:
        if src is None or not os.path.exists(src):
            continue
        src_real = real(src)
        if is_within(target, src_real):
            how = "is" if target == src_real else "lies inside"
            raise OutputError(f"{path}: {how} {src}, which this command reads; choose another path for {what}")
    if os.path.islink(path):
        raise OutputError(f"{path}: is a symbolic link; give the path for {what} itself")
    if os.path.lexists(path):
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
                    if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                    "not a regular file")
            raise OutputError(f"{path}: is {kind}; refusing to replace it with {what}")
        if not overwrite and not ours(path):
            raise OutputError(f"{path}: exists and is not {what} k3export wrote; refusing to replace it (pass "
                              "--overwrite to replace it, or choose another path)")
    return check_writable(path, what)


def check_writable(path: str | os.PathLike[str], what: str = "a file") -> Path:
    """`path` once a file can be created in its folder (a report, a plot, an engine, a sidecar, a timing cache):
    a temporary file is created there and removed, so a folder that is read-only, on a read-only file system or
    not a real folder (``/proc``) fails in a second, with one line, before the work that produces the file."""
    path = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if not path.parent.is_dir():
        raise K3ExportError(f"{path.parent}: no such folder (for {what} at {path})")
    if path.is_dir() and not path.is_symlink():
        raise K3ExportError(f"{path}: is a folder; {what} cannot be written there")
    probe = f".{path.name}.probe-{uuid.uuid4().hex[:12]}"
    try:
        dfd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=dfd))
            os.unlink(probe, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise K3ExportError(f"{path}: cannot write {what} there ({exc.strerror or exc})") from None
    return path


# ---------------------------------------------------------------------------------------------- markers
def write_marker(folder: str | os.PathLike[str], kind: str, state: str) -> None:
    """Mark `folder` as k3export's output of `kind` (`KINDS`), `PARTIAL` or `COMPLETE`."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    body = {"format": _MARKER_FORMAT, "format_version": 1, "kind": kind, "state": state}
    write_bytes_atomic(folder, MARKER, json.dumps(body) + "\n")


def read_marker(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker of `folder` ({"kind", "state"}), or None when there is none or it is not ours.

    A marker that is a link, a special file or not k3export's small JSON counts as no marker."""
    try:
        fd = open_nofollow(Path(folder) / MARKER)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(_MARKER_MAX_BYTES + 1)
    try:
        data = json.loads(raw.decode("utf-8")) if len(raw) <= _MARKER_MAX_BYTES else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not (isinstance(data, dict) and data.get("format") == _MARKER_FORMAT and data.get("kind") in KINDS
            and data.get("state") in (PARTIAL, COMPLETE)):
        return None
    return data


def check_finished(folder: str | os.PathLike[str]) -> None:
    """Refuse a folder k3export marked partial: a stopped run's, whose files may be cut short (copied out of its
    hidden work folder). No marker (a Hub snapshot, a copy) is no objection."""
    marker = read_marker(folder)
    if marker is not None and marker["state"] != COMPLETE:
        raise K3ExportError(f"{folder}: marked {marker['state']} by k3export (its {marker['kind']} did not finish; "
                            "run it again to resume it)")


# ---------------------------------------------------------------------------------------------- checks
def _describe(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} entries)" if len(names) > 3 else "")
    return shown


def check_output(out: str | os.PathLike[str], kind: str, *, overwrite: bool = False,
                 sources: Iterable[Any] = ()) -> Path:
    """The absolute path of `out` once it may be written as `kind`; `OutputError` naming why not.

    Refused: an OUT that is, contains or lies inside a source folder (links resolved); an OUT that is a link or
    not a folder; a non-empty OUT without `overwrite`; with `overwrite`, a non-empty OUT that does not carry
    k3export's complete marker of the same `kind`."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    out = Path(os.path.abspath(os.path.expanduser(os.fspath(out))))
    _check_parent(out)
    target = real(out)
    for src in sources:
        if src is None or not isinstance(src, (str, os.PathLike)) or not os.path.exists(src):
            continue
        src_real = real(src)
        if is_within(target, src_real) or is_within(src_real, target):
            how = ("is the source folder" if target == src_real else
                   "lies inside the source folder" if is_within(target, src_real) else "contains the source folder")
            raise OutputError(f"{out}: the output folder {how} {src}; choose an output outside the source")
    if os.path.islink(out):
        raise OutputError(f"{out}: is a symbolic link; give the output folder itself")
    if not os.path.lexists(out):
        return out
    if not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder")
    if not any(out.iterdir()):
        return out
    marker = read_marker(out)
    if not overwrite:
        raise OutputError(f"{out}: exists and is not empty ({_describe(out)}); pass --overwrite to replace "
                          f"{_a(kind)} k3export wrote, or choose another output")
    if marker is None:
        raise OutputError(f"{out}: is not a folder k3export wrote (no {MARKER} marker; it holds {_describe(out)}); "
                          "--overwrite only replaces k3export's own output: remove it yourself or choose another "
                          "output")
    if marker["kind"] != kind or marker["state"] != COMPLETE:
        raise OutputError(f"{out}: holds a {marker['state']} k3export {marker['kind']}, not {_a(kind)}; --overwrite "
                          f"only replaces {_a(kind)}")
    return out


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _check_parent(out: Path) -> None:
    for parent in (out.parent, *out.parent.parents):
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise OutputError(f"{out}: its parent {parent} is not a folder")
            return


# ---------------------------------------------------------------------------------------------- lock
def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def output_lock(out: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the lock of output `out` (``.OUT.lock`` beside it) for the block; a held lock fails at once."""
    out = Path(os.path.abspath(os.fspath(out)))
    _check_parent(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(out)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f" (process {holder})" if holder.isdigit() else ""
            raise OutputError(f"{out}: another k3export run is writing this output{who}; wait for it to finish "
                              f"(lock file {path})") from None
        except BaseException:
            os.close(fd)
            raise
        # the holder we waited on may have removed the file: lock only the file the name still points to
        try:
            same = os.path.samestat(os.fstat(fd), os.lstat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


# ---------------------------------------------------------------------------------------------- the folder
def partial_path(out: str | os.PathLike[str]) -> Path:
    """The fixed hidden sibling where a resumable run builds `out` (``.OUT.partial``)."""
    out = Path(os.path.abspath(os.fspath(out)))
    return out.parent / f".{out.name}.partial"


def _open_partial(out: Path, kind: str) -> tuple[Path, bool]:
    """The resumable partial folder of `out` (created when absent) and whether it was already there."""
    path = partial_path(out)
    if not os.path.lexists(path):  # made whole, then renamed: the folder never exists without its marker
        fresh = path.with_name(f"{path.name}.new-{uuid.uuid4().hex[:8]}")
        fresh.mkdir()
        try:
            write_marker(fresh, kind, PARTIAL)
            os.rename(fresh, path)
        except BaseException:
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        return path, False
    marker = read_marker(path) if path.is_dir() and not path.is_symlink() else None
    if marker is not None and marker["state"] == PARTIAL and marker["kind"] != kind:
        raise OutputError(f"{path}: holds an interrupted k3export {marker['kind']}, not {_a(kind)}: finish it (run "
                          f"that command again) or remove it, or choose another output")
    if marker is None or marker["kind"] != kind or marker["state"] != PARTIAL:
        raise OutputError(f"{path}: is in the way of the output {out.name} and is not a partial k3export {kind} "
                          "(no marker); remove it yourself")
    return path, True


def remove_except(folder: Path, keep: Iterable[str]) -> None:
    """Remove every entry of `folder` (a partial folder k3export writes) but the names in `keep`; links are removed,
    never followed."""
    keep = set(keep)
    for p in folder.iterdir():
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _annotated(exc: OSError, where: Path) -> OSError:
    """`exc` with a file name (the folder being written) when the system gave none (a write() on a full disk)."""
    if exc.filename is None:
        return type(exc)(exc.errno, exc.strerror or str(exc), os.fspath(where))
    return exc


# the output folders this process is building (out, work, kind, resumable), and what interrupted ones left
_ACTIVE: list[tuple[Path, Path, str, bool]] = []
_STOPPED: list[str] = []


def _left(out: Path, work: Path, kind: str, resumable: bool) -> str:
    """What building `out` in `work` leaves once stopped (after `_cleanup`), in words."""
    if resumable and work.is_dir():
        done = sum(1 for p in work.iterdir() if not p.name.startswith(".") and ".tmp-" not in p.name)
        return (f"kept the partial {kind} in {work} ({done} finished file{'s' if done != 1 else ''}; run the same "
                "command again to resume)")
    return f"removed the unfinished {kind} ({out} is unchanged)"


def stopped_outputs() -> list[str]:
    """What each output folder an interruption unwound through left, in words (see the module docstring), since
    the last call."""
    left = list(_STOPPED)
    _STOPPED.clear()
    return left


def abandon_outputs() -> list[str]:
    """For a process about to exit without unwinding: remove the work folder of each output being built that a
    re-run cannot resume, keep the others; what each left, in words (with those already stopped)."""
    for out, work, kind, resumable in list(_ACTIVE):
        if os.path.isdir(work) and read_marker(work) is not None:  # ours (a partial folder in the way is not)
            _cleanup(work, resumable, resumed=False)
        _STOPPED.append(_left(out, work, kind, resumable))
    _ACTIVE.clear()
    return list(_STOPPED)


@contextlib.contextmanager
def output_folder(out: str | os.PathLike[str], kind: str, *, overwrite: bool = False, sources: Iterable[Any] = (),
                  resumable: bool = False) -> Iterator[Path]:
    """Build output `out` of `kind` in a hidden partial sibling; rename it into place when the block succeeds.

    Under `output_lock`, `check_output` runs first. The block receives the partial folder: a fresh
    ``.OUT.partial-XXXX`` removed on failure or, with `resumable`, ``.OUT.partial``, kept on failure (once it
    holds work) so that a re-run continues there. On success the folder is marked complete and renamed to OUT; a
    replaced k3export output is removed after the rename."""
    out = Path(os.path.abspath(os.path.expanduser(os.fspath(out))))
    sources = list(sources)
    with output_lock(out):
        check_output(out, kind, overwrite=overwrite, sources=sources)
        work = partial_path(out) if resumable else out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
        entry = (out, work, kind, resumable)
        _ACTIVE.append(entry)  # from before the folder exists: a signal while it is made is accounted for too
        try:
            try:
                if resumable:
                    work, resumed = _open_partial(out, kind)
                else:
                    resumed = False
                    work.mkdir()
                    write_marker(work, kind, PARTIAL)
            except KeyboardInterrupt:
                if not resumable:  # a fresh name: only this run can have made it
                    shutil.rmtree(work, ignore_errors=True)
                _STOPPED.append(_left(out, work, kind, resumable))
                raise
            try:
                yield work
                check_output(out, kind, overwrite=overwrite, sources=sources)  # unchanged while we worked?
                write_marker(work, kind, COMPLETE)
                _move_into_place(work, out)
            except OSError as exc:
                _cleanup(work, resumable, resumed)
                raise _annotated(exc, work) from None
            except KeyboardInterrupt:
                _cleanup(work, resumable, resumed)
                _STOPPED.append(_left(out, work, kind, resumable))
                raise
            except BaseException:
                _cleanup(work, resumable, resumed)
                raise
        finally:
            if entry in _ACTIVE:
                _ACTIVE.remove(entry)


def _holds_work(work: Path) -> bool:
    """Whether partial folder `work` holds a file besides its marker (empty folders are no work)."""
    return any(Path(d, f) != work / MARKER for d, _, files in os.walk(work) for f in files)


def _cleanup(work: Path, resumable: bool, resumed: bool) -> None:
    if not work.exists():
        return
    if resumable and (resumed or _holds_work(work)):
        return  # kept, marked partial: a re-run resumes from it
    shutil.rmtree(work, ignore_errors=True)


def _move_into_place(work: Path, out: Path) -> None:
    if os.path.lexists(out) and out.is_dir() and any(out.iterdir()):
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        try:
            marker = read_marker(old)  # the folder we are about to delete, checked once it can no longer change
            if marker is None or marker["kind"] != (read_marker(work) or {}).get("kind"):
                raise OutputError(f"{out}: changed while k3export was writing it (no longer k3export's output); "
                                  "nothing was replaced")
            os.rename(work, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(work, out)  # over an empty folder, or where nothing is
    with contextlib.suppress(OSError):
        dfd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


__all__ = [
    "CHECKPOINT", "COMPLETE", "EXPORT", "KINDS", "MARKER", "OutputError", "PARTIAL", "PIPELINE", "abandon_outputs",
    "check_finished", "check_output", "check_output_file", "check_relative", "check_report_path", "check_writable", "confined_file",
    "hub_cache_roots",
    "is_within", "open_nofollow", "output_folder", "output_lock", "partial_path", "read_marker", "real",
    "remove_except", "stopped_outputs", "write_bytes_atomic", "write_json_report", "write_marker",
]
