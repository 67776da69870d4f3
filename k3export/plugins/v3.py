"""The k3 plugins as class-based ``IPluginV3`` plugins (``IPluginV3OneCore`` / ``OneBuild`` / ``OneRuntime``, created by an
``IPluginCreatorV3One``): how TensorRT-RTX, which has no ``tensorrt.plugin``, takes them, and datacenter TensorRT too
when its ``tensorrt.plugin`` lacks AOT plugins (`Flavour.plugin_api`).

One class serves every op: its signature is the op's spec (`k3export.ops.spec`: inputs, outputs, attributes, the
shape and dtype rules), and which kernel runs and how it is launched are the plugin module's `tactic` / `kernel` /
`grid` (``kda.py`` ...), the functions the ``tensorrt.plugin`` path calls too.

* build: output dtypes and shapes from the spec (symbolic dims pass through as ``IDimensionExpr``); LINEAR tensors of
  the spec's dtypes (the spec's uint8 bytes as int8, ``rules.TRT_BYTES``); ``configure_plugin`` (once per optimisation
  profile, on a clone) checks the static dims against the spec and compiles the profile's kernel for the build's
  target (``rules.kernel_target``) with `k3export.ops.aot` (Triton PTX, no GPU); one tactic per profile.
* serialisation: the attributes and the compiled kernels (PTX, entry, block, shared memory, constexprs; zlib-packed
  JSON in field `KERNELS_FIELD`) are the plugin's fields, so the engine carries the PTX and running it needs no
  Triton.
* run (needs a GPU, and Python: TensorRT calls back into this module): ``enqueue`` computes the grid and int32 scalars
  from the call's shapes (the module's `grid`) and launches the PTX through the CUDA driver
  (`k3export.plugins.cuda_launch`).

TensorRT turns an exception in a plugin callback into a bare "non-zero return code"; every callback here records
what went wrong (node name, op, message) in `errors()` first, and ``k3export build`` reports those lines.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import traceback
import zlib
from types import ModuleType
from typing import Any

import numpy as np

from k3export.ops import aot
from k3export.ops.spec import OpInputError

from . import rules
from .flavour import Flavour

#: the plugin field that carries the compiled kernels (tactic -> `aot.Kernel`), zlib-packed JSON as int8 bytes
KERNELS_FIELD = "k3_kernels"


@dataclasses.dataclass(frozen=True)
class PluginFailure:
    """What a plugin callback reported before TensorRT swallowed its exception."""

    node: str
    op: str  # the op's name (spec), e.g. "kda"
    stage: str  # "create", "output shapes", "configure", ...
    message: str
    #: the op's kernel cannot be made for this build (no kernel for the target, a dim it needs static is not, the
    #: spec's limits): the op may be built from its standard-op form instead
    kernel: bool

    def __str__(self) -> str:
        return f"node {self.node!r} (k3::{self.op}) {self.stage}: {self.message}"


_errors: list[PluginFailure] = []


def errors() -> list[PluginFailure]:
    """What the plugin callbacks of this process reported since the last `clear_errors`."""
    return list(_errors)


def clear_errors() -> None:
    _errors.clear()


def pack_kernels(kernels: dict[int, aot.Kernel]) -> bytes:
    """The kernels of a plugin instance as the bytes of `KERNELS_FIELD`."""
    return zlib.compress(json.dumps({str(t): dataclasses.asdict(k) for t, k in kernels.items()}).encode(), 6)


def unpack_kernels(blob: bytes) -> dict[int, aot.Kernel]:
    """`pack_kernels` undone."""
    out = {}
    for t, k in json.loads(zlib.decompress(blob)).items():
        k["target"], k["params"] = tuple(k["target"]), tuple(tuple(p) for p in k["params"])
        out[int(t)] = aot.Kernel(**k)
    return out


#: the plugin field type of each attribute type (what TensorRT's ONNX parser hands over: INT -> INT32, FLOAT ->
#: FLOAT32, STRING -> CHAR)
_FIELD = {int: ("INT32", np.int32), float: ("FLOAT32", np.float32), str: ("CHAR", np.int8)}


def _field_value(kind: type, data: Any) -> Any:
    arr = np.asarray(data)
    if kind is str:
        return arr.astype(np.uint8).tobytes().split(b"\0", 1)[0].decode()
    return kind(arr.reshape(-1)[0])


def _recorded(what: str):
    """Record an exception in a plugin callback (`errors`) before TensorRT swallows it."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001  reported through `errors`, then re-raised for TensorRT
                kernel = isinstance(exc, (aot.KernelError, OpInputError))
                where = "" if kernel else f" at {traceback.extract_tb(exc.__traceback__)[-1].name}"
                _errors.append(PluginFailure(self.node, self.spec.name, what, f"{type(exc).__name__}{where}: {exc}",
                                             kernel))
                raise
        return wrapper

    return deco


