# Copyright 2026 the k3export authors. Apache-2.0.
"""``convert --ray``: the conversion's units of work as Ray tasks across a cluster. Needs ``k3export[ray]``.

`convert` cuts a conversion into units, one per source shard (`convert_unit`: read that shard once, write the
output shards the plan gives it, hash everything); a unit is a pure function of (source shard, plan), so any
machine that sees the source and output folders at the same paths (shared storage) can run it and write the same
bytes. `RayExecutor` is a `concurrent.futures.Executor` whose ``submit`` runs the call as a Ray task, so `convert`
drives a cluster exactly as it drives its local process pool: the same plan, resume records, output folder lock
and markers, the same finalisation, and one progress bar (the driver's) advanced as units finish anywhere on the
cluster. A task whose worker dies is retried by Ray (``max_retries``); once retries are spent the conversion stops
with `ConversionInterrupted`, keeping every finished shard, and the same command resumes it.

    convert_ray("Kimi-K3/", "/shared/k3-bf16", address="auto")          # a running cluster
    convert(src, out, executor=RayExecutor())                            # the same, spelled out
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable

from k3export.errors import K3ExportError

from .convert import ConversionInterrupted, convert


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise K3ExportError(f"convert --ray needs ray: pip install 'k3export[ray]' ({exc})") from None
    return ray


def run_unit(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             kill_after_shards: int | None = None) -> Any:
    """Body of a Ray task: one unit of work, torch on one thread (the unit's own threads use the cores).

    ``kill_after_shards`` (fault injection for tests) SIGKILLs this worker once that many output shards are in
    place, as a machine that dies mid-unit would."""
    import torch

    torch.set_num_threads(1)
    if kill_after_shards is not None:
        written = [0]

        def on_shard(record: dict[str, Any]) -> None:
            written[0] += 1
            if written[0] >= kill_after_shards:
                os.kill(os.getpid(), signal.SIGKILL)

        kwargs = dict(kwargs, on_shard=on_shard)
    return fn(*args, **kwargs)


class _RayFuture(cf.Future):
    """The future of one Ray task; `cancel` stops its worker (a running unit too) and waits until it is gone, so
    no unit writes into the output after the conversion stopped."""

    def __init__(self, ray: Any, ref: Any) -> None:
        super().__init__()
        self._ray, self._ref = ray, ref

    def cancel(self) -> bool:
        if self.done():
            return False
        try:
            self._ray.cancel(self._ref, force=True)
            self._ray.wait([self._ref], timeout=60)
        except Exception:  # noqa: BLE001 - already finished or gone
            pass
        return super().cancel()


class RayExecutor(cf.Executor):
    """A `concurrent.futures.Executor` backed by Ray tasks (see the module docstring).

    ``address``: a cluster (``"auto"``, ``"HOST:PORT"``, ``"ray://HOST:10001"``); None joins the Ray instance this
    process already started, else starts a local one (``RAY_ADDRESS`` is honoured by Ray itself).
    ``cpus_per_task``: CPUs each unit reserves. ``max_retries``: re-runs of a unit whose worker died."""

    def __init__(self, address: str | None = None, *, cpus_per_task: float = 1.0, max_retries: int = 3,
                 kill_after_shards: int | None = None) -> None:
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self._ray = ray
        self._task = ray.remote(run_unit).options(num_cpus=cpus_per_task, max_retries=max_retries,
                                                  retry_exceptions=False)
        self._kill_after = kill_after_shards
        self._futures: list[_RayFuture] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a RayExecutor after shutdown")
            ref = self._task.remote(fn, args, kwargs, self._kill_after)
            out = _RayFuture(self._ray, ref)
            self._futures.append(out)

        def done(f: cf.Future) -> None:
            try:
                if f.cancelled():
                    out.cancel()
                elif f.exception() is None:
                    out.set_result(f.result())
                else:
                    out.set_exception(self._translate(f.exception()))
            except cf.InvalidStateError:
                pass  # cancelled meanwhile

        ref.future().add_done_callback(done)
        return out

    def _translate(self, exc: BaseException) -> BaseException:
        """Worker and node deaths -> `ConversionInterrupted` (resumable); a unit's own error -> that error."""
        ex = self._ray.exceptions
        if isinstance(exc, (ex.WorkerCrashedError, ex.NodeDiedError, ex.LocalRayletDiedError, ex.OwnerDiedError)):
            return ConversionInterrupted(f"a Ray worker died while converting ({type(exc).__name__}); finished "
                                         "shards are kept: re-run the same command to resume")
        if isinstance(exc, ex.RayTaskError):
            cause = getattr(exc, "cause", None)
            if isinstance(cause, BaseException):
                return cause
        return exc

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            futures, self._futures = self._futures, []
        if cancel_futures:
            for f in futures:
                f.cancel()
        elif wait:
            cf.wait(futures)


def has_executor_hook() -> bool:
    """Whether this k3export's `convert` takes ``executor=`` (what ``--ray`` plugs into)."""
    return "executor" in inspect.signature(convert).parameters


def convert_ray(src_dir: str | Path, out_dir: str | Path, *, address: str | None = None, cpus_per_task: float = 1.0,
                max_retries: int = 3, kill_after_shards: int | None = None, **kwargs: Any) -> dict[str, Any]:
    """`convert` with every unit of work a Ray task (see the module docstring); returns conversion.json's data.

    Source and output must be at the same paths on every node (shared storage)."""
    if not has_executor_hook():
        raise K3ExportError("convert --ray needs convert(executor=...) in k3export.converters.checkpoints.convert")
    executor = RayExecutor(address, cpus_per_task=cpus_per_task, max_retries=max_retries,
                           kill_after_shards=kill_after_shards)
    try:
        return convert(src_dir, out_dir, executor=executor, **kwargs)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["RayExecutor", "convert_ray", "has_executor_hook", "run_unit"]
