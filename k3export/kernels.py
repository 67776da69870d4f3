"""Plug the Triton kernels of `k3export.ops` into the modeling file's kernel hooks.

This is the one module that imports both: modeling sits at the bottom and never imports ops, and ops never imports
modeling. `import k3export` does it when the model classes are first used, so a model on CUDA runs the kernels
(the ``auto`` backend of `k3export.ops.backend`); on CPU the kernels decline and the PyTorch functions run.
"""

from __future__ import annotations


def plug_in() -> bool:
    """Register every kernel of `k3export.ops.KERNELS`; False (nothing registered) when the ops cannot import."""
    try:
        from k3export.ops.registry import KERNELS
    except ImportError:
        return False
    from k3export.modeling.modeling_k3 import register_kernel

    for name, kernel in KERNELS.items():
        register_kernel(name, kernel)
    return True
