"""Triton -> PTX for the AOT TensorRT plugins, and checks of the PTX parameter layout.

TensorRT launches an AOT plugin kernel with the device pointers of the inputs, then the int32
scalars of ``aot_impl``'s ``SymIntExprs``, then the output pointers. Triton >= 3.3 appends two hidden
pointer parameters (global and profile scratch) that TensorRT does not pass, so a kernel is only
usable when both scratch sizes are 0. Float attributes are Triton constexprs (baked in), so one
compile serves one attribute value; compiles are cached per (kernel, dtype, constants, target).

The compile itself is ``k3export.ops.aot.compile_kernel`` (the ops' own AOT module: Triton
``ASTSource`` -> PTX, no GPU needed); this module picks the kernel and baked constants for a plugin
call, and re-checks the PTX ``.entry`` parameter list independently of it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from k3export.errors import ExportError

from . import rules

#: sm_90 (H100/H200), warp size 32: the target the shipped engines are built for
DEFAULT_TARGET = ("cuda", 90, 32)

class PluginKernelError(ExportError):
    """A plugin kernel that cannot be compiled, or whose PTX TensorRT could not launch correctly."""


@dataclass(frozen=True)
class PluginKernel:
    """One compiled plugin kernel: what ``aot_impl`` returns, plus what the checks need."""

    op: str
    name: str  # PTX .entry name
    ptx: str
    num_warps: int
    shared: int  # bytes of dynamic shared memory
    global_scratch: int
    profile_scratch: int
    n_inputs: int
    n_scalars: int
    n_outputs: int

    @property
    def block_x(self) -> int:
        return self.num_warps * 32


def ptx_entry_params(ptx: str, name: str | None = None) -> list[str]:
    """PTX types of the ``.entry`` parameters, in order, e.g. ['.u64 .ptr', ..., '.u32', ...].

    Pointer parameters read '.u64 .ptr' (Triton marks them ``.ptr .global``), scalars '.u32' / '.f32' ..."""
    pattern = r"\.entry\s+" + (re.escape(name) if name else r"([A-Za-z_$][\w$]*)") + r"\s*\((.*?)\)"
    m = re.search(pattern, ptx, flags=re.S)
    if not m:
        raise PluginKernelError(f"no .entry {name or ''} found in the PTX")
    body = m.group(m.lastindex)
    out = []
    for line in body.split(","):
        line = line.strip()
        if not line:
            continue
        tokens = line.split()
        if tokens[0] != ".param":
            raise PluginKernelError(f"unexpected PTX parameter declaration {line!r}")
        typ = tokens[1]
        out.append(f"{typ} .ptr" if ".ptr" in tokens else typ)
    return out


def check_plugin_layout(kernel: PluginKernel) -> None:
    """Raise PluginKernelError unless the PTX takes (input pointers, int32 scalars, output pointers)
    in that order, followed only by Triton's hidden scratch pointers, and both scratch sizes are 0."""
    params = ptx_entry_params(kernel.ptx, kernel.name)
    n_in, n_sc, n_out = kernel.n_inputs, kernel.n_scalars, kernel.n_outputs
    expected = [".u64 .ptr"] * n_in + [".u32"] * n_sc + [".u64 .ptr"] * n_out
    head = params[: len(expected)]
    if head != expected:
        raise PluginKernelError(
            f"{kernel.op}: PTX entry {kernel.name} takes {params}; TensorRT passes {n_in} input pointers, "
            f"{n_sc} int32 scalars, {n_out} output pointers ({expected})"
        )
    extra = params[len(expected):]
    if any(p != ".u64 .ptr" for p in extra) or len(extra) > 2:
        raise PluginKernelError(f"{kernel.op}: PTX entry {kernel.name} has unexpected trailing parameters {extra}")
    if kernel.global_scratch or kernel.profile_scratch:
        raise PluginKernelError(
            f"{kernel.op}: kernel {kernel.name} needs scratch memory (global {kernel.global_scratch} B, "
            f"profile {kernel.profile_scratch} B); TensorRT does not pass Triton's scratch pointers"
        )


def _ops_aot():
    try:
        from k3export.ops import aot
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise PluginKernelError(f"k3export.ops.aot is not importable: {exc}") from None
    return aot


