"""k3export: turn Kimi K3 checkpoints into validated ONNX and TensorRT artifacts.

Each package imports only from those listed before it (tests/test_architecture.py keeps it so)::

    modeling     K3Config, K3ForCausalLM, the vision tower: the numerics; imports nothing else of k3export
    ops          kernels plugged into the modeling file's hooks (Triton, CPU)
    plugins      the same kernels as TensorRT plugins
    artifacts    the files k3export writes and reads (manifest, runtime config, sidecars, plans), strict
    converters   checkpoints (every layout -> ours), onnx (model -> graph forms), tensorrt (ONNX -> engine)
    runtime      one Runner per runtime, and the one decode loop
    pipeline     stage plans and runners of multi-stage exports
    validate     cross-runtime comparison over prefill and decode
    hub          detect, card and push

The Typer app in the repository's ``cli/`` folder sits above all of them; the library never imports it.
"""


from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["K3Config", "K3ForCausalLM", "K3ForConditionalGeneration", "K3Model", "K3Processor", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `import k3export.errors` (and the CLI's --help) does not pay for torch + transformers.
    if name in ("K3Config", "K3ForCausalLM", "K3ForConditionalGeneration", "K3Model", "K3Processor"):
        from k3export import kernels, modeling

        kernels.plug_in()
        return getattr(modeling, name)
    raise AttributeError(f"module 'k3export' has no attribute {name!r}")
