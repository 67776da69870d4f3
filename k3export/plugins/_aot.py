"""Triton -> PTX for the AOT TensorRT plugins, and checks of the PTX parameter layout.

TensorRT launches an AOT plugin kernel with the device pointers of the inputs, then the int32
scalars of ``aot_impl``'s ``SymIntExprs``, then the output pointers. Triton >= 3.3 appends two hidden
pointer parameters (global and profile scratch) that TensorRT does not pass, so a kernel is only
usable when both scratch sizes are 0. Float attributes are Triton constexprs (baked in), so one
compile serves one attribute value; compiles are cached per (kernel, dtype, constants, target).

``k3export.ops.aot`` (the ops' own AOT module) is used when it provides ``compile_kernel``; otherwise
the kernels of ``k3export.ops`` are compiled here with ``triton.compile(ASTSource(...))``, which needs
no GPU.
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

_TRITON_PTR = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16", "int64": "*i64", "int32": "*i32"}


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


def _require_triton():
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise PluginKernelError(
            f"compiling the k3 plugin kernels needs the `triton` package (pip install 'k3export[triton]'): {exc}"
        ) from None
    return triton, ASTSource, GPUTarget


def _signature(fn: Any, pointer_dtypes: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    """Triton signature: pointers by name from `pointer_dtypes`, other non-constexpr params int32."""
    sig = {}
    for p in fn.params:
        if p.is_constexpr or p.name in constexprs:
            sig[p.name] = "constexpr"
        elif p.name in pointer_dtypes:
            sig[p.name] = _TRITON_PTR[rules.dtype_name(pointer_dtypes[p.name])]
        else:
            sig[p.name] = "i32"
    return sig


@functools.lru_cache(maxsize=256)
def _compile_cached(op: str, kernel_key: str, ptr_items: tuple, const_items: tuple, num_warps: int,
                    target: tuple, counts: tuple[int, int, int]) -> PluginKernel:
    triton, ASTSource, GPUTarget = _require_triton()
    fn = _kernel_fn(kernel_key)
    constexprs = dict(const_items)
    src = ASTSource(fn=fn, signature=_signature(fn, dict(ptr_items), constexprs), constexprs=constexprs)
    try:
        compiled = triton.compile(src, target=GPUTarget(*target), options={"num_warps": num_warps})
    except Exception as exc:
        raise PluginKernelError(f"Triton could not compile {kernel_key} for {target}: {exc}") from exc
    md = compiled.metadata
    kernel = PluginKernel(
        op=op,
        name=md.name,
        ptx=compiled.asm["ptx"],
        num_warps=int(md.num_warps),
        shared=int(md.shared),
        global_scratch=int(getattr(md, "global_scratch_size", 0) or 0),
        profile_scratch=int(getattr(md, "profile_scratch_size", 0) or 0),
        n_inputs=counts[0],
        n_scalars=counts[1],
        n_outputs=counts[2],
    )
    check_plugin_layout(kernel)
    return kernel


def _kernel_fn(key: str) -> Any:
    """The @triton.jit function of a plugin kernel, from k3export.ops."""
    module_name, attr = {
        "kda_recurrent": ("kda", "kda_recurrent_kernel"),
        "kda_chunk": ("kda", "kda_chunk_kernel"),
        "situ_glu": ("situ_glu", "situ_glu_kernel"),
        "moe_route": ("moe_route", "moe_route_kernel"),
    }[key]
    import importlib

    try:
        module = importlib.import_module(f"k3export.ops.{module_name}")
    except ImportError as exc:
        raise PluginKernelError(f"k3export.ops.{module_name} is not available: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise PluginKernelError(f"k3export.ops.{module_name} has no Triton kernel {attr} (is triton installed?)")
    return fn


def compile_kda(dtype: Any, K: int, V: int, scale: float, tactic: int = rules.KDA_TACTIC_RECURRENT,
                target: tuple = DEFAULT_TARGET) -> tuple[PluginKernel, dict[str, Any]]:
    """PTX of the KDA kernel a tactic runs (recurrent or chunked), with q/k/v/o in `dtype`."""
    cfg = rules.kda_kernel_config(K, V, dtype, tactic)
    d = rules.dtype_name(dtype)
    ptrs = {"q_ptr": d, "k_ptr": d, "v_ptr": d, "g_ptr": "float32", "beta_ptr": "float32", "h0_ptr": "float32",
            "o_ptr": d, "ht_ptr": "float32"}
    consts = {"K": int(K), "V": int(V), "BK": cfg["BK"], "BV": cfg["BV"], "SCALE": float(scale)}
    if cfg["kernel"] == "kda_chunk":
        consts.update(BT=cfg["BT"], BC=cfg["BC"], DOT_PRECISION=cfg["DOT_PRECISION"])
    kernel = _compile_cached("kda", cfg["kernel"], tuple(sorted(ptrs.items())), tuple(sorted(consts.items())),
                             int(cfg["num_warps"]), tuple(target), (6, 2, 2))
    return kernel, cfg


def _fill_constexprs(op: str, fn: Any, known: dict[str, Any]) -> dict[str, Any]:
    """Values of the kernel's constexpr params, matched by name (case-insensitive) against `known`."""
    lower = {k.lower(): v for k, v in known.items()}
    out = {}
    for p in fn.params:
        if not p.is_constexpr:
            continue
        key = p.name.lower()
        if key in lower:
            out[p.name] = lower[key]
        elif getattr(p, "has_default", False):
            continue  # the kernel's own default
        else:
            raise PluginKernelError(
                f"{op}: the Triton kernel's constexpr {p.name!r} has no value in the plugin ({sorted(known)})"
            )
    return out