def kernels_for(module: ModuleType, static: list, largest: list, types: list[str], attrs: dict,
                target: tuple | None = None) -> tuple[int, aot.Kernel]:
    """(tactic, compiled kernel) of a plugin node whose inputs have dims `static` (None where dynamic) and at most
    `largest`, of spec dtypes `types`: the spec's checks, then the module's `tactic` and `kernel` for the build's
    target. KernelError / OpInputError when the op's kernel cannot be made."""
    module.SPEC.check(static, types, attrs)  # ints compared, unknown (None) dims skipped
    target = target or rules.kernel_target()
    tactic = int(module.tactic(largest, types[0], attrs, target))
    return tactic, module.kernel(tactic, types[0], attrs, static, target)


def _plugin_class(flavour: Flavour) -> type:
    trt = flavour.trt

    class K3Plugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        """One k3 op node (module docstring)."""

        def __init__(self, module: ModuleType, node: str, attrs: dict, kernels: dict[int, aot.Kernel] | None = None,
                     phase: Any = None) -> None:
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.module, self.spec = module, module.SPEC
            self.node, self.attrs, self.phase = node, dict(attrs), phase
            self.kernels: dict[int, aot.Kernel] = dict(kernels or {})
            self.tactic = next(iter(self.kernels), 0)
            self.num_outputs = len(self.spec.outputs)
            self.plugin_namespace = rules.PLUGIN_NAMESPACE
            self.plugin_name = self.spec.name
            self.plugin_version = rules.PLUGIN_VERSION
            self.timing_cache_id = ""
            self.metadata_string = f"{self.spec.plugin_id} {json.dumps(self.attrs, sort_keys=True)}"
            self._shapes: list[tuple[int, ...]] = []
            self._fields: list[Any] = []  # the arrays behind the serialised fields: TensorRT reads them later

        def get_capability_interface(self, type_: Any) -> Any:
            return self

        def clone(self) -> Any:
            other = K3Plugin(self.module, self.node, self.attrs, self.kernels, self.phase)
            other.tactic, other._shapes = self.tactic, list(self._shapes)
            return other

        # ------------------------------------------------------------------ build
        def _spec_dtypes(self, types: Any) -> list[str]:
            return [rules.spec_dtype(a, str(t)) for a, t in zip(self.spec.inputs, types)]

        @_recorded("output dtypes")
        def get_output_data_types(self, input_types: Any) -> list:
            return [flavour.data_type(rules.trt_dtype(n)) for n in self.spec.output_dtypes(self._spec_dtypes(input_types))]

        @_recorded("output shapes")
        def get_output_shapes(self, inputs: Any, shape_inputs: Any, builder: Any) -> list:
            shapes = [[d for d in dims] for dims in inputs]
            out = []
            for shape in self.spec.output_shapes(shapes, self.attrs):
                out.append(trt.DimsExprs([builder.constant(int(d)) if isinstance(d, int) else d for d in shape]))
            return out

        @_recorded("formats")
        def supports_format_combination(self, pos: int, in_out: Any, num_inputs: int) -> bool:
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            args = self.spec.inputs + self.spec.outputs
            known: dict[str, str] = {}
            for a, d in zip(args[:pos], in_out[:pos]):
                known[a.name] = rules.spec_dtype(a, str(d.desc.type))
            allowed = self.spec.allowed(args[pos], known)
            return any(desc.type == flavour.data_type(rules.trt_dtype(n)) for n in allowed)

        def configure_plugin(self, inp: Any, out: Any) -> None:
            """The profile's kernel. TensorRT ends the process when this raises, so a failure is recorded
            (`errors`) and leaves no kernel; ``build_engine`` refuses such an engine. `kernels_for` compiled the same
            kernels before the build, so the op was built from standard ops instead where one fails."""
            try:
                static = [tuple(int(d) if int(d) >= 0 else None for d in t.desc.dims) for t in inp]
                largest = [tuple(int(d) for d in t.max) for t in inp]
                self.tactic, kernel = kernels_for(self.module, static, largest, self._spec_dtypes(
                    [t.desc.type for t in inp]), self.attrs)
                self.kernels = {self.tactic: kernel}
            except Exception as exc:  # noqa: BLE001
                self.kernels = {}
                _errors.append(PluginFailure(self.node, self.spec.name, "configure", f"{type(exc).__name__}: {exc}",
                                             isinstance(exc, (aot.KernelError, OpInputError))))

        def get_valid_tactics(self) -> list[int]:
            return [t for t in self.kernels if t != 0]  # none: TensorRT's default tactic 0

        def get_workspace_size(self, inp: Any, out: Any) -> int:
            return 0

        @_recorded("serialisation")
        def get_fields_to_serialize(self) -> Any:
            self._fields = []
            fields = []
            for name, kind in self.spec.attributes:
                field_type, np_type = _FIELD[kind]
                value = self.attrs[name]
                arr = np.frombuffer(value.encode() + b"\0", np.int8) if kind is str else np.array([value], np_type)
                self._fields.append(arr)
                fields.append(trt.PluginField(name, arr, getattr(trt.PluginFieldType, field_type)))
            blob = np.frombuffer(pack_kernels(self.kernels), np.int8)
            self._fields.append(blob)
            fields.append(trt.PluginField(KERNELS_FIELD, blob, trt.PluginFieldType.INT8))
            self._collection = trt.PluginFieldCollection(fields)
            return self._collection

        # ------------------------------------------------------------------ run
        def set_tactic(self, tactic: int) -> None:
            self.tactic = int(tactic)

        def attach_to_context(self, context: Any) -> Any:
            return self.clone()

        def on_shape_change(self, inp: Any, out: Any) -> None:
            self._shapes = [tuple(int(d) for d in t.dims) for t in inp]

        def _kernel(self) -> aot.Kernel:
            if self.tactic in self.kernels:
                return self.kernels[self.tactic]
            if len(self.kernels) == 1:
                return next(iter(self.kernels.values()))
            raise aot.KernelError(f"no kernel for tactic {self.tactic} (the engine holds {sorted(self.kernels)})")

        @_recorded("enqueue")
        def enqueue(self, input_desc: Any, output_desc: Any, inputs: Any, outputs: Any, workspace: Any,
                    stream: Any) -> None:
            from .cuda_launch import driver

            shapes = [tuple(int(d) for d in t.dims) for t in input_desc]
            kernel = self._kernel()
            if math.prod(shapes[0]) == 0:
                return  # no rows / elements: nothing to compute
            grid, scalars = self.module.grid(kernel, shapes, self.attrs)
            driver().launch(kernel, grid, [int(p) for p in inputs], [int(s) for s in scalars],
                            [int(p) for p in outputs], int(stream))

    return K3Plugin


