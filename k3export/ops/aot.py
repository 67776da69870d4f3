"""Ahead-of-time compilation of the plugin-bound Triton kernels to PTX (no GPU needed).

TensorRT AOT Python plugins (``@trtp.aot_impl``) launch a kernel with: the input pointers, then
the int32 scalars (``SymIntExprs``), then the output pointers - nothing else. Every kernel listed
here has exactly that parameter order; float / bool attributes and head dims are baked in as
``tl.constexpr``. Triton >= 3.3 appends two hidden pointers (global and profile scratch) that
TensorRT does not pass, so ``compile_kernel`` asserts both scratch sizes are 0.

    from k3export.ops.aot import compile_kernel, list_plugin_kernels
    kern = compile_kernel("kda_recurrent", head_dim=128, scale=128 ** -0.5)
    kern.ptx, kern.kernel_name, kern.params, kern.grid(B=1, T=1, H=96)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys
import types
from typing import Callable

PLUGIN_KERNELS = ("kda_recurrent", "kda_chunk", "situ_glu", "moe_route")

_TORCH_TO_TRITON = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}


@dataclasses.dataclass(frozen=True)
class AotParam:
    name: str
    kind: str  # "input" | "int32" | "output"
    dtype: str  # Triton signature type: "*bf16", "*fp32", "*i64", "i32"
    meaning: str  # shape / value the plugin passes


@dataclasses.dataclass(frozen=True)
class AotKernel:
    """Everything a TensorRT ``aot_impl`` needs to launch one compiled kernel."""

    name: str  # plugin-bound kernel name in this project (e.g. "kda_recurrent")
    kernel_name: str  # PTX entry name
    ptx: str
    target: tuple  # ("cuda", arch, warp_size)
    params: tuple  # AotParam, in launch order: inputs, int32 scalars, outputs
    constexprs: dict  # baked attributes
    num_warps: int
    shared_mem: int  # bytes of dynamic shared memory to launch with
    global_scratch_size: int
    profile_scratch_size: int
    grid_rule: str  # the launch grid as a formula of the shapes
    grid_fn: Callable[..., tuple]  # grid(**dims) -> (x, y, z)
    block: tuple  # threads per block (num_warps * warp_size, 1, 1)
    ptx_param_count: int  # parameters in the PTX entry (incl. Triton's hidden scratch pointers)

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def input_names(self) -> list[str]:
        return [p.name for p in self.params if p.kind == "input"]

    @property
    def int32_scalar_names(self) -> list[str]:
        return [p.name for p in self.params if p.kind == "int32"]

    @property
    def output_names(self) -> list[str]:
        return [p.name for p in self.params if p.kind == "output"]

    def grid(self, **dims) -> tuple:
        return tuple(int(x) for x in self.grid_fn(**dims))


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _spec(name: str, *, dtype: str, head_dim: int, head_dim_v: int | None, scale: float | None,
          beta_dtype: str, beta1: float, beta2: float, num_experts: int, top_k: int,
          renormalize: bool, route_scale: float):
    """(kernel fn, params, constexprs, num_warps, grid_rule, grid_fn) for one plugin kernel."""
    t = _TORCH_TO_TRITON[dtype]
    if name in ("kda_recurrent", "kda_chunk"):
        import torch

        m = importlib.import_module("k3export.ops.kda")

        K = int(head_dim)
        V = int(head_dim_v or head_dim)
        sc = float(K ** -0.5 if scale is None else scale)
        bt = _TORCH_TO_TRITON[beta_dtype]
        params = (
            AotParam("q", "input", f"*{t}", "[B, T, H, K] contiguous, L2-normalised, unscaled"),
            AotParam("k", "input", f"*{t}", "[B, T, H, K] contiguous"),
            AotParam("v", "input", f"*{t}", "[B, T, H, V] contiguous"),
            AotParam("g", "input", "*fp32", "[B, T, H, K] log-decay <= 0"),
            AotParam("beta", "input", f"*{bt}", "[B, T, H]"),
            AotParam("initial_state", "input", "*fp32", "[B, H, K, V]"),
            AotParam("T", "int32", "i32", "q.shape[1]"),
            AotParam("H", "int32", "i32", "q.shape[2]"),
            AotParam("o", "output", f"*{t}", "[B, T, H, V]"),
            AotParam("final_state", "output", "*fp32", "[B, H, K, V]"),
        )
        if name == "kda_recurrent":
            cfg = m.recurrent_launch_config(K, V)
            fn = m.kda_recurrent_kernel
            const = {"K": K, "V": V, "BK": cfg["BK"], "BV": cfg["BV"], "SCALE": sc}
        else:
            tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[t]
            cfg = m.chunk_launch_config(K, V, tdt)
            fn = m.kda_chunk_kernel
            const = {"K": K, "V": V, "BK": cfg["BK"], "BV": cfg["BV"], "SCALE": sc, "BT": cfg["BT"],
                     "BC": cfg["BC"], "DOT_PRECISION": cfg["DOT_PRECISION"]}
        BV = cfg["BV"]
        rule = f"grid = (ceil(V / {BV}), B * H, 1) with V = {V}; block = (32 * num_warps, 1, 1)"
        return fn, params, const, cfg["num_warps"], rule, (lambda B, H, **_: (_cdiv(V, BV), B * H, 1))
    if name == "situ_glu":
        m = importlib.import_module("k3export.ops.situ_glu")

        params = (
            AotParam("gate", "input", f"*{t}", "any shape, contiguous"),
            AotParam("up", "input", f"*{t}", "same shape as gate"),
            AotParam("N", "int32", "i32", "gate.numel()"),
            AotParam("out", "output", f"*{t}", "same shape as gate"),
        )
        const = {"BETA1": float(beta1), "BETA2": float(beta2), "BLOCK": m.BLOCK}
        rule = f"grid = (ceil(N / {m.BLOCK}), 1, 1) with N = gate.numel()"
        return m.situ_glu_kernel, params, const, 4, rule, (lambda N, **_: (_cdiv(N, m.BLOCK), 1, 1))
    if name == "moe_route":
        m = importlib.import_module("k3export.ops.moe_route")

        E, k = int(num_experts), int(top_k)
        if not (1 <= k <= min(E, m.MAX_TOP_K)) or E > m.MAX_EXPERTS:
            raise ValueError(f"moe_route AOT: need 1 <= top_k <= min(E, {m.MAX_TOP_K}) and E <= {m.MAX_EXPERTS}, got E={E}, top_k={k}")
        cfg = m.launch_config(E, k)
        params = (
            AotParam("logits", "input", "*fp32", f"[N, E={E}] contiguous"),
            AotParam("bias", "input", "*fp32", f"[E={E}]"),
            AotParam("weights", "output", "*fp32", f"[N, top_k={k}]"),
            AotParam("indices", "output", "*i64", f"[N, top_k={k}]"),
        )
        const = {"E": E, "BLOCK_E": cfg["BLOCK_E"], "TOP_K": k, "BLOCK_K": cfg["BLOCK_K"],
                 "RENORMALIZE": bool(renormalize), "SCALE": float(route_scale)}
        rule = "grid = (N, 1, 1) with N = logits.shape[0] (one program per token row)"
        return m.moe_route_kernel, params, const, cfg["num_warps"], rule, (lambda N, **_: (int(N), 1, 1))
    raise ValueError(f"unknown plugin kernel {name!r}; expected one of {PLUGIN_KERNELS}")


def compile_kernel(
    name: str,
    target: tuple = ("cuda", 90, 32),
    *,
    dtype: str = "bf16",
    head_dim: int = 128,
    head_dim_v: int | None = None,
    scale: float | None = None,
    beta_dtype: str = "fp32",
    beta1: float = 4.0,
    beta2: float = 25.0,
    num_experts: int = 896,
    top_k: int = 16,
    renormalize: bool = True,
    route_scale: float = 1.0,
) -> AotKernel:
    """Compile one plugin-bound kernel for ``target`` (backend, arch, warp size) to PTX."""
    if dtype not in _TORCH_TO_TRITON:
        raise ValueError(f"dtype: expected one of {sorted(_TORCH_TO_TRITON)}, got {dtype!r}")
    fn, params, const, num_warps, rule, grid_fn = _spec(
        name, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, scale=scale, beta_dtype=beta_dtype,
        beta1=beta1, beta2=beta2, num_experts=num_experts, top_k=top_k, renormalize=renormalize,
        route_scale=route_scale,
    )
    # the kernel's runtime parameters must be exactly inputs, int32 scalars, outputs
    runtime_args = [a for a in fn.arg_names if a not in const]
    declared = [p.name for p in params]
    kinds = [p.kind for p in params]
    if len(runtime_args) != len(declared) or kinds != sorted(kinds, key=("input", "int32", "output").index):
        raise AssertionError(f"{name}: kernel args {runtime_args} do not match the plugin layout {declared}")
    signature = {a: p.dtype for a, p in zip(runtime_args, params)}
    backend, arch, warp = target
    raw = _compile_raw(fn.__name__, _module_of(name), json.dumps(signature), json.dumps(const),
                       backend, int(arch), int(warp), num_warps)
    gs, ps = raw["global_scratch_size"], raw["profile_scratch_size"]
    if gs or ps:
        raise AssertionError(f"{name}: global scratch {gs} B / profile scratch {ps} B must be 0 for a TensorRT plugin")
    ptx = raw["ptx"]
    entry = raw["name"]
    n_ptx = _count_ptx_params(ptx, entry)
    md = types.SimpleNamespace(num_warps=raw["num_warps"], shared=raw["shared"])
    # rename params by position (PTX names are <entry>_param_<i>) for the report
    named = tuple(dataclasses.replace(p, name=a) for a, p in zip(runtime_args, params))
    return AotKernel(
        name=name,
        kernel_name=entry,
        ptx=ptx,
        target=(backend, int(arch), int(warp)),
        params=named,
        constexprs=dict(const),
        num_warps=int(md.num_warps),
        shared_mem=int(md.shared),
        global_scratch_size=gs,
        profile_scratch_size=ps,
        grid_rule=rule,
        grid_fn=grid_fn,
        block=(int(md.num_warps) * int(warp), 1, 1),
        ptx_param_count=n_ptx,
    )


def _module_of(name: str) -> str:
    return "k3export.ops." + ("kda" if name.startswith("kda") else name)


@functools.lru_cache(maxsize=64)
def _compile_raw(fn_name: str, module: str, signature_json: str, const_json: str, backend: str, arch: int,
                 warp: int, num_warps: int) -> dict:
    """Compile and return the metadata as plain data. Under TRITON_INTERPRET=1 the kernels (and
    triton.language's own jit helpers) are interpreter objects that cannot be compiled, so the
    compile runs in a child process with the interpreter off."""
    args = [fn_name, module, signature_json, const_json, backend, arch, warp, num_warps]
    from k3export.ops.backend import triton_interpret

    if not triton_interpret():
        return _compile_here(*args)
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-c", "import json, sys; from k3export.ops.aot import _compile_here; "
         "print('\\n@@AOT@@' + json.dumps(_compile_here(*json.loads(sys.argv[1]))))", json.dumps(args)],
        env=env, capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0 or "@@AOT@@" not in proc.stdout:
        raise RuntimeError(f"AOT compile of {fn_name} failed in the child process:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.rsplit("@@AOT@@", 1)[1])


def _compile_here(fn_name, module, signature_json, const_json, backend, arch, warp, num_warps) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _as_jit_function(getattr(importlib.import_module(module), fn_name))
    const = json.loads(const_json)
    signature = json.loads(signature_json)
    signature.update({c: "constexpr" for c in const})
    src = ASTSource(fn=fn, signature=signature, constexprs=const)
    compiled = triton.compile(src, target=GPUTarget(backend, arch, warp), options={"num_warps": num_warps})
    md = compiled.metadata
    return {
        "ptx": compiled.asm["ptx"],
        "name": md.name,
        "num_warps": int(md.num_warps),
        "shared": int(md.shared),
        "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0),
        "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0) or 0),
    }


def _as_jit_function(fn):
    """Under TRITON_INTERPRET=1 ``@triton.jit`` returns an InterpretedFunction; AOT compilation
    needs a JITFunction of the same Python function (kernels here call no other jit functions)."""
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    inner = getattr(fn, "fn", None)
    if inner is None:
        raise TypeError(f"not a Triton kernel: {fn!r}")
    return JITFunction(inner)


def _count_ptx_params(ptx: str, entry: str) -> int:
    start = ptx.find(f".entry {entry}(")
    if start < 0:
        raise AssertionError(f"PTX has no entry {entry!r}")
    end = ptx.find(")", start)
    return ptx[start:end].count(".param")


def list_plugin_kernels() -> list[str]:
    """Names accepted by ``compile_kernel``: the kernels a TensorRT plugin launches."""
    return list(PLUGIN_KERNELS)


def describe(kern: AotKernel) -> str:
    """One human-readable block: entry, parameter layout, grid, warps, shared memory."""
    lines = [f"{kern.name}: entry {kern.kernel_name}, target {kern.target}, num_warps {kern.num_warps}, "
             f"shared {kern.shared_mem} B, scratch {kern.global_scratch_size}/{kern.profile_scratch_size} B"]
    for i, p in enumerate(kern.params):
        lines.append(f"  {i}: {p.kind:6s} {p.name:14s} {p.dtype:6s} {p.meaning}")
    lines.append(f"  constexprs: {kern.constexprs}")
    lines.append(f"  {kern.grid_rule}")
    return "\n".join(lines)


