"""``build_engine``: ONNX export folder -> serialized TensorRT engine with the k3 plugins, on whichever TensorRT imports.

Order of work: everything checkable without TensorRT first (`prepare_build`: the export folder as `load_export`
checks it; the graph as TensorRT will parse it, `plugin_forms.plugin_model`: an MXFP4 ``k3::moe_experts`` becomes
``k3::moe_experts_mxfp4`` over int8 views of its bytes; its k3 nodes, their attributes and initializer inputs;
precision vs the manifest's dtype; profiles whose dimension roles come from the manifest's contract dimensions),
then TensorRT (`k3export.plugins.flavour`: datacenter ``tensorrt`` or ``tensorrt_rtx``, one code path):

1. the target compute capability (``--target-cc``, else the visible GPU's) against what that TensorRT builds for,
   and the precision against the target (`checks.check_target`, `checks.check_precision`): one line naming the
   alternatives;
2. the k3 plugins registered for that target (their kernels are compiled for it), the graph parsed (parser errors
   name node index, name and op; the plugins' own errors are added), a prefill and a decode optimisation profile,
   a timing cache reused / updated, progress reported, the engine built;
3. the engine, its ``.json`` sidecar (`EngineSidecar`: flavour, version, target, plugins used, layer counts) and the
   timing cache written atomically, never through a link.

A k3 op whose kernel cannot be made for the target is named with the reason and built from its standard-op form
instead (`plugin_forms.standard_op_bodies`), once, in the same call; ``standard_ops`` asks for that up front.

Datacenter TensorRT builds on its GPU; with ``tensorrt.plugin`` AOT plugins the engine embeds the Triton PTX and
runs without Python (``PREFER_AOT_PYTHON_PLUGINS``). TensorRT-RTX builds with no GPU, for a named compute capability;
its k3 plugins are class-based ``IPluginV3`` whose fields carry the PTX (`k3export.plugins.v3`), so running its
engines needs Python. Networks are strongly typed, so the ONNX graph's dtypes are the engine's precision.
`k3export.runtime.trt_runner` runs the engine.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from k3export.artifacts import EngineNode, EngineProfile, EngineSidecar, StateManifest, load_export, write_bytes_atomic
from k3export.converters.onnx.forms import check_export
from k3export.errors import ExportError
from k3export.plugins import register_plugins, rules
from k3export.plugins.flavour import Capability, Flavour, format_cc, load_flavour, parse_cc
from k3export.safety import check_writable
from k3export.artifacts.engine_sidecar import ProfileError, ProfileSpec, dim_roles

from . import checks
from .plugin_forms import plugin_model, standard_op_bodies

SIDECAR_SUFFIX = EngineSidecar.SUFFIX
#: TensorRT's builder optimisation levels (0 builds fastest, 3 is its default, 5 searches longest)
OPTIMIZATION_LEVELS = range(0, 6)


def make_profiles(manifest: StateManifest, max_batch: int, max_seq: int, max_context: int) -> list[ProfileSpec]:
    """Two profiles: prefill (1 <= new tokens <= max_seq) and decode (one new token), both with
    0 <= carried tokens <= max_context and 1 <= batch <= max_batch."""
    for flag, v in (("max_batch", max_batch), ("max_seq", max_seq), ("max_context", max_context)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ProfileError(f"{flag}={v!r}: expected an integer >= 1")
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
        profiles.append(ProfileSpec(pname, shapes, limits))
    return profiles


def prepare_build(onnx_dir: str | Path, precision: str = "bf16", max_batch: int = 1, max_seq: int = 256,
                  max_context: int = 1024, allow_no_plugins: bool = False,
                  standard_ops: Sequence[str] = ()) -> dict[str, Any]:
    """All checks that need no TensorRT (the export folder as `load_export` checks it, k3 nodes, precision,
    profiles); returns what the build uses (export, model path, model, profiles, k3 nodes, dtype, standard ops). The
    model is the graph TensorRT parses: `plugin_model` of the file's (weights not loaded; external data relative to
    the model path), with the `standard_ops` built from their standard-op bodies."""
    export = load_export(onnx_dir)
    export.require_weights()
    check_export("trt", export)  # a graph form TensorRT cannot read: one line naming the form it needs
    where = str(export.model_path)
    model = plugin_model(checks.load_onnx(export.model_path), where)
    standard = sorted(set(standard_ops))
    if standard:
        import onnx

        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = standard_op_bodies(copy, standard, export.config, export.runtime.opset, where)
    nodes = checks.inspect_k3_nodes(model, where, standard)
    if not allow_no_plugins and not standard:
        checks.require_plugins(nodes, where)
    dtype = checks.check_precision(precision, export.dtype)
    profiles = make_profiles(export.manifest, max_batch, max_seq, max_context)
    return {"export": export, "model_path": export.model_path, "model": model, "k3_nodes": nodes, "dtype": dtype,
            "precision": precision, "profiles": profiles, "standard_ops": standard,
            "limits": {"max_batch": max_batch, "max_seq": max_seq, "max_context": max_context}}


def engine_sidecar(plan: dict[str, Any], tensorrt: str, gpu: str, cc: Capability | None, prefer_aot: bool,
                   flavour: str = "tensorrt", target: Capability | None = None,
                   optimization_level: int | None = None) -> EngineSidecar:
    """What ``<engine>.json`` records of a build (`prepare_build`'s `plan`, then TensorRT's flavour and version, the
    building GPU and the target): the source graph, precision, profiles, k3 nodes and standard ops.
    `EngineSidecar.same_build` tells an engine built the same way."""
    return EngineSidecar(
        onnx=str(plan["model_path"]), precision=plan["precision"], dtype=plan["dtype"], tensorrt_flavour=flavour,
        tensorrt_version=tensorrt, gpu=gpu, compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
        prefer_aot=prefer_aot,
        profiles=[EngineProfile(p.name, dict(p.limits), {n: tuple(list(s) for s in v) for n, v in p.shapes.items()})
                  for p in plan["profiles"]],
        k3_nodes=[EngineNode(n.index, n.name, n.op) for n in plan["k3_nodes"]],
        target_compute_capability=None if target is None else (int(target[0]), int(target[1])),
        standard_ops=list(plan.get("standard_ops", [])), optimization_level=optimization_level)


def visible_gpu() -> tuple[Capability, str] | None:
    """(compute capability, name) of the GPU torch sees, or None when there is none."""
    try:
        import torch
    except Exception:  # pragma: no cover
        return None
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability()), torch.cuda.get_device_name()


def resolve_target(flavour: Flavour, target_cc: str | Capability | None, precision: str,
                   dtype: str | None = None) -> tuple[Capability, tuple[Capability, str] | None]:
    """(target compute capability, visible GPU or None) of a build, both checks made (`checks.check_target`,
    `checks.check_precision`): one line naming the alternatives when the installed TensorRT cannot build it."""
    gpu = visible_gpu()
    target = checks.check_target(flavour, None if target_cc is None else parse_cc(target_cc),
                                 None if gpu is None else gpu[0])
    where = f"target {format_cc(target)}" if gpu is None or target != gpu[0] else gpu[1]
    checks.check_precision(precision, dtype, target, where)
    return target, gpu


def planned_sidecar(plan: dict[str, Any], prefer_aot: bool = True, target_cc: str | Capability | None = None,
                    optimization_level: int | None = None) -> EngineSidecar:
    """The sidecar `build_engine` would write for `plan` here (TensorRT flavour and version, GPU, target), its
    outcomes unset: what a pipeline build compares a stage's record with to keep an engine built the same way."""
    flavour = load_flavour()
    target, gpu = resolve_target(flavour, target_cc, plan["precision"], plan["dtype"])
    return engine_sidecar(plan, flavour.version, "none" if gpu is None else gpu[1], None if gpu is None else gpu[0],
                          prefer_aot, flavour.name, target, optimization_level)