def _creator_class(flavour: Flavour, plugin: type) -> type:
    trt = flavour.trt

    class K3PluginCreator(trt.IPluginCreatorV3One):
        """Creates `K3Plugin` for one op, from an ONNX node's attributes (build) or an engine's fields (run)."""

        def __init__(self, module: ModuleType) -> None:
            trt.IPluginCreatorV3One.__init__(self)
            self.module, self.spec = module, module.SPEC
            self.name = self.spec.name
            self.plugin_namespace = rules.PLUGIN_NAMESPACE
            self.plugin_version = rules.PLUGIN_VERSION
            self._declared = [np.array([], _FIELD[kind][1]) for _, kind in self.spec.attributes] + [np.array([], np.int8)]
            self.field_names = trt.PluginFieldCollection(
                [trt.PluginField(n, arr, getattr(trt.PluginFieldType, _FIELD[kind][0]))
                 for (n, kind), arr in zip(self.spec.attributes, self._declared)]
                + [trt.PluginField(KERNELS_FIELD, self._declared[-1], trt.PluginFieldType.INT8)])
            self.created: list[str] = []  # node names of the plugins created for a build

        def create_plugin(self, name: str, fc: Any, phase: Any) -> Any:
            try:
                given = {f.name: f.data for f in fc}
                attrs = {}
                for attr, kind in self.spec.attributes:
                    if attr not in given:
                        raise ValueError(f"missing attribute {attr!r} (the plugin takes {self.spec.attribute_names})")
                    attrs[attr] = _field_value(kind, given[attr])
                kernels = None
                if KERNELS_FIELD in given:
                    kernels = unpack_kernels(np.asarray(given[KERNELS_FIELD]).astype(np.int8).tobytes())
                if phase == trt.TensorRTPhase.BUILD:
                    self.created.append(name)
                return plugin(self.module, name, attrs, kernels, phase)
            except Exception as exc:  # noqa: BLE001  TensorRT would only say "could not create the plugin"
                _errors.append(PluginFailure(name, self.spec.name, "create", f"{type(exc).__name__}: {exc}", False))
                return None

    return K3PluginCreator


_creators: dict[tuple[str, str], Any] = {}  # (flavour, op) -> creator; kept alive: the registry holds no reference


def register(flavour: Flavour, modules: list[ModuleType]) -> list[Any]:
    """Register a creator for each plugin module with `flavour`'s plugin registry (once per process and op);
    returns the creators (their ``created`` lists name the nodes each made for a build)."""
    plugin = None
    out = []
    for module in modules:
        key = (flavour.name, module.SPEC.name)
        if key not in _creators:
            if plugin is None:
                plugin = _plugin_class(flavour)
            creator = _creator_class(flavour, plugin)(module)
            if not flavour.trt.get_plugin_registry().register_creator(creator, rules.PLUGIN_NAMESPACE):
                from .flavour import TensorRTUnavailable

                raise TensorRTUnavailable(f"{flavour.label} refused to register the {module.SPEC.plugin_id} plugin")
            _creators[key] = creator
        out.append(_creators[key])
    return out


def creators(flavour: Flavour) -> dict[str, Any]:
    """The registered creators of `flavour`, by op name."""
    return {op: c for (name, op), c in _creators.items() if name == flavour.name}


__all__ = ["KERNELS_FIELD", "PluginFailure", "clear_errors", "creators", "errors", "kernels_for", "pack_kernels", "register", "unpack_kernels"]
