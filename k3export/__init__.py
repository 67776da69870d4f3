"""k3export: turn Kimi K3 checkpoints into validated ONNX and TensorRT artifacts.

Data flows one way: checkpoint -> model (``k3export.modeling``) -> kernels (``k3export.ops``)
-> ONNX (``k3export.converters.onnx``) -> engine (``k3export.converters.tensorrt``, ``k3export.plugins``)
-> validation (``k3export.validate``) -> Hub (``k3export.hub``).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["K3Config", "K3ForCausalLM", "K3Model", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `import k3export.errors` (and the CLI's --help) does not pay for torch + transformers.
    if name in ("K3Config", "K3ForCausalLM", "K3Model"):
        from k3export import kernels, modeling

        kernels.plug_in()
        return getattr(modeling, name)
    raise AttributeError(f"module 'k3export' has no attribute {name!r}")
