"""What the k3 TensorRT plugins add to the ops' contracts, as plain Python (nothing here imports TensorRT).

Inputs, outputs, attributes and the shape / dtype rules are the op specs (`k3export.ops.spec`); grids and int32
scalars are the ops' own ``launch`` rules; kernels come from `k3export.ops.aot`. Each plugin module (``kda.py``,
``situ_glu.py``, ``moe_route.py``, ``moe_experts.py``, ``moe_experts_mxfp4.py``) says once, as `kernel` / `grid` /
`tactic` functions, which kernel runs for a tactic and how it is launched; both plugin APIs call them (the
``tensorrt.plugin`` decorators of ``define`` and the class-based ``IPluginV3`` of `k3export.plugins.v3`), so CI
checks the same code without TensorRT.
Shapes may hold TensorRT's symbolic ``ShapeExpr`` dims: the spec only rearranges them and compares ints.
"""

from __future__ import annotations

from typing import Any, Iterator

import contextlib
import sys

from k3export.dtypes import dtype
from k3export.ops import aot
from k3export.ops.kda import kda_algorithm
from k3export.ops.spec import ALL_SPECS, FLOATS, NAMESPACE, SPECS, OpInputError, OpSpec

PLUGIN_NAMESPACE = NAMESPACE
PLUGIN_VERSION = "1"
#: ONNX node attributes the TensorRT parser reads itself and does not forward to the plugin
PARSER_CONTROL_ATTRS = frozenset({"plugin_namespace", "plugin_version", "aot"})
AUTOTUNE_LAYOUT = "LINEAR"

