"""``build_engine``: ONNX export folder -> serialized TensorRT engine with the k3 plugins.

Order of work: everything checkable without TensorRT first (the export folder as `load_export` checks it; the
graph as TensorRT will parse it, `plugin_forms.plugin_model`: an MXFP4 ``k3::moe_experts`` becomes
``k3::moe_experts_mxfp4`` over uint8 views of its bytes; its k3 nodes, their attributes and initializer inputs;
precision vs the manifest's dtype; profiles whose dimension roles come from the manifest's contract dimensions),
then TensorRT: register the k3 plugins, check the GPU supports the precision,
parse (parser errors name node index, name and op), add a prefill and a decode optimisation profile, reuse /
update a timing cache, report progress, build. The engine, its ``.json`` sidecar and the timing cache are
written atomically, never through a link. `k3export.runtime.trt_runner` runs the engine.

AOT plugins are preferred (``NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS``): the engine
embeds the Triton PTX and runs without Python. Networks are strongly typed (always so in
TensorRT 11; opted in on 10.x), so the ONNX graph's dtypes are the engine's precision.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3export.artifacts import EngineNode, EngineProfile, EngineSidecar, StateManifest, load_export, write_bytes_atomic
from k3export.errors import ExportError
from k3export.modeling.contract import BATCH, PAST, SEQ, TOTAL
from k3export.plugins import register_plugins, require_tensorrt

from . import checks
from .plugin_forms import plugin_model

SIDECAR_SUFFIX = EngineSidecar.SUFFIX
#: optimisation-profile role of each contract dimension (a static int dim is "static")
ROLE_OF_DIM = {BATCH: "batch", SEQ: "seq", PAST: "past", TOTAL: "total"}


def dim_roles(manifest: StateManifest) -> dict[str, list[str]]:
    """Per graph input and axis: 'static', 'batch', 'seq' (new tokens), 'past' (carried tokens) or 'total'
    (past + new), read from the manifest's contract dimensions (never guessed from names)."""
    inputs, _ = manifest.graph_io()
    return {name: [ROLE_OF_DIM[d] if isinstance(d, str) else "static" for d in shape]
            for name, (_, shape) in inputs.items()}


