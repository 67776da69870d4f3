"""TensorRT plugin ``k3::kda`` (the op ``torch.ops.k3.kda``, contract ``k3export.ops.spec.KDA``).

``define(trtp, trt)`` applies the ``tensorrt.plugin`` decorators; only ``k3export.plugins.register_plugins()``
calls it, so this module imports without TensorRT.

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
        t_max = rules.profile_max(q.shape, 1)
        chunk_shared = None
        if kda_algorithm(t_max) == "chunk":
            try:  # head dims are static; an uncompilable chunk kernel leaves the recurrent one
                dims = {"K": int(q.shape[3]), "V": int(v.shape[3])}
                chunk_shared = aot.compile_kernel("kda_chunk", dtype(q.dtype).name, {"scale": scale}, dims).shared
            except Exception:
                chunk_shared = None
        return [trtp.AutoTuneCombination(rules.autotune_types(SPEC), rules.AUTOTUNE_LAYOUT,
                                         [rules.kda_tactic(t_max, chunk_shared)])]

    if hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams"):

        @trtp.aot_impl(SPEC.plugin_id)
        def kda_aot_impl(q: TensorDesc, k: TensorDesc, v: TensorDesc, g: TensorDesc, beta: TensorDesc,
                         initial_state: TensorDesc, scale: float, outputs: Tuple[TensorDesc, TensorDesc],
                         tactic: int) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
            B, T, H, K = tuple(q.shape_expr)
            dims = rules.static_dims(SPEC, H=H, K=K, V=v.shape_expr[3])
            kernel = aot.compile_kernel(rules.kda_kernel(tactic), dtype(q.dtype).name, {"scale": scale}, dims)
            return rules.aot_result(trtp, kernel, *launch(B, T, dims["H"], dims["V"], kernel.constexprs["BV"]))

    @trtp.impl(SPEC.plugin_id)
    def kda_impl(q: trtp.Tensor, k: trtp.Tensor, v: trtp.Tensor, g: trtp.Tensor, beta: trtp.Tensor,
                 initial_state: trtp.Tensor, scale: float, outputs: Tuple[trtp.Tensor, trtp.Tensor],
                 stream: int, tactic: int) -> None:
        run_op(SPEC.name, (q, k, v, g, beta, initial_state), (float(scale),), outputs, stream)
