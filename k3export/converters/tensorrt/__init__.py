"""k3export.converters.tensorrt: ONNX export -> TensorRT engine with the k3 plugins, on datacenter TensorRT or
TensorRT-RTX (`k3export.plugins.flavour`: whichever imports).

``build_engine(onnx_dir, engine_path, precision, max_batch, max_seq, max_context, target_cc=..., ...)``; everything
it checks first (the export folder, k3 nodes, precision, profile ranges, parser error formatting; the in-memory
rewrite of MXFP4 experts to their plugin, ``plugin_forms``; the target and precision against the installed TensorRT,
``checks.check_target``) runs without a GPU, and TensorRT-RTX builds without one too. The engine runs under
``k3export.runtime.trt_runner`` (`TrtRunner`, `TrtSession`); its profiles' dimension roles are
``k3export.artifacts.engine_sidecar.dim_roles``. Importing this package never imports TensorRT.
"""

from __future__ import annotations

from k3export.artifacts.engine_sidecar import ProfileError, dim_roles

from . import checks, plugin_forms
from .build import build_engine, make_profiles, planned_sidecar, prepare_build
from .plugin_forms import plugin_model

__all__ = ["ProfileError", "build_engine", "checks", "dim_roles", "make_profiles", "planned_sidecar", "plugin_forms",
           "plugin_model", "prepare_build"]
