"""What the k3 TensorRT plugins add to the ops' contracts, as plain Python (nothing here imports TensorRT).

Inputs, outputs, attributes and the shape / dtype rules are the op specs (`k3export.ops.spec`); grids and int32
scalars are the ops' own ``launch`` rules; kernels come from `k3export.ops.aot`. The decorated functions in
``kda.py``, ``situ_glu.py``, ``moe_route.py``, ``moe_experts.py`` and ``moe_experts_mxfp4.py`` call these helpers, so
CI checks the same code without TensorRT.
Shapes may hold TensorRT's symbolic ``ShapeExpr`` dims: the spec only rearranges them and compares ints.
"""

from __future__ import annotations

from typing import Any

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


def trt_type(name: str) -> str:
    """``AutoTuneCombination``'s spelling of a dtype (FP32, FP16, else the ``trt.DataType`` member name)."""
    trt_name = dtype(name).trt_name
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
    dtypes = [d.dtype for d in inputs]
    spec.check(shapes, dtypes, attrs)
    return tuple(trtp.from_shape_expr(s, dtype=dtype(n).trt)
                 for s, n in zip(spec.output_shapes(shapes, attrs), spec.output_dtypes(dtypes)))


def static_dims(spec: OpSpec, **dims: Any) -> dict[str, int]:
    """Build-time values of dims compiled into a kernel; OpInputError when one is dynamic in the network."""
    out = {}
    for name, d in dims.items():
        if isinstance(d, int):
            out[name] = d
        elif not d.is_fake and d.is_constant:
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


def moe_experts_aot(trtp: Any, spec: OpSpec, z: Any, weights: Any, w1: Any, attrs: dict) -> tuple:
    """``aot_impl`` of ``k3::moe_experts`` and ``k3::moe_experts_mxfp4``: the spec's kernel with E, I, D, top_k (static
    in the network) and the attributes baked in, launched by ``k3export.ops.moe_experts.launch`` ("tokens": one
    program per BN token rows, N the int32 scalar)."""
    experts = sys.modules["k3export.ops.moe_experts"]  # the module (the package attribute is the op function)
    N, D = tuple(z.shape_expr)
    E, I = tuple(w1.shape_expr)[:2]
    dims = static_dims(spec, E=E, I=I, D=D, top_k=weights.shape_expr[1])
    (name,) = spec.kernels
    kernel = aot.compile_kernel(name, dtype(z.dtype).name, attrs, dims)
    if kernel.shared > MAX_DEFAULT_SHARED_BYTES:
        raise aot.KernelError(f"{spec.plugin_id}: kernel {kernel.entry} needs {kernel.shared} B of shared memory, "
                              f"above the {MAX_DEFAULT_SHARED_BYTES} B a launch gets by default")
    return aot_result(trtp, kernel, *experts.launch("tokens", N, dims["E"], dims["I"], kernel.constexprs, trtp.cdiv))


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


__all__ = ["ALL_SPECS", "AUTOTUNE_LAYOUT", "KDA_TACTICS", "MAX_DEFAULT_SHARED_BYTES", "PARSER_CONTROL_ATTRS",
           "PLUGIN_NAMESPACE", "PLUGIN_VERSION", "SPECS", "aot_result", "autotune_types", "kda_kernel", "kda_tactic",
           "moe_experts_aot", "output_descs", "profile_max", "static_dims", "trt_type"]
