"""TensorRT plugins for the k3 ops: ``k3::kda``, ``k3::situ_glu``, ``k3::moe_route``, ``k3::moe_experts``,
``k3::moe_experts_mxfp4`` and ``k3::moe_experts_nvfp4``.

One op keeps one name from its maths (``k3export.modeling``) to its kernel (``k3export.ops``), its ONNX
node (domain ``k3``, ``plugin_namespace="k3"``) and its plugin here. Importing this package never
imports TensorRT; ``register_plugins()`` does, through `flavour` (datacenter ``tensorrt`` or ``tensorrt_rtx``), and
registers the plugins the way that TensorRT takes them (default, non-lazy registration: the ONNX parser finds them
in the registry):

* ``tensorrt.plugin`` with AOT plugins (datacenter TensorRT >= 10.9): each module's ``define(trtp, trt)`` applies the
  decorators; the engine embeds the PTX and runs without Python;
* otherwise (TensorRT-RTX): class-based ``IPluginV3`` plugins (`v3`), whose fields carry the PTX.

The contracts are the op specs (``k3export.ops.spec``), the kernels come from ``k3export.ops.aot``, and what each
plugin module says about its kernel (``tactic`` / ``kernel`` / ``grid``) and the helpers are plain functions.
"""

from __future__ import annotations

from . import rules
from .flavour import INSTALL_HINT, Flavour, TensorRTUnavailable, load_flavour
from .rules import PLUGIN_NAMESPACE

__all__ = ["INSTALL_HINT", "PLUGIN_NAMESPACE", "TensorRTUnavailable", "plugin_modules", "register_plugins",
           "require_tensorrt", "rules"]

_registered: list[str] = []


def plugin_modules() -> list:
    """The plugin modules, one per k3 op with a kernel (``kda``, ``situ_glu``, ``moe_route``, ``moe_experts``,
    ``moe_experts_mxfp4``, ``moe_experts_nvfp4``)."""
    from . import kda, moe_experts, moe_experts_mxfp4, moe_experts_nvfp4, moe_route, situ_glu

    return [kda, situ_glu, moe_route, moe_experts, moe_experts_mxfp4, moe_experts_nvfp4]


def require_tensorrt():
    """``(tensorrt module, tensorrt.plugin or None)`` of the TensorRT `flavour.load_flavour` picks (None: the k3
    plugins reach it as class-based ``IPluginV3``); TensorRTUnavailable saying what is missing and how to install."""
    flavour = load_flavour()
    if flavour.plugin_api != "quick":
        return flavour.trt, None
    import importlib

    return flavour.trt, importlib.import_module(f"{flavour.name}.plugin")


def register_plugins(ops: list[str] | None = None, flavour: Flavour | None = None) -> list[str]:
    """Register the k3 plugins (`ops`, default all) with TensorRT (each once per process); returns their ids.
    Raises TensorRTUnavailable when TensorRT cannot be imported, or when its ONNX parser cannot take plugins in this
    process (`Flavour.plugin_problem`)."""
    flavour = flavour or load_flavour()
    if flavour.plugin_problem:
        raise TensorRTUnavailable(flavour.plugin_problem)
    modules = [m for m in plugin_modules() if ops is None or m.SPEC.name in ops]
    if flavour.plugin_api == "v3":
        from . import v3

        v3.register(flavour, modules)
    else:
        trt, trtp = require_tensorrt()
        for module in modules:
            if module.SPEC.plugin_id in _registered:
                continue
            if not (hasattr(trtp.op, PLUGIN_NAMESPACE) and _defined(trtp, module.SPEC.name)):
                module.define(trtp, trt)  # not defined by an earlier import of this package
            _registered.append(module.SPEC.plugin_id)
    return [m.SPEC.plugin_id for m in modules]


def _defined(trtp, name: str) -> bool:
    try:
        getattr(getattr(trtp.op, PLUGIN_NAMESPACE), name)
    except AttributeError:
        return False
    return True
