"""The reliability corpus's harness: run the real CLI in a subprocess and check what it leaves behind
(`conftest.py` holds the fixtures).

`Cli` runs ``k3export ARGS`` as a real process: forked from a pre-imported CLI (`_zygote.py`, fast) or, with
``mode="exec"``, as ``python -m k3export_cli.main`` (for the Hub commands, which read their endpoint at import
time). ``K3EXPORT_CORPUS_EXEC=1`` runs every case the slow, exec way. Every run carries a planted Hugging Face
token in its environment; `check_no_secret` asserts it appears in no output and no file.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SECRET = "hf_plantedSecret7Q2x9LmZ4kVb"
SHARD = 150_000  # tiny output shards: the released fixture converts into several


@dataclass
class Run:
    argv: list[str]
    code: int
    stdout: str
    stderr: str
    pid: int = 0
    timed_out: bool = False

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    def __str__(self) -> str:
        return (f"k3export {' '.join(self.argv)} -> exit {self.code}{' (timed out)' if self.timed_out else ''}\n"
                f"--- stderr ---\n{self.stderr[-4000:]}\n--- stdout ---\n{self.stdout[-2000:]}")


def base_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV") if k in os.environ}
    env.update(HOME=str(tmp / "home"), HF_HOME=str(tmp / "hf-home"), HF_TOKEN=SECRET, HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false", TRITON_INTERPRET="1",
               OMP_NUM_THREADS="1", COLUMNS="200", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


class Zygote:
    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.lock = threading.Lock()
        assert json.loads(self.proc.stdout.readline())["ready"]

    def ask(self, **req) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Launched:
    """A CLI process started in the background (`Cli.start`): `.pid`, then `.wait()`."""

    def __init__(self, cli: Cli, argv: list[str], tmp: Path, pid: int, popen: subprocess.Popen | None,
                 out: Path, err: Path) -> None:
        self.cli, self.argv, self.tmp, self.pid, self.popen, self.out, self.err = cli, argv, tmp, pid, popen, out, err

    def wait(self, timeout: float = 240) -> Run:
        if self.popen is not None:
            try:
                code = self.popen.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                self.popen.kill()
                code, timed_out = self.popen.wait(), True
        else:
            reply = self.cli.zygote.ask(op="wait", pid=self.pid, timeout=timeout)
            code, timed_out = reply["status"], reply["timed_out"]
        return Run(self.argv, code, self.out.read_text(errors="replace"), self.err.read_text(errors="replace"),
                   self.pid, timed_out)


class Cli:
    def __init__(self) -> None:
        self._zygote: Zygote | None = None
        self.count = 0

    @property
    def zygote(self) -> Zygote:
        if self._zygote is None:
            self._zygote = Zygote()
        return self._zygote

    def start(self, argv: list[str], tmp: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None,
              fsize: int | None = None, as_extra: int | None = None, mode: str = "fork") -> Launched:
        argv = [str(a) for a in argv]
        self.count += 1
        logs = tmp / ".logs"
        logs.mkdir(exist_ok=True)
        out, err = logs / f"{self.count}.out", logs / f"{self.count}.err"
        env = env if env is not None else base_env(tmp)
        (tmp / "home").mkdir(exist_ok=True)
        cwd = cwd or tmp
        if mode == "exec" or os.environ.get("K3EXPORT_CORPUS_EXEC"):
            def limits() -> None:
                if as_extra:
                    resource.setrlimit(resource.RLIMIT_AS, (as_extra + (4 << 30), as_extra + (4 << 30)))
                if fsize is not None:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

            with open(out, "wb") as o, open(err, "wb") as e:
                popen = subprocess.Popen([sys.executable, "-m", "k3export_cli.main", *argv], stdout=o, stderr=e,
                                         stdin=subprocess.DEVNULL, env=env, cwd=cwd, preexec_fn=limits)
            return Launched(self, argv, tmp, popen.pid, popen, out, err)
        reply = self.zygote.ask(op="spawn", argv=argv, env=env, cwd=str(cwd), stdout=str(out), stderr=str(err),
                                fsize=fsize, as_extra=as_extra)
        return Launched(self, argv, tmp, reply["pid"], None, out, err)

    def __call__(self, argv: list[str], tmp: Path, timeout: float = 240, **kw) -> Run:
        return self.start(argv, tmp, **kw).wait(timeout)

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()


# ---------------------------------------------------------------------------------------------- what a run leaves
def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (links not followed): relative path -> (kind, content hash / link target / mode)."""
    out: dict[str, tuple] = {}
    if not os.path.lexists(root):
        return out
    if root.is_symlink() or not root.is_dir():
        return {".": _entry(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = _entry(p)
    return out


def _entry(p: Path) -> tuple:
    st = os.lstat(p)
    if p.is_symlink():
        return ("link", os.readlink(p))
    if p.is_dir():
        return ("dir", st.st_mode & 0o7777)
    if p.is_file():
        return ("file", st.st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return ("special", st.st_mode)


def files_under(root: Path) -> list[Path]:
    found = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                found.append(p)
    return found


@dataclass
class Ctx:
    """One corpus case's folder: `src` (a copy of a fixture), `outside` (files the case must never touch), `out`."""

    tmp: Path
    src: Path | None = None
    out: Path | None = None
    export: Path | None = None  # a copy of the `exported` (or, source="pipeline", `pipelined`) fixture
    protected: list[Path] = field(default_factory=list)
    secrets_ok: list[Path] = field(default_factory=list)  # files that hold the planted secret on purpose
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the command
    fixture: Any = None  # name -> another session fixture's path (pytest's request.getfixturevalue)

    def protect(self, *paths: Path) -> None:
        self.protected.extend(paths)


def check_refusal(run: Run, expect: tuple[str, ...] = ()) -> str:
    """Exit 2 and exactly one ``error:`` line on stderr (after any one-line warnings), naming what `expect` lists;
    returns the line."""
    assert run.code == 2, str(run)
    assert not run.timed_out, str(run)
    assert "Traceback" not in run.stderr + run.stdout, str(run)
    lines = [line for line in run.lines if not line.startswith("warning: ")]  # earlier notes, one line each
    assert len(lines) == 1 and lines[0] == run.lines[-1], f"expected one error line on stderr:\n{run}"
    line = lines[0]
    assert line.startswith("error: "), str(run)
    for word in expect:
        assert word in line, f"{word!r} not in the error line:\n{run}"
    return line


def check_no_secret(run: Run, *roots: Path, allowed: list[Path] = ()) -> None:
    assert SECRET not in run.stdout and SECRET not in run.stderr, str(run)
    allowed_real = {os.path.realpath(p) for p in allowed}
    for root in roots:
        for p in files_under(root):
            if os.path.realpath(p) in allowed_real:
                continue
            assert SECRET.encode() not in p.read_bytes(), f"the planted token was written to {p}"


def check_nothing_complete(out: Path, before: dict[str, tuple] | None, siblings_before: set[str]) -> None:
    """`out` is as it was (absent, or unchanged); new entries beside it are only hidden lock files or folders
    marked partial by k3export."""
    from k3export.safety import read_marker

    after = snapshot(out)
    assert after == (before or {}), f"{out} changed although the command failed"
    if not out.parent.is_dir():
        return
    for name in sorted(set(os.listdir(out.parent)) - siblings_before):
        p = out.parent / name
        assert name.startswith("."), f"{p} was left behind, visible"
        if name.endswith(".lock"):
            continue
        marker = read_marker(p) if p.is_dir() and not p.is_symlink() else None
        assert marker is not None and marker["state"] == "partial", f"{p} was left behind without a partial marker"
        for looks_done in ("conversion.json", "model.safetensors.index.json", "config.json", "model.onnx"):
            assert not (p / looks_done).exists(), f"{p / looks_done} was left behind"


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst
