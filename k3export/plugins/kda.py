"""TensorRT plugin ``k3::kda`` (the op ``torch.ops.k3.kda``, contract ``k3export.ops.spec.KDA``).

`tactic`, `kernel` and `grid` say once which kernel runs and how it is launched; ``define(trtp, trt)`` applies the
``tensorrt.plugin`` decorators with them (only ``k3export.plugins.register_plugins()`` calls it, so this module
imports without TensorRT) and `k3export.plugins.v3` builds the class-based plugin from them.

* ``register``  output descs from the spec.
* ``autotune``  the spec's io types, LINEAR; one tactic per profile: the kernel ``kda_algorithm`` picks for the
                profile's largest T (1 = recurrent, 2 = chunked; see ``rules.kda_tactic``).
* ``aot_impl``  Triton PTX of that kernel with ``scale`` and the head dims baked in, grid and int32 scalars
                from ``k3export.ops.kda.launch``: the engine needs no Python at run time.
* ``impl``      JIT debug path: ``torch.ops.k3.kda`` on the TensorRT buffers.

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` inspects real annotation objects.
"""

from typing import List, Tuple

from k3export.dtypes import dtype
from k3export.ops import aot
from k3export.ops.kda import kda_algorithm, launch
from k3export.ops.spec import KDA as SPEC

from . import rules


def tactic(shapes_max: list, float_dtype: str, attrs: dict, target: tuple) -> int:
    """The tactic of a profile whose inputs are at most `shapes_max` (T = -1: unknown): `rules.kda_tactic` of its
    largest T, after compiling the chunk kernel to learn its shared memory (an uncompilable one leaves the
    recurrent kernel)."""
    t_max = int(shapes_max[0][1])
    chunk_shared = None
    if kda_algorithm(t_max) == "chunk":
        try:  # head dims are static
            dims = {"K": int(shapes_max[0][3]), "V": int(shapes_max[2][3])}
            chunk_shared = aot.compile_kernel("kda_chunk", float_dtype, {"scale": attrs["scale"]}, dims, target).shared
        except Exception:
            chunk_shared = None
    return rules.kda_tactic(t_max, chunk_shared)


def kernel(tactic: int, float_dtype: str, attrs: dict, shapes: list, target: tuple) -> aot.Kernel:
    """The kernel of `tactic` with ``scale`` and the head dims (static in the network) baked in."""
    dims = rules.static_dims(SPEC, K=shapes[0][3], V=shapes[2][3])
    return aot.compile_kernel(rules.kda_kernel(tactic), float_dtype, {"scale": attrs["scale"]}, dims, target)


def grid(kernel: aot.Kernel, shapes: list, attrs: dict, cdiv=rules.ceil_div) -> tuple:
    """(grid, int32 scalars) by ``k3export.ops.kda.launch``; B and T may be symbolic."""
    B, T, H, _ = tuple(shapes[0])
    return launch(B, T, rules.static_dims(SPEC, H=H)["H"], int(kernel.constexprs["V"]), kernel.constexprs["BV"])


def define(trtp, trt) -> None:
    from ._torch_bridge import run_op

    TensorDesc = trtp.TensorDesc

    @trtp.register(SPEC.plugin_id)
    def kda_desc(q: TensorDesc, k: TensorDesc, v: TensorDesc, g: TensorDesc, beta: TensorDesc,
                 initial_state: TensorDesc, scale: float) -> Tuple[TensorDesc, TensorDesc]:
        return rules.output_descs(trtp, SPEC, (q, k, v, g, beta, initial_state), {"scale": scale})

    @trtp.autotune(SPEC.plugin_id)
    def kda_autotune(q: TensorDesc, k: TensorDesc, v: TensorDesc, g: TensorDesc, beta: TensorDesc,
                     initial_state: TensorDesc, scale: float,
                     outputs: Tuple[TensorDesc, TensorDesc]) -> List[trtp.AutoTuneCombination]:
        shapes = [(q.shape[0], rules.profile_max(q.shape, 1), q.shape[2], q.shape[3]), None, tuple(v.shape)]
        chosen = tactic(shapes, dtype(q.dtype).name, {"scale": scale}, rules.kernel_target())
        return [trtp.AutoTuneCombination(rules.autotune_types(SPEC), rules.AUTOTUNE_LAYOUT, [chosen])]

    if hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams"):

        @trtp.aot_impl(SPEC.plugin_id)
        def kda_aot_impl(q: TensorDesc, k: TensorDesc, v: TensorDesc, g: TensorDesc, beta: TensorDesc,
                         initial_state: TensorDesc, scale: float, outputs: Tuple[TensorDesc, TensorDesc],
                         tactic: int) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
            shapes = [tuple(q.shape_expr), None, tuple(v.shape_expr)]
            k = kernel(tactic, dtype(q.dtype).name, {"scale": scale}, shapes, rules.kernel_target())
            return rules.aot_result(trtp, k, *grid(k, shapes, {"scale": scale}))

    @trtp.impl(SPEC.plugin_id)
    def kda_impl(q: trtp.Tensor, k: trtp.Tensor, v: trtp.Tensor, g: trtp.Tensor, beta: trtp.Tensor,
                 initial_state: trtp.Tensor, scale: float, outputs: Tuple[trtp.Tensor, trtp.Tensor],
                 stream: int, tactic: int) -> None:
        run_op(SPEC.name, (q, k, v, g, beta, initial_state), (float(scale),), outputs, stream)
