# Copyright 2026 the k3export authors. Apache-2.0.
"""The Ray pipeline runner: one actor per stage, placed with a placement group; each stage's state stays on its
actor; every call is pipelined by micro-batches. Needs ``pip install 'k3export[ray]'``.

    runner = RayPipelineRunner("out/", address="auto")      # a running cluster; default: this one or a local one
    result = greedy_decode(runner, ids, steps=8, attention_mask=mask)

Placement: one bundle per stage in one placement group (``PACK``): ``{"GPU": 1, "CPU": 1}`` when the cluster has a
GPU per stage (or ``gpus=True``), else ``{"CPU": c}`` with c = min(1, cluster CPUs / stages), so a laptop runs
every stage as a CPU actor. Each actor opens its stage export (`load_export`, every file checked) and a session
(`runner.make_session`) and runs `run_stage`. ``runtime``: ``ort`` (default on CPU actors), ``trt`` (each stage's
engine; the default on GPU actors when every stage folder holds one) or ``ort-cuda`` (else, on GPU actors).

State: the state returned by `forward` is a `RemoteState`, a mapping of the full model's state names to
`RemoteTensor` proxies whose shape and dtype are known here and whose values stay on the actors (``np.asarray``
fetches one stage's state once). Fed back to the same runner, nothing crosses the wire but the boundary tensors;
any other state mapping (a loaded ``.k3state``, a fork) is shipped to the actors first. An actor keeps each state
version for as long as a `RemoteState` of it lives in this process (released when it is garbage-collected), so a
kept prefix, an earlier chat turn or a verify round's start can be resumed any number of calls later; a shipped
state is released when its call ends. The runner names what it runs like the in-process one
(`runner.pipeline_identity`), so its states are saved, loaded and forked like any runner's.

Pipelining: a call's rows are cut into micro-batches (default: as many as stages, at most the batch). Every
micro-batch is submitted through every stage at once; Ray runs an actor's calls in order and passes each
stage's output to the next actor as an object reference, so stage s works on micro-batch m while stage s+1 works
on micro-batch m-1.

Images (an image + text pipeline: stage 0 holds ``vision.onnx`` and ``embedding.onnx``): ``forward(..., images=)``
at the prefill, as the in-process runner; stage 0's actor runs the image graphs beside its embedding and keeps the
call's ``inputs_embeds`` for its micro-batches, so only token ids and the packed patches cross the wire.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from k3export.artifacts import StateManifest
from k3export.dtypes import dtype as as_dtype
from k3export.modeling.contract import INPUT_IDS, INPUTS_EMBEDS, LOGITS
from k3export.runtime.base import Runner, RuntimeUnavailable, StepOutput, Tensor

from .export import Pipeline
from .plan import PipelineError
from .ray_cluster import check_ray_address
from .runner import as_pipeline, full_manifest, image_graphs, make_session, pipeline_identity, run_stage


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeUnavailable(f"the Ray runner needs ray: pip install 'k3export[ray]' ({exc})") from None
    return ray


def _cat(parts: list[Any]) -> Any:
    if hasattr(parts[0], "detach"):
        import torch

        return torch.cat(parts, dim=0)
    return np.concatenate(parts, axis=0)


def _host(x: Any) -> Any:
    """A value to hand to another actor: torch tensors leave the GPU (the next session moves them back)."""
    return x.detach().cpu() if hasattr(x, "detach") else x


def _local(x: Any) -> Any:
    """A value to ship to an actor: another runner's `RemoteTensor` fetched here first."""
    return np.asarray(x) if isinstance(x, RemoteTensor) else x


def _default_runtime(pipeline: Pipeline, gpus: bool) -> str:
    """CPU actors: ONNX Runtime; GPU actors: each stage's TensorRT engine when every stage has one, else ONNX
    Runtime's CUDA provider."""
    if not gpus:
        return "ort"
    engines = all(any(e.root.glob("*.engine")) or any(e.root.glob("*.plan")) for e in pipeline.stages)
    return "trt" if engines else "ort-cuda"


