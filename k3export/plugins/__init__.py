"""TensorRT Python plugins for the k3 ops: ``k3::kda``, ``k3::situ_glu``, ``k3::moe_route``, ``k3::moe_experts`` and
``k3::moe_experts_mxfp4``.

One op keeps one name from its maths (``k3export.modeling``) to its kernel (``k3export.ops``), its ONNX
node (domain ``k3``, ``plugin_namespace="k3"``) and its plugin here. Importing this package never
imports TensorRT; ``register_plugins()`` does, and applies the ``tensorrt.plugin`` decorators
(default, non-lazy registration: the ONNX parser finds the plugins in the registry).

The contracts are the op specs (``k3export.ops.spec``), the kernels come from ``k3export.ops.aot``, and the
helpers the decorators call are plain functions in ``rules``.
"""

from __future__ import annotations

from k3export.errors import ExportError

from . import rules
from .rules import PLUGIN_NAMESPACE

__all__ = ["PLUGIN_NAMESPACE", "TensorRTUnavailable", "register_plugins", "require_tensorrt", "rules"]

INSTALL_HINT = (
    "install TensorRT >= 10.9 with its Python bindings on a machine with an NVIDIA GPU, e.g. "
    "`pip install tensorrt-cu12` (or tensorrt-cu13 to match your CUDA), then check `python -c \"import tensorrt\"`"
)

_registered: list[str] = []


class TensorRTUnavailable(ExportError):
    """TensorRT (or its ``tensorrt.plugin`` module) cannot be imported here."""


def require_tensorrt():
    """``(tensorrt, tensorrt.plugin)``, or TensorRTUnavailable saying what is missing and how to install it."""
    try:
        import tensorrt as trt
    except Exception as exc:
        raise TensorRTUnavailable(f"TensorRT is not installed ({type(exc).__name__}: {exc}); {INSTALL_HINT}") from None
    try:
        import tensorrt.plugin as trtp
    except Exception as exc:
        version = getattr(trt, "__version__", "?")
        raise TensorRTUnavailable(
            f"TensorRT {version} has no usable `tensorrt.plugin` module ({exc}); the k3 plugins need "
            f"TensorRT >= 10.9: {INSTALL_HINT}"
        ) from None
    return trt, trtp


def register_plugins() -> list[str]:
    """Register ``k3::kda``, ``k3::situ_glu``, ``k3::moe_route``, ``k3::moe_experts`` and ``k3::moe_experts_mxfp4``
    with TensorRT (once per process).

    Returns the plugin ids. Raises TensorRTUnavailable when TensorRT cannot be imported."""
    trt, trtp = require_tensorrt()
    if _registered:
        return list(_registered)
    from . import kda, moe_experts, moe_experts_mxfp4, moe_route, situ_glu

    for module in (kda, situ_glu, moe_route, moe_experts, moe_experts_mxfp4):
        spec = module.SPEC
        if hasattr(trtp.op, PLUGIN_NAMESPACE) and _defined(trtp, spec.name):
            _registered.append(spec.plugin_id)  # defined by an earlier import of this package
            continue
        module.define(trtp, trt)
        _registered.append(spec.plugin_id)
    return list(_registered)


def _defined(trtp, name: str) -> bool:
    try:
        getattr(getattr(trtp.op, PLUGIN_NAMESPACE), name)
    except AttributeError:
        return False
    return True