#: KDA tactic per algorithm (TensorRT's default tactic 0 runs the recurrent kernel)
KDA_TACTICS = {"recurrent": 1, "chunk": 2}
#: dynamic shared memory a kernel may use without cudaFuncSetAttribute(MaxDynamicSharedMemorySize); the TensorRT
#: AOT launcher is not documented to raise that limit, so a kernel above it is not offered.
MAX_DEFAULT_SHARED_BYTES = 48 * 1024
#: TensorRT's ONNX parser turns UINT8 initializers into INT32 and keeps INT8 ones (TensorRT-RTX 1.7: "UINT8 data ...
#: is being converted to INT32"), so the bytes a spec declares uint8 (MXFP4's packed E2M1 and E8M0 scales) travel
#: through TensorRT as int8 over the same bytes; the kernels read them as uint8 all the same
SPEC_BYTES, TRT_BYTES = "uint8", "int8"
#: the spec dtypes that travel as `TRT_BYTES` over their bytes: the uint8 bytes, and NVFP4's E4M3 scales (TensorRT's
#: FP8 type would be cast, not reinterpreted; the kernel decodes the bit fields)
BYTE_SPECS = (SPEC_BYTES, "float8e4m3fn")
#: (major, minor) the plugin kernels are compiled for outside a build (`kernels_for`)
_kernel_target: list[tuple[int, int]] = [(aot.SM90[1] // 10, aot.SM90[1] % 10)]


def trt_dtype(name: str) -> str:
    """The dtype TensorRT holds a tensor of spec dtype `name` in (`TRT_BYTES` for the spec's bytes)."""
    return TRT_BYTES if dtype(name).name in BYTE_SPECS else dtype(name).name


def spec_dtype(arg: Any, name: str) -> str:
    """The spec's dtype of `arg` seen in TensorRT as `name`: `arg`'s own for the byte carrier (`BYTE_SPECS`), else
    `name`."""
    name = dtype(name).name
    return arg.dtype if name == TRT_BYTES and arg.dtype in BYTE_SPECS else name


@contextlib.contextmanager
def kernels_for(cc: tuple[int, int]) -> Iterator[None]:
    """Compile the plugin kernels for compute capability `cc` while the block runs (one build's target); the
    previous target comes back after it, so a build for one GPU never leaks into the next."""
    before = _kernel_target[0]
    _kernel_target[0] = (int(cc[0]), int(cc[1]))
    try:
        yield
    finally:
        _kernel_target[0] = before


def kernel_target() -> tuple:
    """The `k3export.ops.aot` target (backend, arch, warp size) of the current build's compute capability."""
    major, minor = _kernel_target[0]
    return ("cuda", major * 10 + minor, aot.SM90[2])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def trt_type(name: str) -> str:
    """``AutoTuneCombination``'s spelling of a dtype (FP32, FP16, else the ``trt.DataType`` member name); the spec's
    bytes as TensorRT holds them (`trt_dtype`)."""
    trt_name = dtype(trt_dtype(name)).trt_name
    return {"FLOAT": "FP32", "HALF": "FP16"}.get(trt_name, trt_name)


def autotune_types(spec: OpSpec) -> str:
    """The io types of ``AutoTuneCombination`` (inputs, then outputs) from the spec: a floating tensor and every
    tensor typed like it take the same entry of the dependent list FP32|BF16|FP16."""
    floats = "|".join(trt_type(n) for n in FLOATS)
    return ", ".join(floats if a.dtype == "float" or a.dtype.startswith("=") else
                     "|".join(trt_type(n) for n in spec.allowed(a, {})) for a in spec.inputs + spec.outputs)


def output_descs(trtp: Any, spec: OpSpec, inputs: tuple, attrs: dict) -> tuple:
    """The output ``TensorDesc``s of a plugin: the spec's checks, output shapes and dtypes on the input descs."""
    shapes = [tuple(d.shape_expr) for d in inputs]
    dtypes = [spec_dtype(a, d.dtype) for a, d in zip(spec.inputs, inputs)]
    spec.check(shapes, dtypes, attrs)
    return tuple(trtp.from_shape_expr(s, dtype=dtype(n).trt)
                 for s, n in zip(spec.output_shapes(shapes, attrs), spec.output_dtypes(dtypes)))


def static_dims(spec: OpSpec, **dims: Any) -> dict[str, int]:
    """Build-time values of dims compiled into a kernel; OpInputError when one is dynamic in the network."""
    out = {}
    for name, d in dims.items():
        if isinstance(d, int):
            out[name] = d
        elif d is not None and not d.is_fake and d.is_constant:
            out[name] = d.constant_value()
        else:
            raise OpInputError(f"{spec.plugin_id}: {name} must be static in the network (it is compiled into the kernel)")
    return out


def profile_max(shape: Any, axis: int) -> int:
    """The largest value of dim `axis` in the profile being tuned (its value when static; -1 when unknown)."""
    if int(shape[axis]) >= 0:
        return int(shape[axis])
    try:
        return int(shape.max[axis])
    except Exception:  # older tensorrt.plugin: no profile bounds in autotune
        return -1


def kda_tactic(t_max: int, chunk_shared: int | None) -> int:
    """The KDA tactic for a profile whose largest T is `t_max`: the kernel `kda_algorithm` picks, except that the
    recurrent kernel (correct for any T) runs when the chunk kernel did not compile (`chunk_shared` None) or needs
    more than the default shared memory."""
    algorithm = kda_algorithm(t_max)
    if algorithm == "chunk" and (chunk_shared is None or chunk_shared > MAX_DEFAULT_SHARED_BYTES):
        algorithm = "recurrent"
    return KDA_TACTICS[algorithm]


def kda_kernel(tactic: int) -> str:
    """The kernel a KDA tactic launches."""
    names = {0: "recurrent", **{t: a for a, t in KDA_TACTICS.items()}}
    if tactic not in names:
        raise OpInputError(f"k3::kda: unknown tactic {tactic} ({KDA_TACTICS})")
    return f"kda_{names[tactic]}"


def moe_experts_kernel(spec: OpSpec, float_dtype: str, attrs: dict, shapes: list, target: tuple) -> Any:
    """The kernel of ``k3::moe_experts`` and ``k3::moe_experts_mxfp4``: the spec's kernel with E, I, D, top_k (static in
    the network) and the attributes baked in; KernelError when it needs more than the default shared memory."""
    (N, D), (_, top_k), (E, I) = shapes[0], shapes[1], tuple(shapes[3])[:2]
    dims = static_dims(spec, E=E, I=I, D=D, top_k=top_k)
    (name,) = spec.kernels
    kernel = aot.compile_kernel(name, float_dtype, attrs, dims, target)
    if kernel.shared > MAX_DEFAULT_SHARED_BYTES:
        raise aot.KernelError(f"{spec.plugin_id}: kernel {kernel.entry} needs {kernel.shared} B of shared memory, "
                              f"above the {MAX_DEFAULT_SHARED_BYTES} B a launch gets by default")
    return kernel


def moe_experts_grid(kernel: Any, shapes: list, cdiv: Any = ceil_div) -> tuple:
    """(grid, int32 scalars) of that kernel, by ``k3export.ops.moe_experts.launch`` ("tokens": one program per BN
    token rows, N the int32 scalar): a program owns BN rows of u, so it needs no zeroed output and no workspace."""
    experts = sys.modules["k3export.ops.moe_experts"]  # the module (the package attribute is the op function)
    N = shapes[0][0]
    E, I = tuple(shapes[3])[:2]
    return experts.launch("tokens", N, kernel.constexprs["E"], kernel.constexprs["I"], kernel.constexprs, cdiv)


def aot_result(trtp: Any, kernel: Any, grid: tuple, scalars: tuple) -> tuple:
    """What ``aot_impl`` returns: (PTX entry, PTX, launch parameters, int32 scalars) of a compiled `aot.Kernel`."""
    launch = trtp.KernelLaunchParams()
    launch.grid_x, launch.grid_y, launch.grid_z = grid
    launch.block_x = kernel.block[0]
    launch.shared_mem = kernel.shared
    exprs = trtp.SymIntExprs(len(scalars))
    for i, s in enumerate(scalars):
        exprs[i] = trtp.SymInt32(s)
    return kernel.entry, kernel.ptx, launch, exprs


__all__ = ["ALL_SPECS", "AUTOTUNE_LAYOUT", "BYTE_SPECS", "KDA_TACTICS", "MAX_DEFAULT_SHARED_BYTES",
           "PARSER_CONTROL_ATTRS",
           "PLUGIN_NAMESPACE", "PLUGIN_VERSION", "SPECS", "SPEC_BYTES", "TRT_BYTES", "aot_result", "autotune_types",
           "ceil_div", "kda_kernel", "kda_tactic", "kernel_target", "kernels_for", "moe_experts_grid",
           "moe_experts_kernel", "output_descs", "profile_max", "spec_dtype", "static_dims", "trt_dtype", "trt_type"]
