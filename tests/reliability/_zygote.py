"""A pre-imported `k3export` CLI that forks one real process per command (the corpus's fast subprocess).

Importing torch and transformers takes seconds; the corpus runs about a hundred commands. This process imports
them once, then for every request forks a child that sets its own environment, working folder, stdio and
resource limits (RLIMIT_FSIZE, RLIMIT_AS above what is already mapped) and runs ``k3export_cli.main.main()``
exactly as the console script does. The child is a real process: its exit status, its stderr, a kill -9 and the
limits behave as for ``python -m k3export_cli.main``.

Protocol, one JSON object per line on stdin / stdout:
    {"op": "spawn", "argv": [...], "env": {...}, "cwd": str, "stdout": path, "stderr": path,
     "fsize": int | null, "as_extra": int | null}                       -> {"pid": int}
    {"op": "wait", "pid": int, "timeout": float}                          -> {"status": int, "timed_out": bool}
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback


def _preload() -> None:
    import k3export_cli.main  # noqa: F401 - registers every command

    for name in ("torch", "safetensors", "transformers", "k3export.modeling", "k3export.converters.checkpoints",
                 "k3export.converters.onnx", "k3export.checkpoint_io", "onnx", "onnxruntime"):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module mid-refactor is simply imported by the child instead
            pass


def _vm_size() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(req: dict) -> None:
    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # as the interpreter starts every process: a write to a closed pipe raises BrokenPipeError, never kills
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            new = os.open(path, flags, 0o644)
            os.dup2(new, fd)
            os.close(new)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("as_extra"):
            limit = _vm_size() + int(req["as_extra"])
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        if req.get("fsize") is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(req["fsize"]), int(req["fsize"])))
        sys.argv = ["k3export", *req["argv"]]
        from k3export_cli.main import main

        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter would: traceback, status 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"status": os.waitstatus_to_exitcode(status), "timed_out": False}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return {"status": os.waitstatus_to_exitcode(status), "timed_out": True}
        time.sleep(0.01)


def serve() -> None:
    _preload()
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "spawn":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req)
            reply = {"pid": pid}
        elif req["op"] == "wait":
            reply = _wait(req["pid"], req["timeout"])
        else:
            reply = {"error": f"unknown op {req['op']!r}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
