"""The PyTorch source of truth: `K3Config` and `K3ForCausalLM` (transformers single-file style).

The code files (`CODE_FILES`, and ``modeling_k3_vision.CODE_FILES`` for a model with its vision tower) import
only torch, transformers and each other, so that they can be copied next to a checkpoint and loaded with
``trust_remote_code=True``; the helpers (`models`) are k3export-only.

Importing the package imports neither torch nor transformers: every name loads its module on first use (PEP 562),
so `contract`, which the runtimes read, stays light (an ONNX Runtime or OpenVINO session of an export runs without
torch in the process).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "configuration_k3": ("K3Config", "K3ConfigError", "K3VisionConfig", "K3VLConfig"),
    "image_processing_k3": ("K3ImageError", "K3ImageProcessor", "K3Processor"),
    "modeling_k3": ("K3Cache", "K3ForCausalLM", "K3Model", "K3PreTrainedModel"),
    "contract": ("K3VisionInputError",),
    "modeling_k3_vision": ("K3ForConditionalGeneration", "K3VisionTower"),
    "models": ("AUTO_MAP", "CODE_FILES", "randomize_weights", "save_config_and_code", "save_pretrained", "tiny_model",
               "tiny_vision_model", "vision_weight"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(n for n in _MODULE_OF if n != "CODE_FILES")
