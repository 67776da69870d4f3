"""Runtime ``ort-webgpu``: an export run by ONNX Runtime's WebGPU execution provider (WGSL compute shaders that Dawn
hands to Vulkan), the CPU EP taking the nodes it has no kernel for.

``onnxruntime-webgpu`` installs the same ``onnxruntime`` module as the main environment's build, so it lives in a
second environment and the session runs in a worker process started with that environment's Python
(`webgpu_worker`, which imports numpy and onnxruntime only): `WorkerSession` speaks to it through a pipe and stands
for an ``InferenceSession`` behind `session.SessionRunner`. The Python is the ``python`` argument or, for the CLI,
the environment variable `PYTHON_ENV` (``.ci/webgpu-env`` makes such an environment).

A Vulkan device is needed: a GPU's driver, or Mesa's lavapipe (a Vulkan device on the CPU; Dawn takes Mesa 23 and
newer). The runner records the adapter (vendor, device, driver, backend) and, from ONNX Runtime's profile of its
first call, the nodes each EP ran (`Placement`); `describe` says both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3export import switches
from k3export.artifacts import ArtifactError, load_export
from k3export.dtypes import dtype as as_dtype
from k3export.errors import K3ExportError

from .base import RuntimeUnavailable, to_numpy
from .session import SessionRunner
from .webgpu_worker import WEBGPU, read_message, write_message

#: the environment variable naming the Python that has onnxruntime-webgpu (the CLI's way to give it)
PYTHON_ENV = "K3EXPORT_WEBGPU_PYTHON"
CPU = "CPUExecutionProvider"
#: the WebGPU EP first, the CPU EP for the nodes it does not take
WEBGPU_PROVIDERS = [WEBGPU, CPU]
WORKER = Path(__file__).with_name("webgpu_worker.py")
NO_ADAPTER = ("no WebGPU adapter: ONNX Runtime's WebGPU EP runs on Vulkan here, and no usable Vulkan device was "
              "found (install a GPU's Vulkan driver, or Mesa's lavapipe 23 or newer, a Vulkan device on the CPU: "
              "mesa-vulkan-drivers from bookworm-backports on Debian 12; .ci/webgpu-env installs it)")


def webgpu_python(python: str | os.PathLike[str] | None = None) -> str:
    """The Python the worker runs with: `python`, else `PYTHON_ENV`'s; `RuntimeUnavailable` without one."""
    chosen = python if python is not None else switches.choice(PYTHON_ENV)
    if not chosen:
        raise RuntimeUnavailable(f"runtime ort-webgpu runs in a Python environment with onnxruntime-webgpu: set "
                                 f"{PYTHON_ENV} to its python (.ci/webgpu-env makes one)")
    if not os.access(chosen, os.X_OK) or Path(chosen).is_dir():
        raise RuntimeUnavailable(f"runtime ort-webgpu: {chosen} is not an executable Python")
    return str(chosen)


@dataclass
class Placement:
    """The nodes each execution provider ran in one call (a node in a Loop body once), by op type, and the copies
    between host and device ONNX Runtime inserted."""

    providers: dict[str, dict[str, int]] = field(default_factory=dict)  # provider -> {op type: nodes}
    copies: int = 0

    def nodes(self, provider: str) -> int:
        return sum(self.providers.get(provider, {}).values())

    @property
    def total(self) -> int:
        return sum(self.nodes(p) for p in self.providers)

    @property
    def webgpu_share(self) -> float:
        """The share of the nodes that ran as WebGPU shaders (the copies not counted)."""
        return self.nodes(WEBGPU) / self.total if self.total else 0.0

    def summary(self, ops: int = 6) -> str:
        """One line: the WebGPU share, and the op types the CPU EP ran most."""
        cpu = ", ".join(f"{op} {n}" for op, n in list(self.providers.get(CPU, {}).items())[:ops])
        return (f"WebGPU EP ran {self.nodes(WEBGPU)} of {self.total} nodes ({100 * self.webgpu_share:.0f}%), "
                f"CPU EP {self.nodes(CPU)}{f' ({cpu}, ...)' if cpu else ''}, {self.copies} host/device copies")


