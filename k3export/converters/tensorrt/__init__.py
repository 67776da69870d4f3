"""k3export.converters.tensorrt: ONNX export -> TensorRT engine with the k3 plugins, and a session to run it.

``build_engine(onnx_dir, engine_path, precision, max_batch, max_seq, max_context, timing_cache=...)`` and
``TrtSession(engine_path, onnx_dir).run(feeds)``. Both need TensorRT (>= 10.9) and a GPU; everything they
check first (k3 nodes, precision, profile ranges, parser error formatting) is in ``checks`` and runs
anywhere. Importing this package never imports TensorRT.
"""

from __future__ import annotations

from . import checks
from .build import build_engine, prepare_build
from .checks import ProfileError

__all__ = ["ProfileError", "TrtSession", "build_engine", "checks", "prepare_build"]


def __getattr__(name: str):
    if name == "TrtSession":
        from .session import TrtSession

        return TrtSession
    raise AttributeError(name)