def _split_params(op: str, fn: Any, n_in: int, n_sc: int, n_out: int) -> tuple[list[str], list[str], list[str]]:
    names = [p.name for p in fn.params if not p.is_constexpr]
    if len(names) != n_in + n_sc + n_out:
        raise PluginKernelError(
            f"{op}: the Triton kernel takes {names}; the plugin passes {n_in} inputs, {n_sc} int32 scalars, "
            f"{n_out} outputs"
        )
    return names[:n_in], names[n_in:n_in + n_sc], names[n_in + n_sc:]


def _launch_config(op: str, *args: Any) -> dict[str, Any]:
    import importlib

    module = importlib.import_module(f"k3export.ops.{op}")
    fn = getattr(module, f"{op}_launch_config", None)
    return dict(fn(*args)) if fn is not None else {}


def compile_situ_glu(dtype: Any, beta1: float, beta2: float,
                     target: tuple = DEFAULT_TARGET) -> tuple[PluginKernel, dict[str, Any]]:
    """PTX of the elementwise SiTU-GLU kernel (gate, up | numel | out) with beta1/beta2 baked in."""
    fn = _kernel_fn("situ_glu")
    ins, _, outs = _split_params("situ_glu", fn, 2, 1, 1)
    d = rules.dtype_name(dtype)
    cfg = {"BLOCK": 1024, "num_warps": 4}
    try:
        cfg.update(_launch_config("situ_glu"))
    except TypeError:
        pass
    block = int(cfg.get("BLOCK", cfg.get("BLOCK_SIZE", 1024)))
    known = {"beta1": float(beta1), "beta2": float(beta2), "BLOCK": block, "BLOCK_SIZE": block}
    known.update({k: v for k, v in cfg.items() if k != "num_warps"})
    consts = _fill_constexprs("situ_glu", fn, known)
    ptrs = {n: d for n in ins + outs}
    kernel = _compile_cached("situ_glu", "situ_glu", tuple(sorted(ptrs.items())), tuple(sorted(consts.items())),
                             int(cfg.get("num_warps", 4)), tuple(target), (2, 1, 1))
    return kernel, {"BLOCK": block, **cfg}


def compile_moe_route(E: int, top_k: int, renormalize: int, scale: float,
                      target: tuple = DEFAULT_TARGET) -> tuple[PluginKernel, dict[str, Any]]:
    """PTX of the router kernel (logits, bias | N | weights, indices int64) with E, top_k, renormalize
    and scale baked in."""
    fn = _kernel_fn("moe_route")
    ins, _, outs = _split_params("moe_route", fn, 2, 1, 2)
    cfg: dict[str, Any] = {"num_warps": 4}
    cfg.update(_launch_config("moe_route", int(E), int(top_k)))
    from k3export.ops._common import next_pow2

    known = {"E": int(E), "TOP_K": int(top_k), "K": int(top_k), "RENORMALIZE": int(bool(renormalize)),
             "SCALE": float(scale), "BE": next_pow2(E), "BLOCK_E": next_pow2(E), "ROWS": 1, "BLOCK_N": 1}
    known.update({k: v for k, v in cfg.items() if k != "num_warps"})
    consts = _fill_constexprs("moe_route", fn, known)
    ptrs = {ins[0]: "float32", ins[1]: "float32", outs[0]: "float32", outs[1]: "int64"}
    kernel = _compile_cached("moe_route", "moe_route", tuple(sorted(ptrs.items())), tuple(sorted(consts.items())),
                             int(cfg.get("num_warps", 4)), tuple(target), (2, 1, 2))
    rows = int(next((consts[k] for k in consts if k.upper() in ("ROWS", "BLOCK_N", "BLOCK_M")), 1))
    return kernel, {"ROWS": rows, **cfg}