class WorkerSession:
    """An ONNX Runtime session of `model_path` in a worker process run by `python` (`webgpu_python`), on
    `providers` (default `WEBGPU_PROVIDERS`), with `options` set on its ``SessionOptions``: the session interface of
    `session.SessionRunner` (feeds cast to the graph's input dtypes, outputs as numpy). `RuntimeUnavailable` when
    the worker cannot open it: no adapter (`NO_ADAPTER`), no onnxruntime-webgpu, a graph that onnxruntime cannot
    load (e.g. an opset newer than it knows)."""

    def __init__(self, model_path: str | os.PathLike[str], *, python: str | os.PathLike[str] | None = None,
                 providers: list[str] | None = None, options: dict[str, Any] | None = None) -> None:
        self.path = Path(model_path)
        exe = webgpu_python(python)
        env = dict(os.environ)
        runtime_dir = None
        if not env.get("XDG_RUNTIME_DIR"):  # Dawn's Vulkan backend wants one (a private folder, as a login gives)
            runtime_dir = env["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="k3export-xdg-")
        # lavapipe compiles each shader with LLVM on the CPU, the first call on each new shape seconds of it: without
        # LLVM's optimisation passes a cold first call takes about half as long (no other driver reads it)
        env.setdefault("GALLIVM_PERF", "nopt")
        self._log = tempfile.TemporaryFile()  # the worker's stderr: ONNX Runtime's and Dawn's messages
        # -I: the second environment's own packages only (no PYTHONPATH, no user site, not this folder)
        self._proc = subprocess.Popen([exe, "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, env=env)
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._log, runtime_dir)
        self.placement: Placement | None = None  # after the first call
        providers = list(providers or WEBGPU_PROVIDERS)
        reply, _ = self._call({"op": "open", "path": str(self.path), "providers": providers,
                               "options": dict(options or {})})
        if "error" in reply:
            self.close()
            if reply["kind"] == "no_adapter":
                raise RuntimeUnavailable(f"ort-webgpu: {NO_ADAPTER} ({reply['error']})")
            hint = ("; export it at an opset this onnxruntime knows (export --opset 23 for onnxruntime-webgpu 1.27: "
                    "it loads up to 26, its WebGPU kernels of Transpose, Pad, Cast and Shape stop at opset 23)"
                    if "opset" in reply["error"].lower() or "domain_version" in reply["error"] else "")
            raise RuntimeUnavailable(f"ort-webgpu: {self.path}: {reply['error']}{hint}")
        #: onnxruntime's version in the worker, the providers the session has, and the adapter (vendor, device,
        #: type, driver, backend; None on the CPU EP alone)
        self.version: str = reply["version"]
        self.providers: list[str] = reply["providers"]
        self.adapter: dict[str, str] | None = reply["adapter"]
        self._types = {n: as_dtype(t).numpy for n, t in reply["inputs"] + reply["optional"]}
        self.input_names = [n for n, _ in reply["inputs"]]
        self.optional_inputs = [n for n, _ in reply["optional"]]  # inputs with a default (``logits_to_keep``)
        self.output_names = [n for n, _ in reply["outputs"]]

    def _call(self, header: dict[str, Any], arrays: list[np.ndarray] = ()  # type: ignore[assignment]
              ) -> tuple[dict[str, Any], list[np.ndarray]]:
        if self._proc.poll() is None:
            try:
                write_message(self._proc.stdin, header, arrays)  # type: ignore[arg-type]
                got = read_message(self._proc.stdout)  # type: ignore[arg-type]
            except (BrokenPipeError, EOFError, ValueError):  # a dead worker, or a reply cut short
                got = None
            if got is not None:
                return got
            self._proc.kill()
        self._proc.wait()
        self._log.seek(0)
        tail = [line for line in self._log.read().decode(errors="replace").splitlines() if line.strip()][-1:]
        raise RuntimeUnavailable(f"ort-webgpu: the worker ({self._proc.args[0]}) exited with status "
                                 f"{self._proc.returncode}{': ' + tail[0].strip() if tail else ''}")

    def _cast(self, name: str, value: Any) -> np.ndarray:
        if name not in self._types:
            raise ArtifactError(f"{self.path}: the graph has no input {name!r}")
        arr = to_numpy(value, np.float32) if hasattr(value, "detach") else np.asarray(value)
        return np.require(arr.astype(self._types[name], copy=False), requirements="C")  # keeps a scalar 0-d

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        names = list(feeds)
        reply, outs = self._call({"op": "run", "arrays": names}, [self._cast(n, feeds[n]) for n in names])
        if "error" in reply:
            raise K3ExportError(f"ort-webgpu: {self.path}: {reply['error']}")
        if "placement" in reply:
            self.placement = Placement(reply["placement"]["providers"], reply["placement"]["copies"])
        return dict(zip(reply["arrays"], outs))

    def close(self) -> None:
        """End the worker (also when the session is collected)."""
        self._finalizer()


def _stop(proc: subprocess.Popen, log: Any, runtime_dir: str | None) -> None:
    if proc.poll() is None:
        try:
            proc.stdin.close()  # type: ignore[union-attr]  # the worker ends at its input's end
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]
    log.close()
    if runtime_dir is not None:
        shutil.rmtree(runtime_dir, ignore_errors=True)


class OrtWebGpuRunner(SessionRunner):
    """An export folder under ONNX Runtime's WebGPU EP (`WorkerSession`), the CPU EP taking what it has no kernel
    for; text-only exports of the functions form with dense routed experts (`artifacts.graph_forms.READERS`). `python`:
    the Python with onnxruntime-webgpu (default: `PYTHON_ENV`)."""

    name = "ort-webgpu"
    #: fp16: the WebGPU EP's fp16 run of the tiny export differs from the PyTorch reference ~3x as much as ONNX
    #: Runtime's CPU EP's (state scenarios: rms_rel up to 1.4e-2 against 4.9e-3..6.7e-3; its shaders compute in
    #: f16 where the CPU kernels widen); bf16's defaults, ~2x over the worst seen, still fail a wrong sign at once
    tolerances = {"float16": {"rms_rel": 3e-2, "max_abs_rel": 1e-1, "atol": 1e-4}}

    def __init__(self, export_dir: str | os.PathLike[str], *, python: str | os.PathLike[str] | None = None,
                 providers: list[str] | None = None, name: str | None = None) -> None:
        from k3export.artifacts.graph_forms import check_export

        export = load_export(export_dir)
        export.require_weights()
        check_export(name or self.name, export)
        if export.has_vision:
            raise RuntimeUnavailable(f"{export.root}: runtime ort-webgpu runs text-only exports (no image graphs)")
        #: the graph file the session runs
        self.graph_path = export.model_path
        self.ort = WorkerSession(self.graph_path, python=python, providers=providers,
                                 options=export.runtime.session_options)
        super().__init__(export, self.ort, name=name, where=str(self.graph_path))

    @property
    def placement(self) -> Placement | None:
        """The nodes each EP ran in the first call (None before it)."""
        return self.ort.placement

    def describe(self) -> str:
        a = self.ort.adapter
        on = f" on {a['vendor']} {a['device']} ({a['type']}; {a['driver']}; {a['backend']})" if a else ""
        where = self.placement.summary() if self.placement else "placement known after the first call"
        return f"{self.name} (onnxruntime {self.ort.version} {', '.join(self.ort.providers)}{on}; {where}; " \
               f"{self.graph_path.name})"

    def close(self) -> None:
        self.ort.close()


__all__ = ["NO_ADAPTER", "PYTHON_ENV", "WEBGPU_PROVIDERS", "OrtWebGpuRunner", "Placement", "WorkerSession",
           "webgpu_python"]