class StageActor:
    """The body of one stage's actor: its export, its session and its state versions."""

    def __init__(self, stage_dir: str, runtime: str, threads: int | None) -> None:
        from k3export.artifacts import load_export

        self.export = load_export(stage_dir)
        self.session = make_session(self.export, runtime, threads)
        self.states: dict[int, dict[str, Any]] = {}
        self.parts: dict[int, dict[int, dict[str, Any]]] = {}
        #: stage 0 of an image + text pipeline: its image graphs, and each call's inputs_embeds by output version
        self.images = image_graphs(self.export, runtime, threads) if self.export.has_vision else None
        self.embeds: dict[int, Any] = {}

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node": ctx.get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()],
                "layers": list(self.export.manifest.layers)}

    def zeros(self, version: int, batch: int) -> None:
        self.states[version] = self.export.manifest.initial_state(batch)

    def put(self, version: int, state: dict[str, Any]) -> None:
        self.states[version] = state

    def get(self, version: int) -> dict[str, Any]:
        return {k: _host(v) for k, v in self._state(version).items()}

    def release(self, version: int) -> None:
        self.states.pop(version, None)

    def _state(self, version: int) -> dict[str, Any]:
        if version not in self.states:
            raise PipelineError(f"stage {list(self.export.manifest.layers)}: state version {version} is no longer "
                                f"held (kept: {sorted(self.states)})")
        return self.states[version]

    def embed(self, v_out: int, input_ids: Any, images: Any = None) -> None:
        """Stage 0's ``inputs_embeds`` of call `v_out` (all its rows; `images` at the prefill), kept for its `run`
        parts: the image graphs run beside the stage that holds the embedding."""
        self.embeds[v_out] = self._image_graphs().embed(input_ids, images)

    def vision_stages(self, images: Any, expose: Any) -> dict[str, Any]:
        return self._image_graphs().stages(images, expose)

    def _image_graphs(self) -> Any:
        if self.images is None:
            raise PipelineError(f"stage {list(self.export.manifest.layers)} holds no image graphs")
        return self.images

    def run(self, v_in: int, v_out: int, part: int, parts: int, rows: tuple[int, int], x: dict[str, Any],
            mask: Any, logits_to_keep: int = 0) -> dict[str, Any]:
        a, b = rows
        state = {k: v[a:b] for k, v in self._state(v_in).items()}
        if v_out in self.embeds:
            x = {INPUTS_EMBEDS: self.embeds[v_out][a:b]}
        out, new = run_stage(self.export.manifest, self.session, x, mask, state, logits_to_keep)
        done = self.parts.setdefault(v_out, {})
        done[part] = new
        if len(done) == parts:
            del self.parts[v_out]
            self.embeds.pop(v_out, None)
            self.states[v_out] = {k: _cat([done[p][k] for p in range(parts)]) for k in new}
        return {k: _host(v) for k, v in out.items()}

    def drop(self) -> None:
        self.states.clear()
        self.parts.clear()


class RemoteTensor:
    """A state tensor held by a stage actor: shape and dtype here, values fetched by ``np.asarray``."""

    def __init__(self, owner: RemoteState, stage: int, name: str, shape: tuple[int, ...], dtype: str) -> None:
        self._owner, self._stage, self._name = owner, stage, name
        self.shape, self.dtype = shape, np.dtype(as_dtype(dtype).numpy)
        self.ndim = len(shape)

    def fetch(self) -> Any:
        return self._owner.fetch(self._stage)[self._name]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        from k3export.runtime.base import to_numpy

        value = self.fetch()
        arr = to_numpy(value, value.dtype if isinstance(value, np.ndarray) else np.float32)
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"RemoteTensor({self._name}, shape={list(self.shape)}, stage {self._stage})"


