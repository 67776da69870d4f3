"""k3export.converters.tensorrt: ONNX export -> TensorRT engine with the k3 plugins.

``build_engine(onnx_dir, engine_path, precision, max_batch, max_seq, max_context, timing_cache=...)`` needs
TensorRT (>= 10.9) and a GPU; everything it checks first (the export folder, k3 nodes, precision, profile ranges,
parser error formatting; the in-memory rewrite of MXFP4 experts to their plugin, ``plugin_forms``) is in
``prepare_build`` / ``checks`` / ``plugin_forms`` and runs anywhere. The engine runs under
``k3export.runtime.trt_runner`` (`TrtRunner`, `TrtSession`). Importing this package never imports TensorRT.
"""

from __future__ import annotations

from . import checks, plugin_forms
from .build import build_engine, dim_roles, make_profiles, prepare_build
from .checks import ProfileError
from .plugin_forms import plugin_model

__all__ = ["ProfileError", "build_engine", "checks", "dim_roles", "make_profiles", "plugin_forms", "plugin_model",
           "prepare_build"]