def make_profiles(manifest: StateManifest, max_batch: int, max_seq: int, max_context: int) -> list[checks.ProfileSpec]:
    """Two profiles: prefill (1 <= new tokens <= max_seq) and decode (one new token), both with
    0 <= carried tokens <= max_context and 1 <= batch <= max_batch."""
    for flag, v in (("max_batch", max_batch), ("max_seq", max_seq), ("max_context", max_context)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise checks.ProfileError(f"{flag}={v!r}: expected an integer >= 1")
    limits = {"max_batch": max_batch, "max_seq": max_seq, "max_context": max_context}
    half_seq, half_ctx = max(1, max_seq // 2), max(1, max_context // 2)
    ranges = {  # role -> (min, opt, max)
        "prefill": {"batch": (1, max_batch, max_batch), "seq": (1, half_seq, max_seq), "past": (0, 0, max_context),
                    "total": (1, half_seq, max_context + max_seq)},
        "decode": {"batch": (1, max_batch, max_batch), "seq": (1, 1, 1), "past": (0, half_ctx, max_context),
                   "total": (1, half_ctx + 1, max_context + 1)},
    }
    inputs, _ = manifest.graph_io()
    roles = dim_roles(manifest)
    profiles = []
    for pname, rng in ranges.items():
        shapes = {}
        for name, (_, dims) in inputs.items():
            lo, opt, hi = zip(*((d, d, d) if role == "static" else rng[role] for d, role in zip(dims, roles[name])))
            shapes[name] = (tuple(lo), tuple(opt), tuple(hi))
        profiles.append(checks.ProfileSpec(pname, shapes, limits))
    return profiles


def prepare_build(onnx_dir: str | Path, precision: str = "bf16", max_batch: int = 1, max_seq: int = 256,
                  max_context: int = 1024, allow_no_plugins: bool = False) -> dict[str, Any]:
    """All checks that need no TensorRT (the export folder as `load_export` checks it, k3 nodes, precision,
    profiles); returns what the build uses (export, model path, model, profiles, k3 nodes, dtype). The model is the
    graph TensorRT parses: `plugin_model` of the file's (weights not loaded; external data relative to model path)."""
    export = load_export(onnx_dir)
    export.require_weights()
    where = str(export.model_path)
    model = plugin_model(checks.load_onnx(export.model_path), where)
    nodes = checks.inspect_k3_nodes(model, where)
    if not allow_no_plugins:
        checks.require_plugins(nodes, where)
    dtype = checks.check_precision(precision, export.dtype)
    profiles = make_profiles(export.manifest, max_batch, max_seq, max_context)
    return {"export": export, "model_path": export.model_path, "model": model, "k3_nodes": nodes, "dtype": dtype,
            "precision": precision, "profiles": profiles}


def engine_sidecar(plan: dict[str, Any], tensorrt: str, gpu: str, cc: tuple[int, int],
                   prefer_aot: bool, flavour: str = "tensorrt") -> EngineSidecar:
    """What ``<engine>.json`` records of a build (`prepare_build`'s `plan`, then TensorRT's flavour and version and
    the GPU): the source graph, precision, profiles and k3 nodes. `EngineSidecar.same_build` tells an engine built
    the same way."""
    return EngineSidecar(
        onnx=str(plan["model_path"]), precision=plan["precision"], dtype=plan["dtype"], tensorrt_flavour=flavour,
        tensorrt_version=tensorrt, gpu=gpu, compute_capability=(int(cc[0]), int(cc[1])), prefer_aot=prefer_aot,
        profiles=[EngineProfile(p.name, dict(p.limits), {n: tuple(list(s) for s in v) for n, v in p.shapes.items()})
                  for p in plan["profiles"]],
        k3_nodes=[EngineNode(n.index, n.name, n.op) for n in plan["k3_nodes"]])


def _gpu_capability() -> tuple[tuple[int, int], str]:
    try:
        import torch
    except Exception:  # pragma: no cover
        torch = None
    if torch is None or not torch.cuda.is_available():
        raise ExportError("building a TensorRT engine needs an NVIDIA GPU, and none is visible "
                          "(torch.cuda.is_available() is False)")
    return tuple(torch.cuda.get_device_capability()), torch.cuda.get_device_name()


def _network_flags(trt: Any, prefer_aot: bool) -> int:
    F = trt.NetworkDefinitionCreationFlag
    flags = 0
    if hasattr(F, "STRONGLY_TYPED"):
        flags |= 1 << int(F.STRONGLY_TYPED)
    if prefer_aot:
        if not hasattr(F, "PREFER_AOT_PYTHON_PLUGINS"):
            raise ExportError(f"TensorRT {trt.__version__} has no AOT Python plugins (needs >= 10.9); "
                              "upgrade TensorRT or build with prefer_aot=False (JIT plugins need Python at run time)")
        flags |= 1 << int(F.PREFER_AOT_PYTHON_PLUGINS)
    elif hasattr(F, "PREFER_JIT_PYTHON_PLUGINS"):
        flags |= 1 << int(F.PREFER_JIT_PYTHON_PLUGINS)
    return flags


def _progress_monitor(trt: Any, report: Callable[[str], None]) -> Any:
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class _Monitor(base):
        def __init__(self) -> None:
            base.__init__(self)
            self.t0: dict[str, float] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.t0[phase_name] = time.perf_counter()
            indent = "  " if parent_phase else ""
            report(f"{indent}{phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # never cancel

        def phase_finish(self, phase_name):
            dt = time.perf_counter() - self.t0.pop(phase_name, time.perf_counter())
            if dt >= 1.0:
                report(f"  {phase_name} done in {dt:.1f}s")

    return _Monitor()


def build_engine(onnx_dir: str | Path, engine_path: str | Path, precision: str = "bf16", max_batch: int = 1,
                 max_seq: int = 256, max_context: int = 1024, timing_cache: str | Path | None = None,
                 allow_no_plugins: bool = False, prefer_aot: bool = True, workspace_gib: float | None = None,
                 progress: Callable[[str], None] | None = print, verbose: bool = False) -> Path:
    """Build and serialize a TensorRT engine from the ONNX export in `onnx_dir`.

    Profiles: prefill (1 <= T <= max_seq) and decode (T = 1); batch 1..max_batch; cached tokens
    (MLA latent length) 0..max_context. ``timing_cache`` (a file path) is read when it exists and
    written back after the build. Writes the engine and ``<engine>.json`` (profiles, precision, source).
    Raises ExportError (TensorRTUnavailable when TensorRT is missing) with a one-line reason."""
    report = progress or (lambda _msg: None)
    plan = prepare_build(onnx_dir, precision, max_batch, max_seq, max_context, allow_no_plugins)
    trt, _trtp = require_tensorrt()
    ids = register_plugins()
    report(f"TensorRT {trt.__version__}; k3 plugins registered: {', '.join(ids)}")
    cc, gpu = _gpu_capability()
    checks.check_precision(precision, plan["dtype"], cc, gpu)

    logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt, prefer_aot))
    parser = trt.OnnxParser(network, logger)
    model_path: Path = plan["model_path"]
    report(f"parsing {model_path} ({len(plan['k3_nodes'])} k3 plugin nodes)")
    # the checked graph itself, not the file (it may be rewritten); `path` lets the parser find the external data
    if not parser.parse(plan["model"].SerializeToString(), str(model_path)):
        errors = [checks.parser_error_info(parser.get_error(i)) for i in range(parser.num_errors)]
        raise ExportError(checks.format_parser_errors(errors, plan["model"], str(model_path)))

    config = builder.create_builder_config()
    if workspace_gib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    for spec in plan["profiles"]:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in spec.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    cache_path = Path(timing_cache) if timing_cache else None
    cache_bytes = cache_path.read_bytes() if cache_path and cache_path.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    monitor = _progress_monitor(trt, report)
    if monitor is not None:
        config.progress_monitor = monitor

    report(f"building ({precision}, batch <= {max_batch}, prefill <= {max_seq} tokens, context <= {max_context})")
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError("TensorRT could not build the engine (see the TensorRT log above)")
    engine_path = Path(engine_path)
    write_bytes_atomic(engine_path.parent, engine_path.name, bytes(serialized))
    if cache_path is not None:
        write_bytes_atomic(cache_path.parent, cache_path.name, bytes(config.get_timing_cache().serialize()))
    sidecar = engine_sidecar(plan, trt.__version__, gpu, cc, prefer_aot)
    dataclasses.replace(sidecar, network_layers=network.num_layers).write_for(engine_path)
    report(f"engine written to {engine_path} ({engine_path.stat().st_size / 2**20:.1f} MiB, "
           f"{time.perf_counter() - t0:.1f}s)")
    return engine_path