class RemoteState(Mapping):
    """The full model's state after a call of a `RayPipelineRunner`: each name's tensor stays on its actor."""

    def __init__(self, runner: RayPipelineRunner, version: int, batch: int, past: int) -> None:
        self.runner, self.version, self.batch, self.past = runner, version, batch, past
        # the actors hold this version while this proxy lives (not at exit: Ray may be gone by then)
        weakref.finalize(self, runner._release, version).atexit = False
        self._cache: dict[int, dict[str, Any]] = {}
        self._items: dict[str, RemoteTensor] = {}
        for i, export in enumerate(runner.pipeline.stages):
            for s in export.manifest.states:
                self._items[s.name] = RemoteTensor(self, i, s.name, s.concrete_shape(batch, past), s.dtype)

    def fetch(self, stage: int) -> dict[str, Any]:
        if stage not in self._cache:
            self._cache[stage] = self.runner._get(self.runner.actors[stage].get.remote(self.version))
        return self._cache[stage]

    def __getitem__(self, name: str) -> RemoteTensor:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class RayPipelineRunner(Runner):
    """A pipeline export run by one Ray actor per stage (see the module docstring)."""

    name = "ray"

    def __init__(self, pipeline: Pipeline | str | os.PathLike[str], *, address: str | None = None,
                 runtime: str | None = None, gpus: bool | None = None, cpus_per_stage: float | None = None,
                 micro_batches: int | None = None, threads: int | None = 1, name: str | None = None,
                 timeout_s: float = 120.0) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.pipeline = as_pipeline(pipeline)  # every stage checked here before any actor starts
        self.manifest: StateManifest = full_manifest(self.pipeline)
        self.config = self.pipeline.config
        self.micro_batches = micro_batches
        if name:
            self.name = name
        if not ray.is_initialized():
            check_ray_address(address, option="address")
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        n = len(self.pipeline.stages)
        resources = ray.cluster_resources()
        self.gpus = resources.get("GPU", 0) >= n if gpus is None else gpus
        self.runtime = runtime or _default_runtime(self.pipeline, self.gpus)
        if self.gpus:
            bundles = [{"GPU": 1.0, "CPU": 1.0}] * n
        else:
            cpus = cpus_per_stage or min(1.0, math.floor(100 * resources.get("CPU", 1) / n) / 100)
            bundles = [{"CPU": cpus}] * n
        self._remove = remove_placement_group
        self.placement = placement_group(bundles, strategy="PACK", name=f"k3export-pipeline-{os.getpid()}")
        ready, _ = ray.wait([self.placement.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.placement)
            raise PipelineError(f"the Ray cluster cannot place {n} stage actors of {bundles[0]} within {timeout_s:.0f}"
                                f" s (it has {dict(resources)})")
        actor = ray.remote(StageActor)
        self.actors = [actor.options(num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_concurrency=1,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, i))
                       .remote(str(e.root), self.runtime, threads)
                       for i, (b, e) in enumerate(zip(bundles, self.pipeline.stages))]
        try:
            self.placement_info = self._get([a.where.remote() for a in self.actors])
        except BaseException:
            self.close()
            raise
        self._version = 0

    # ------------------------------------------------------------------ plumbing
    def _get(self, refs: Any) -> Any:
        """`ray.get`, with an actor's own error re-raised as itself (one line), not as a Ray traceback."""
        ray = _ray()
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise PipelineError(str(exc).strip().splitlines()[-1]) from None
        except ray.exceptions.RayActorError as exc:
            raise PipelineError(f"a stage actor died ({type(exc).__name__}); its state is lost: start a new "
                                "runner") from None

    def _next(self) -> int:
        self._version += 1
        return self._version

    def _own(self, state: Any) -> RemoteState | None:
        return state if isinstance(state, RemoteState) and state.runner is self else None

    def _release(self, version: int) -> None:
        """The actors may drop state `version` (no proxy of it is left; fire and forget)."""
        for a in getattr(self, "actors", []):
            a.release.remote(version)

    def identity(self) -> str:
        return pipeline_identity(self.pipeline)

    # ------------------------------------------------------------------ the interface
    def initial_state(self, batch: int) -> RemoteState:
        v = self._next()
        self._get([a.zeros.remote(v, batch) for a in self.actors])
        return RemoteState(self, v, batch, 0)

    @property
    def takes_images(self) -> bool:
        """Whether `forward` takes ``images`` (stage 0 holds the image graphs; its actor runs them)."""
        return self.pipeline.has_vision

    def vision_stages(self, images: Any, expose: Any) -> dict[str, np.ndarray]:
        """Every vision stage's output of stage 0's ``vision.onnx`` on one prompt's images, run by its actor."""
        if not self.takes_images:
            raise PipelineError(f"{self.pipeline.root}: a text-only pipeline has no vision stages")
        return self._get(self.actors[0].vision_stages.remote(images, expose))

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray,
                images: Any = None) -> StepOutput:
        ray = _ray()
        if images is not None and not self.takes_images:
            raise PipelineError(f"{self.pipeline.root}: a text-only pipeline cannot take images")
        B, T = input_ids.shape
        own = self._own(state)
        if own is not None:
            v_in, past = own.version, own.past
        else:  # a state from elsewhere: ship each stage its part, held for this call only
            v_in, past = self._next(), self.manifest.past_length(state)
            self._get([a.put.remote(v_in, {s.name: _local(state[s.name]) for s in e.manifest.states})
                       for a, e in zip(self.actors, self.pipeline.stages)])
        v_out = self._next()
        if self.takes_images:  # waited for: a refused prompt (placeholders against images) fails before any stage
            self._get(self.actors[0].embed.remote(v_out, input_ids, images))
        n = max(1, min(B, self.micro_batches or len(self.actors)))
        cuts = [round(B * k / n) for k in range(n + 1)]
        results = []
        for p, (a, b) in enumerate(zip(cuts, cuts[1:])):
            x: Any = {INPUT_IDS: input_ids[a:b]}
            mask = ray.put(np.ascontiguousarray(attention_mask[a:b]))
            for actor in self.actors:
                x = actor.run.remote(v_in, v_out, p, n, (a, b), x, mask, self.logits_to_keep)
            results.append(x)
        try:
            outs = self._get(results)
        finally:
            if own is None:
                self._release(v_in)
        logits = _cat([o[LOGITS] for o in outs])
        return StepOutput(logits=logits, state=RemoteState(self, v_out, B, past + T))

    def describe(self) -> str:
        where = "GPU" if self.gpus else "CPU"
        nodes = len({p["node"] for p in self.placement_info})
        return (f"{self.name} ({len(self.actors)} Ray actors on {nodes} node(s), {where}, {self.runtime}, "
                f"{self.pipeline.root.name})")

    def close(self) -> None:
        ray = _ray()
        for a in getattr(self, "actors", []):
            ray.kill(a)
        self.actors = []
        if getattr(self, "placement", None) is not None:
            self._remove(self.placement)
            self.placement = None


def ray_factory(target: Any) -> Runner:
    """``--runtimes ...,ray``: one Ray actor per stage (``RAY_ADDRESS``, else this process's or a local cluster)."""
    path = getattr(target, "pipeline_dir", None) or target.need("onnx_dir", "ray", "--onnx PIPELINE_DIR")
    return RayPipelineRunner(path, address=os.environ.get("RAY_ADDRESS"))


__all__ = ["RayPipelineRunner", "RemoteState", "RemoteTensor", "StageActor", "ray_factory"]
