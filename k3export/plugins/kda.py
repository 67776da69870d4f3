"""TensorRT plugin ``k3::kda``: Kimi Delta Attention core (the op ``torch.ops.k3.kda``).

``define(trtp, trt)`` applies the ``tensorrt.plugin`` decorators; it runs only from
``k3export.plugins.register_plugins()``, so this module imports without TensorRT.

* ``register``  output descs from ``rules.kda_output_shapes`` / ``rules.kda_output_dtypes``.
* ``autotune``  q/k/v/o in fp32|bf16|fp16 (dependent), g, beta, states fp32, LINEAR; tactics
                1 = recurrent kernel (decode), 2 = chunked kernel (prefill, offered only when its
                shared memory fits the default 48 KiB launch limit). TensorRT times the tactics per
                optimisation profile and keeps the faster.
* ``aot_impl``  Triton PTX of the chosen kernel with ``scale`` baked in, grid (cdiv(V, BV), B*H),
                int32 scalars (T, H): the engine needs no Python at run time.
* ``impl``      JIT debug path: calls ``torch.ops.k3.kda`` on the TensorRT buffers.

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` inspects real annotation objects.
"""

from typing import List, Tuple

from . import _aot, rules

OP = "kda"


def define(trtp, trt) -> None:
    from ._torch_bridge import as_torch, name_to_trt, trt_to_name

    plugin_id = rules.PLUGINS[OP].plugin_id
    TensorDesc = trtp.TensorDesc

    @trtp.register(plugin_id)
    def kda_desc(q: TensorDesc, k: TensorDesc, v: TensorDesc, g: TensorDesc, beta: TensorDesc,
                 initial_state: TensorDesc, scale: float) -> Tuple[TensorDesc, TensorDesc]:
        o_shape, s_shape = rules.kda_output_shapes(tuple(q.shape_expr), tuple(v.shape_expr))
        o_dtype, s_dtype = rules.kda_output_dtypes(trt_to_name(q.dtype))
        return (trtp.from_shape_expr(o_shape, dtype=name_to_trt(o_dtype)),
                trtp.from_shape_expr(s_shape, dtype=name_to_trt(s_dtype)))

    @trtp.autotune(plugin_id)
    def kda_autotune(q: TensorDesc, k: TensorDesc, v: TensorDesc, g: TensorDesc, beta: TensorDesc,
                     initial_state: TensorDesc, scale: float,
                     outputs: Tuple[TensorDesc, TensorDesc]) -> List[trtp.AutoTuneCombination]:
        chunk_shared = None
        try:  # head dims are static; B and T may read -1 here
            K, V = int(q.shape[3]), int(v.shape[3])
            if K > 0 and V > 0:
                chunk_shared = _aot.compile_kda(trt_to_name(q.dtype), K, V, scale, rules.KDA_TACTIC_CHUNKED)[0].shared
        except Exception:  # the chunked kernel is an optimisation: without it, the recurrent one runs
            chunk_shared = None
        return [trtp.AutoTuneCombination(rules.AUTOTUNE_TYPES[OP], rules.AUTOTUNE_LAYOUT,
                                         rules.kda_tactics(chunk_shared))]

    if hasattr(trtp, "aot_impl") and hasattr(trtp, "KernelLaunchParams"):

        @trtp.aot_impl(plugin_id)
        def kda_aot_impl(q: TensorDesc, k: TensorDesc, v: TensorDesc, g: TensorDesc, beta: TensorDesc,
                         initial_state: TensorDesc, scale: float, outputs: Tuple[TensorDesc, TensorDesc],
                         tactic: int) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
            B, T, H, K = tuple(q.shape_expr)
            V = v.shape_expr[3]
            dims = {"K": K, "V": V, "H": H}
            for n, d in dims.items():
                if d.is_fake or not d.is_constant:
                    raise ValueError(f"k3::kda: head count/dim {n} must be static in the network (it is compiled "
                                     "into the kernel)")
            Kc, Vc, Hc = (dims[n].constant_value() for n in ("K", "V", "H"))
            kernel, consts = _aot.compile_kda(trt_to_name(q.dtype), Kc, Vc, scale, tactic)
            plan = rules.kda_launch(B, T, Hc, Vc, consts["BV"])
            return _aot.aot_result(trtp, kernel, plan)

    @trtp.impl(plugin_id)
    def kda_impl(q: trtp.Tensor, k: trtp.Tensor, v: trtp.Tensor, g: trtp.Tensor, beta: trtp.Tensor,
                 initial_state: trtp.Tensor, scale: float, outputs: Tuple[trtp.Tensor, trtp.Tensor],
                 stream: int, tactic: int) -> None:
        import torch

        import k3export.ops.kda  # noqa: F401  registers torch.ops.k3.kda

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = [as_torch(t) for t in (q, k, v, g, beta, initial_state)]
            o, state = torch.ops.k3.kda(*args, float(scale))
            as_torch(outputs[0]).copy_(o)
            as_torch(outputs[1]).copy_(state)
