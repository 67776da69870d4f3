"""Ahead-of-time compilation of the plugin kernels to PTX (no GPU needed), and the PTX checks TensorRT relies on.

TensorRT launches an AOT plugin kernel (``@trtp.aot_impl``) with the input pointers, then the int32 scalars, then
the output pointers, and nothing else. That order, the names and the dtypes come from the op's spec
(`k3export.ops.spec`): a kernel's arguments must read ``<input>_ptr ..., <scalar> ..., <output>_ptr ...``, then
only constexprs, or `compile_kernel` refuses it. Float attributes and static dims are baked in as constexprs (one
compile per value). Triton >= 3.3 appends two hidden scratch pointers that TensorRT does not pass, so a kernel is
accepted only when both scratch sizes are 0 and its PTX ``.entry`` has exactly that layout (`check_layout`)::

    kern = compile_kernel("kda_recurrent", "bf16", {"scale": 0.125}, {"K": 64, "V": 64})
    kern.entry, kern.ptx, kern.params, kern.block, kern.shared

Under TRITON_INTERPRET=1 (the CPU test set-up) the kernels are interpreter objects, so the compile runs in a child
process with the interpreter off. Nothing here imports k3export.modeling or transformers.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from k3export import dtypes
from k3export.errors import ExportError
from k3export.ops.backend import triton_interpret
from k3export.ops.spec import ALL_SPECS, FLOATS

SM90 = ("cuda", 90, 32)  # H100 / H200, warp size 32: the target the shipped engines are built for
#: plugin kernel -> its op
KERNEL_OPS = {kernel: spec.name for spec in ALL_SPECS.values() for kernel in spec.kernels}
#: op -> the module of `k3export.ops` with its kernels and ``aot_config`` (default: the op's name)
OP_MODULES = {"moe_experts_mxfp4": "moe_experts", "moe_experts_nvfp4": "moe_experts"}
#: tensors a kernel reads as their bytes (it decodes the bit fields): NVFP4's E4M3 scales
_AS_BYTES = {"float8e4m3fn": "uint8"}


class KernelError(ExportError):
    """A plugin kernel that cannot be compiled, or whose PTX TensorRT could not launch correctly."""


@dataclass(frozen=True)
class Kernel:
    """One compiled plugin kernel: what ``aot_impl`` returns, and what the checks read."""

    name: str  # e.g. "kda_recurrent"
    op: str
    entry: str  # PTX .entry name
    ptx: str
    target: tuple
    params: tuple  # (name, Triton type) in launch order: inputs, int32 scalars, outputs
    n_inputs: int
    n_scalars: int
    n_outputs: int
    constexprs: dict
    num_warps: int
    shared: int  # bytes of dynamic shared memory to launch with
    global_scratch: int
    profile_scratch: int

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.num_warps * self.target[2], 1, 1)


def compile_kernel(name: str, dtype: str = "bf16", attrs: dict | None = None, dims: dict | None = None,
                   target: tuple = SM90) -> Kernel:
    """Compile plugin kernel `name` with its op's tensors in `dtype` (where the spec lets them float), the op's
    attributes `attrs` and static dims `dims` baked in, for `target` (backend, arch, warp size)."""
    if name not in KERNEL_OPS:
        raise KernelError(f"unknown plugin kernel {name!r}; expected one of {list(KERNEL_OPS)}")
    spec = ALL_SPECS[KERNEL_OPS[name]]
    float_dtype = dtypes.dtype(dtype).name
    if float_dtype not in FLOATS:
        raise KernelError(f"{name}: dtype {dtype!r}, expected one of {FLOATS}")
    module = importlib.import_module(f"k3export.ops.{OP_MODULES.get(spec.name, spec.name)}")
    fn, const, num_warps = module.aot_config(name, float_dtype, dict(attrs or {}), dict(dims or {}))
    io = spec.io_dtypes(float_dtype)
    ptr = lambda args: [(a.name, "*" + dtypes.dtype(_AS_BYTES.get(io[a.name], io[a.name])).triton)  # noqa: E731
                        for a in args]
    params = tuple(ptr(spec.inputs) + [(s, "i32") for s in spec.scalars] + ptr(spec.outputs))
    args = [a for a in fn.arg_names if a not in const]
    expected = [f"{n}_ptr" if t.startswith("*") else n for n, t in params]
    if args != expected:
        raise KernelError(f"{name}: kernel arguments {args} are not the launch layout of {spec.plugin_id} {expected}")
    signature = {a: t for a, (_, t) in zip(args, params)}
    raw = _compile(fn.__name__, module.__name__, json.dumps(signature), json.dumps(const), tuple(target), num_warps)
    kernel = Kernel(name, spec.name, raw["name"], raw["ptx"], tuple(target), params, len(spec.inputs),
                    len(spec.scalars), len(spec.outputs), dict(const), raw["num_warps"], raw["shared"],
                    raw["global_scratch"], raw["profile_scratch"])
    check_layout(kernel)
    return kernel


def ptx_params(ptx: str, entry: str) -> list[str]:
    """PTX types of the ``.entry`` parameters in order: '.u64 .ptr' for pointers, '.u32' for int32 scalars, ..."""
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, flags=re.S)
    if not m:
        raise KernelError(f"no .entry {entry} found in the PTX")
    out = []
    for decl in filter(None, (d.strip() for d in m.group(1).split(","))):
        tokens = decl.split()
        if tokens[0] != ".param":
            raise KernelError(f"unexpected PTX parameter declaration {decl!r}")
        out.append(f"{tokens[1]} .ptr" if ".ptr" in tokens else tokens[1])
    return out


def check_layout(kernel: Kernel) -> None:
    """KernelError unless the PTX takes (input pointers, int32 scalars, output pointers), then at most Triton's
    two hidden scratch pointers, and both scratch sizes are 0."""
    params = ptx_params(kernel.ptx, kernel.entry)
    n_in, n_sc, n_out = kernel.n_inputs, kernel.n_scalars, kernel.n_outputs
    expected = [".u64 .ptr"] * n_in + [".u32"] * n_sc + [".u64 .ptr"] * n_out
    if params[: len(expected)] != expected:
        raise KernelError(f"{kernel.name}: PTX entry {kernel.entry} takes {params}; TensorRT passes {n_in} input "
                          f"pointers, {n_sc} int32 scalars, {n_out} output pointers ({expected})")
    extra = params[len(expected):]
    if len(extra) > 2 or any(p != ".u64 .ptr" for p in extra):
        raise KernelError(f"{kernel.name}: PTX entry {kernel.entry} has unexpected trailing parameters {extra}")
    if kernel.global_scratch or kernel.profile_scratch:
        raise KernelError(f"{kernel.name}: kernel {kernel.entry} needs scratch memory (global {kernel.global_scratch} B, "
                          f"profile {kernel.profile_scratch} B); TensorRT does not pass Triton's scratch pointers")


@functools.lru_cache(maxsize=256)
def _compile(fn_name: str, module: str, signature: str, const: str, target: tuple, num_warps: int) -> dict:
    """The compile's results as plain data; in a child process without the interpreter when it is on here."""
    args = [fn_name, module, signature, const, list(target), num_warps]
    if not triton_interpret():
        return _compile_here(*args)
    proc = subprocess.run(
        [sys.executable, "-c", "import json, sys; from k3export.ops.aot import _compile_here; "
         "print('\\n@@AOT@@' + json.dumps(_compile_here(*json.loads(sys.argv[1]))))", json.dumps(args)],
        env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0 or "@@AOT@@" not in proc.stdout:
        raise KernelError(f"AOT compile of {fn_name} failed in the child process:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.rsplit("@@AOT@@", 1)[1])


def _compile_here(fn_name: str, module: str, signature: str, const: str, target: list, num_warps: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = json.loads(const)
    sig = {**json.loads(signature), **{c: "constexpr" for c in constexprs}}
    fn = getattr(importlib.import_module(module), fn_name)
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget(*target),
                              options={"num_warps": num_warps})
    md = compiled.metadata
    return {"ptx": compiled.asm["ptx"], "name": md.name, "num_warps": int(md.num_warps), "shared": int(md.shared),
            "global_scratch": int(getattr(md, "global_scratch_size", 0) or 0),
            "profile_scratch": int(getattr(md, "profile_scratch_size", 0) or 0)}
