"""CPU kernels for the modeling file's ``kda_layer`` (one token), ``attn_res_aggregate``, ``rms_norm`` and
``moe_route`` hooks, fp32.

A big_cfg decode step on 2 cores spent ~2.4 ms of 13.6 in these as ~600 small PyTorch operators (4-6 us each between
the weight reads, which evict what they need); as C++ each is one call (side by side: docs/speed.md, "PyTorch eager
decode"). The source (``csrc/cpu_decode.cpp``) is compiled on first use with torch's ``cpp_extension`` (~25 s, then
cached under ``TORCH_EXTENSIONS_DIR``, with its sha256 recorded beside it and checked before the next load: a module
cut short is built again, never mapped). Without a compiler the kernels decline and the PyTorch functions run; so
they do under the ``torch`` and ``triton`` backends (`backend`), with autograd, and outside the contract (another
dtype, a mask, more than one token): `_kernels` is that rule, once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

from k3export.ops import backend
from k3export.ops.sources import CSRC, binding_sources

NAME = "k3_cpu_decode"
SOURCE = CSRC / "cpu_decode.cpp"
_log = logging.getLogger(__name__)


@functools.cache
def extension() -> Any | None:
    """The compiled kernels, or None (logged once) when they cannot be built here."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        _log.info("building k3export's CPU decode kernels (once; cached by torch.utils.cpp_extension)")
        # torch's build cache hashes only `SOURCE`: a hash of the kernels it includes goes into the flags
        header = hashlib.sha256(b"".join(p.read_bytes() for p in binding_sources(SOURCE)[1:])).hexdigest()[:16]
        _drop_unverified(Path(_get_build_directory(NAME, verbose=False)))
        module = load(NAME, [str(SOURCE)], extra_cflags=["-O3", "-fopenmp-simd", f"-DK3_KERNELS={header}"],
                      verbose=False)
        _record(Path(module.__file__))
        return module
    except Exception as exc:  # no compiler, no headers, a read-only cache: PyTorch runs instead
        _log.warning("k3export: CPU decode kernels unavailable (%s: %s); PyTorch runs them",
                     type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def _digest(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _drop_unverified(folder: Path) -> None:
    """Remove each built module in torch's build `folder` that lacks the sha256 recorded when it was built
    (`_record`), so that torch links it again: one cut short or overwritten would kill the process that maps it
    (SIGBUS)."""
    from k3export.files import file_sha256

    for lib in folder.glob("*.so"):
        try:
            recorded = _digest(lib).read_text(encoding="ascii", errors="replace")[:128].strip()
            if lib.is_file() and not lib.is_symlink() and recorded == file_sha256(lib):
                continue
        except OSError:
            pass
        _log.warning("k3export: %s does not match the digest recorded when it was built; building it again", lib)
        lib.unlink(missing_ok=True)


def _record(lib: Path) -> None:
    """Record the sha256 of the module torch just built or verified (`_drop_unverified` checks it next time)."""
    from k3export.files import file_sha256
    from k3export.safety import write_bytes_atomic

    write_bytes_atomic(lib.parent, _digest(lib).name, file_sha256(lib) + "\n")


def _kernels(*tensors: torch.Tensor) -> Any | None:
    """The compiled kernels when these tensors are theirs to take (the auto backend, fp32 on CPU, no autograd)."""
    if (backend.get_backend() != "auto"
            or not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    return extension()


def kda_layer(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor | None, g: torch.Tensor,
              b: torch.Tensor, gate: torch.Tensor, state: torch.Tensor | None, o_norm: Any, chunk_size: int = 64,
              mask: torch.Tensor | None = None) -> Any:
    """`modeling_k3.kda_layer` for one fp32 token with both states given; NotImplemented otherwise."""
    weight = getattr(o_norm, "weight", None)
    if mask is not None or qkv.shape[1] != 1 or conv_state is None or state is None or weight is None:
        return NotImplemented
    ext = _kernels(qkv, conv_weight, conv_state, g, b, gate, state, weight)
    if ext is None:
        return NotImplemented
    return tuple(ext.kda_layer(qkv, conv_weight, conv_state, g, b, gate, state, weight, o_norm.variance_epsilon))


def attn_res_aggregate(sources: list[torch.Tensor], proj: torch.Tensor, norm: torch.Tensor, eps: float) -> Any:
    """`modeling_k3.attn_res_aggregate` for fp32 sources of one shape; NotImplemented otherwise."""
    ext = _kernels(*sources, proj, norm) if len({s.shape for s in sources}) == 1 else None
    return NotImplemented if ext is None else ext.attn_res_aggregate(sources, proj, norm, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Any:
    """`modeling_k3.rms_norm` for an fp32 x and weight; NotImplemented otherwise."""
    ext = _kernels(x, weight)
    return NotImplemented if ext is None else ext.rms_norm(x, weight, eps)


def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float) -> Any:
    """`modeling_k3.moe_route` for fp32 logits and bias; NotImplemented otherwise."""
    ext = _kernels(logits, bias) if 0 < top_k <= logits.shape[-1] else None
    return NotImplemented if ext is None else tuple(ext.moe_route(logits, bias, top_k, renormalize, scale))


#: name -> kernel for `k3export.modeling.modeling_k3.register_kernel`
KERNELS = {"kda_layer": kda_layer, "attn_res_aggregate": attn_res_aggregate, "rms_norm": rms_norm,
           "moe_route": moe_route}
