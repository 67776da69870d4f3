"""Compile every plugin kernel for sm_90 and run the decorated aot_impl functions (fake tensorrt.plugin);
print the results as JSON. Run in a subprocess without TRITON_INTERPRET: under the CPU interpreter the
@triton.jit kernels are InterpretedFunction objects, which triton.compile cannot take."""

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import make_fake_tensorrt  # noqa: E402

from k3export.plugins import _aot, rules  # noqa: E402


def kernel_info(k):
    return {"op": k.op, "name": k.name, "ptx": k.ptx, "num_warps": k.num_warps, "shared": k.shared,
            "global_scratch": k.global_scratch, "profile_scratch": k.profile_scratch, "n_inputs": k.n_inputs,
            "n_scalars": k.n_scalars, "n_outputs": k.n_outputs, "block_x": k.block_x}


def main():
    out = {"kernels": {}, "aot_impl": {}}
    out["kernels"]["kda_recurrent"] = kernel_info(_aot.compile_kda("bfloat16", 16, 16, 0.25, rules.KDA_TACTIC_RECURRENT)[0])
    out["kernels"]["kda_chunk"] = kernel_info(_aot.compile_kda("bfloat16", 16, 16, 0.25, rules.KDA_TACTIC_CHUNKED)[0])
    out["kernels"]["situ_glu"] = kernel_info(_aot.compile_situ_glu("bfloat16", 4.0, 25.0)[0])
    out["kernels"]["moe_route"] = kernel_info(_aot.compile_moe_route(8, 2, 1, 1.0)[0])
    out["kernels"]["kda_recurrent_fp32_scale05"] = kernel_info(_aot.compile_kda("float32", 16, 16, 0.5)[0])
    out["kernels"]["kda_recurrent_fp32_scale025"] = kernel_info(_aot.compile_kda("float32", 16, 16, 0.25)[0])

    trt, trtp, registry = make_fake_tensorrt()
    sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, trtp
    from k3export.plugins import kda, moe_route, situ_glu

    for m in (kda, situ_glu, moe_route):
        m.define(trtp, trt)
    D, bf, f32 = trtp.TensorDesc, trt.DataType.BF16, trt.DataType.FLOAT
    B, T, H, K = 2, 5, 4, 16

    def res(r):
        name, ptx, launch, scalars = r
        v = lambda x: getattr(x, "v", x)  # noqa: E731
        return {"name": name, "has_entry": f".entry {name}(" in ptx,
                "grid": [v(launch.grid_x), v(launch.grid_y), v(launch.grid_z)], "block_x": v(launch.block_x),
                "shared": v(launch.shared_mem), "scalars": [v(s) for s in scalars]}

    q = D((B, T, H, K), bf)
    for tactic in (rules.KDA_TACTIC_RECURRENT, rules.KDA_TACTIC_CHUNKED):
        out["aot_impl"][f"kda_{tactic}"] = res(registry["k3::kda"]["aot_impl"](
            q, q, q, D((B, T, H, K), f32), D((B, T, H), f32), D((B, H, K, K), f32), 0.25, (), tactic))
    g = D((3, 7, 32), bf)
    out["aot_impl"]["situ_glu"] = res(registry["k3::situ_glu"]["aot_impl"](g, g, 4.0, 25.0, (), 0))
    out["aot_impl"]["moe_route"] = res(registry["k3::moe_route"]["aot_impl"](D((9, 8), f32), D((8,), f32), 2, 1, 1.0, (), 0))
    ((types_, layout, tactics),) = registry["k3::kda"]["autotune"](
        q, q, q, D((B, T, H, K), f32), D((B, T, H), f32), D((B, H, K, K), f32), 0.25, ())
    out["kda_autotune_tactics"] = list(tactics)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