@functools.lru_cache(maxsize=256)
def compile_plugin_kernel(op: str, kernel: str, target: tuple = DEFAULT_TARGET,
                          **options: Any) -> tuple[PluginKernel, Any]:
    """Compile one plugin kernel with ``k3export.ops.aot.compile_kernel`` and check its PTX layout.

    Returns (PluginKernel, the ops' AotKernel: constexprs, grid rule, parameter meanings)."""
    try:
        aot_kernel = _ops_aot().compile_kernel(kernel, tuple(target), **options)
    except PluginKernelError:
        raise
    except Exception as exc:
        raise PluginKernelError(f"k3::{op}: could not compile Triton kernel {kernel} for {target}: {exc}") from exc
    pk = PluginKernel(
        op=op,
        name=aot_kernel.kernel_name,
        ptx=aot_kernel.ptx,
        num_warps=int(aot_kernel.num_warps),
        shared=int(aot_kernel.shared_mem),
        global_scratch=int(aot_kernel.global_scratch_size),
        profile_scratch=int(aot_kernel.profile_scratch_size),
        n_inputs=len(aot_kernel.input_names),
        n_scalars=len(aot_kernel.int32_scalar_names),
        n_outputs=len(aot_kernel.output_names),
    )
    spec = rules.PLUGINS[op]
    if (pk.n_inputs, pk.n_outputs) != (len(spec.inputs), len(spec.outputs)):
        raise PluginKernelError(
            f"k3::{op}: kernel {kernel} takes {pk.n_inputs} inputs / {pk.n_outputs} outputs, the plugin has "
            f"{len(spec.inputs)} / {len(spec.outputs)}"
        )
    check_plugin_layout(pk)
    return pk, aot_kernel


def _triton_dtype(dtype: Any) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[rules.dtype_name(dtype)]


def compile_kda(dtype: Any, K: int, V: int, scale: float, tactic: int = rules.KDA_TACTIC_RECURRENT,
                target: tuple = DEFAULT_TARGET) -> tuple[PluginKernel, dict[str, Any]]:
    """The KDA kernel a tactic runs (recurrent or chunked), q/k/v/o in `dtype`, ``scale`` baked in.

    Returns (kernel, its constexprs: BV is the v-block of the grid)."""
    kernel = rules.kda_kernel_for_tactic(tactic)
    pk, ak = compile_plugin_kernel("kda", kernel, tuple(target), dtype=_triton_dtype(dtype), head_dim=int(K),
                                   head_dim_v=int(V), scale=float(scale), beta_dtype="fp32")
    return pk, dict(ak.constexprs)


def compile_situ_glu(dtype: Any, beta1: float, beta2: float,
                     target: tuple = DEFAULT_TARGET) -> tuple[PluginKernel, dict[str, Any]]:
    """The elementwise SiTU-GLU kernel (gate, up | N | out) with beta1/beta2 baked in."""
    pk, ak = compile_plugin_kernel("situ_glu", "situ_glu", tuple(target), dtype=_triton_dtype(dtype),
                                   beta1=float(beta1), beta2=float(beta2))
    return pk, dict(ak.constexprs)


def compile_moe_route(E: int, top_k: int, renormalize: int, scale: float,
                      target: tuple = DEFAULT_TARGET) -> tuple[PluginKernel, dict[str, Any]]:
    """The router kernel (logits, bias | - | weights, indices int64), one program per token row,
    with E, top_k, renormalize and scale baked in."""
    pk, ak = compile_plugin_kernel("moe_route", "moe_route", tuple(target), dtype="fp32", num_experts=int(E),
                                   top_k=int(top_k), renormalize=bool(renormalize), route_scale=float(scale))
    return pk, dict(ak.constexprs)


def aot_result(trtp: Any, kernel: PluginKernel, plan: dict[str, Any]) -> tuple:
    """What an ``aot_impl`` returns: (kernel name, PTX, launch params, int32 scalars) for `plan`
    (``{"grid": (x, y, z), "scalars": [...]}`` from the launch rules in ``rules``)."""
    launch = trtp.KernelLaunchParams()
    launch.grid_x, launch.grid_y, launch.grid_z = plan["grid"]
    launch.block_x = kernel.block_x
    launch.shared_mem = kernel.shared
    scalars = trtp.SymIntExprs(len(plan["scalars"]))
    for i, s in enumerate(plan["scalars"]):
        scalars[i] = trtp.SymInt32(s)
    return kernel.name, kernel.ptx, launch, scalars