def _network_flags(flavour: Flavour, prefer_aot: bool) -> int:
    F = flavour.trt.NetworkDefinitionCreationFlag
    flags = 0
    if hasattr(F, "STRONGLY_TYPED"):
        flags |= 1 << int(F.STRONGLY_TYPED)
    if flavour.plugin_api != "quick":
        return flags  # class-based plugins: no Python-plugin preference to state
    if prefer_aot:
        if not hasattr(F, "PREFER_AOT_PYTHON_PLUGINS"):
            raise ExportError(f"{flavour.label} has no AOT Python plugins (needs >= 10.9); upgrade TensorRT or build "
                              "with prefer_aot=False (JIT plugins need Python at run time)")
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
            if not parent_phase:  # the nested phases repeat per layer: only the top ones are news
                report(f"{phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # never cancel

        def phase_finish(self, phase_name):
            dt = time.perf_counter() - self.t0.pop(phase_name, time.perf_counter())
            if dt >= 1.0:
                report(f"  {phase_name} done in {dt:.1f}s")

    return _Monitor()


def _plugin_failures(flavour: Flavour) -> list:
    if flavour.plugin_api != "v3":
        return []
    from k3export.plugins import v3

    return v3.errors()


def unbuildable_plugins(network: Any, plan: dict[str, Any], target: Capability) -> dict[str, str]:
    """{op: why} for each k3 op whose kernel cannot be made for `target`, found by compiling, before TensorRT builds,
    the kernel of every plugin layer of the parsed `network` (its input dims and dtypes as parsed; a decode and a
    prefill tactic each) the way the plugins compile them. Compiles are cached, so the build pays nothing twice."""
    from k3export.ops import aot
    from k3export.ops.spec import OpInputError
    from k3export.plugins import plugin_modules
    from k3export.plugins.v3 import kernels_for

    modules = {m.SPEC.name: m for m in plugin_modules()}
    nodes = {n.name: n for n in plan["k3_nodes"] if n.op not in plan["standard_ops"]}
    aot_target = ("cuda", target[0] * 10 + target[1], 32)
    bad: dict[str, str] = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        node = nodes.get(layer.name)
        if node is None or node.op in bad:
            continue
        module = modules[node.op]
        tensors = [layer.get_input(j) for j in range(layer.num_inputs)]
        static = [tuple(int(d) if int(d) >= 0 else None for d in t.shape) for t in tensors]
        types = [rules.spec_dtype(a, str(t.dtype)) for a, t in zip(module.SPEC.inputs, tensors)]
        for tokens in (1, plan["limits"]["max_seq"]):  # decode, then the longest prefill
            largest = [tuple(tokens if d is None else d for d in s) for s in static]
            try:
                kernels_for(module, static, largest, types, node.attributes, aot_target)
            except (aot.KernelError, OpInputError) as exc:
                bad[node.op] = f"{type(exc).__name__}: {exc}"
                break
    return bad


class _PluginsUnbuildable(ExportError):
    """Some k3 op's kernel cannot be made for this build (`ops`); each may be built from its standard-op form."""

    def __init__(self, message: str, ops: dict[str, str]) -> None:
        super().__init__(message)
        self.ops = ops


def _build_once(plan: dict[str, Any], flavour: Flavour, target: Capability, prefer_aot: bool,
                workspace_gib: float | None, timing_cache: Path | None, optimization_level: int | None,
                report: Callable[[str], None], verbose: bool) -> tuple[bytes, Any, dict[str, Any]]:
    """(serialized engine, final timing cache or None, outcomes) of one TensorRT build of `plan`."""
    trt = flavour.trt
    failures_before = len(_plugin_failures(flavour))
    logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(flavour, prefer_aot))
    parser = trt.OnnxParser(network, logger)
    model_path: Path = plan["model_path"]
    k3 = [n for n in plan["k3_nodes"] if n.op not in plan["standard_ops"]]
    report(f"parsing {model_path} ({len(k3)} k3 plugin nodes"
           + (f"; {', '.join('k3::' + o for o in plan['standard_ops'])} from standard ops" if plan["standard_ops"]
              else "") + ")")

    def failed(what: str) -> ExportError:
        found = _plugin_failures(flavour)[failures_before:]
        unbuildable = {f.op: f.message for f in found if f.kernel}
        lines = [f"  {f}" for f in found]
        message = what + ("\n  the k3 plugins reported:\n" + "\n".join(lines) if lines else "")
        return _PluginsUnbuildable(message, unbuildable) if unbuildable else ExportError(message)

    # the checked graph itself, not the file (it may be rewritten); `path` lets the parser find the external data
    if not parser.parse(plan["model"].SerializeToString(), str(model_path)):
        errors = [checks.parser_error_info(parser.get_error(i)) for i in range(parser.num_errors)]
        raise failed(checks.format_parser_errors(errors, plan["model"], str(model_path)))

    unbuildable = unbuildable_plugins(network, plan, target)
    if unbuildable:
        raise _PluginsUnbuildable("; ".join(f"k3::{op}: {why}" for op, why in unbuildable.items()), unbuildable)
    config = builder.create_builder_config()
    if flavour.targets is not None:
        config.num_compute_capabilities = 1
        config.set_compute_capability(flavour.target_enum(target), 0)
    if optimization_level is not None:
        config.builder_optimization_level = int(optimization_level)
    if workspace_gib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    for spec in plan["profiles"]:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in spec.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    cache = None
    if timing_cache is not None:
        cache_bytes = timing_cache.read_bytes() if timing_cache.is_file() else b""
        cache = config.create_timing_cache(cache_bytes)
        config.set_timing_cache(cache, ignore_mismatch=False)
    monitor = _progress_monitor(trt, report)
    if monitor is not None:
        config.progress_monitor = monitor

    layers = [network.get_layer(i).type for i in range(network.num_layers)]
    plugin_types = {getattr(trt.LayerType, n) for n in ("PLUGIN_V3", "PLUGIN_V2", "PLUGIN") if hasattr(trt.LayerType, n)}
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise failed(f"{flavour.label} could not build the engine for {format_cc(target)}"
                     + ("" if verbose else " (build with --verbose for TensorRT's log)"))
    if len(_plugin_failures(flavour)) > failures_before:  # a plugin without its kernel: the engine cannot run
        raise failed(f"{flavour.label} built an engine in which some k3 plugin has no kernel; not written")
    outcomes = {"network_layers": network.num_layers, "plugin_layers": sum(t in plugin_types for t in layers),
                "plugins": sorted({f"{rules.PLUGIN_NAMESPACE}::{n.op}" for n in k3}),
                "plugin_api": "tensorrt.plugin" if flavour.plugin_api == "quick" else "IPluginV3"}
    final_cache = config.get_timing_cache() if cache is not None else None
    return bytes(serialized), final_cache, outcomes


def build_engine(onnx_dir: str | Path, engine_path: str | Path, precision: str = "bf16", max_batch: int = 1,
                 max_seq: int = 256, max_context: int = 1024, timing_cache: str | Path | None = None,
                 allow_no_plugins: bool = False, prefer_aot: bool = True, workspace_gib: float | None = None,
                 progress: Callable[[str], None] | None = print, verbose: bool = False,
                 target_cc: str | Capability | None = None, optimization_level: int | None = None,
                 standard_ops: Sequence[str] = ()) -> Path:
    """Build and serialize a TensorRT engine from the ONNX export in `onnx_dir` (module docstring).

    Profiles: prefill (1 <= T <= max_seq) and decode (T = 1); batch 1..max_batch; cached tokens (MLA latent length)
    0..max_context. `target_cc` ("8.6"): the compute capability to build for (TensorRT-RTX; default the visible
    GPU's). `optimization_level`: TensorRT's builder optimisation level (0 builds fastest). `standard_ops`: k3 ops to
    build from their standard-op form instead of their plugin. ``timing_cache`` (a file path) is read when it exists
    and written back after the build. Writes the engine and ``<engine>.json``. Raises ExportError
    (TensorRTUnavailable when no TensorRT imports) with a one-line reason."""
    report = progress or (lambda _msg: None)
    if optimization_level is not None and optimization_level not in OPTIMIZATION_LEVELS:
        raise ExportError(f"optimization level {optimization_level!r}: expected {OPTIMIZATION_LEVELS.start} to "
                          f"{OPTIMIZATION_LEVELS.stop - 1}")
    # every file the build writes, checked before minutes of building (the sidecar names the engine it belongs to)
    check_writable(engine_path, "the engine")
    check_writable(f"{engine_path}{SIDECAR_SUFFIX}", "the engine's sidecar")
    if timing_cache:
        check_writable(timing_cache, "the timing cache")
    plan = prepare_build(onnx_dir, precision, max_batch, max_seq, max_context, allow_no_plugins, standard_ops)
    flavour = load_flavour()
    target, gpu = resolve_target(flavour, target_cc, precision, plan["dtype"])
    checks.check_fp8(flavour, target, plan["model"], str(plan["model_path"]))
    with rules.kernels_for(target):
        ids = register_plugins(flavour=flavour)
        report(f"{flavour.label}, building for compute capability {format_cc(target)}"
               f"{'' if gpu is None else f' on {gpu[1]}'}; k3 plugins registered ({flavour.plugin_api}): "
               f"{', '.join(ids)}")
        cache_path = Path(timing_cache) if timing_cache else None
        if cache_path is not None and flavour.rtx:  # its timing-cache calls are documented no-ops (and crash on use)
            report(f"{flavour.label} times no kernels while building: --timing-cache {cache_path} is not used")
            cache_path = None

        t0 = time.perf_counter()
        report(f"building ({precision}, batch <= {max_batch}, prefill <= {max_seq} tokens, context <= {max_context})")
        try:
            serialized, cache, outcomes = _build_once(plan, flavour, target, prefer_aot, workspace_gib, cache_path,
                                                      optimization_level, report, verbose)
        except _PluginsUnbuildable as exc:
            fallback = sorted(set(plan["standard_ops"]) | set(exc.ops))
            for op, why in sorted(exc.ops.items()):
                report(f"k3::{op} cannot be built as a plugin on {flavour.label} for {format_cc(target)} ({why}); "
                       "building it from its standard-op form")
            try:
                plan = prepare_build(onnx_dir, precision, max_batch, max_seq, max_context, allow_no_plugins, fallback)
            except ExportError as why:
                raise ExportError(f"{exc}\n  and the op cannot be built without its plugin: {why}") from None
            serialized, cache, outcomes = _build_once(plan, flavour, target, prefer_aot, workspace_gib, cache_path,
                                                      optimization_level, report, verbose)
    seconds = time.perf_counter() - t0
    engine_path = Path(engine_path)
    write_bytes_atomic(engine_path.parent, engine_path.name, serialized)
    if cache_path is not None and cache is not None:
        write_bytes_atomic(cache_path.parent, cache_path.name, bytes(cache.serialize()))
    sidecar = engine_sidecar(plan, flavour.version, "none" if gpu is None else gpu[1], None if gpu is None else gpu[0],
                             prefer_aot, flavour.name, target, optimization_level)
    try:
        dataclasses.replace(sidecar, **outcomes).write_for(engine_path)
    except BaseException:
        engine_path.unlink(missing_ok=True)  # an engine without its sidecar would look complete
        raise
    report(f"engine written to {engine_path} ({len(serialized) / 2**20:.2f} MiB, {outcomes['network_layers']} layers, "
           f"{outcomes['plugin_layers']} k3 plugin layers, {seconds:.1f}s)")
    return engine_path


__all__ = ["OPTIMIZATION_LEVELS", "SIDECAR_SUFFIX", "build_engine", "engine_sidecar", "make_profiles",
           "planned_sidecar", "prepare_build", "resolve_target", "visible_gpu"]
