"""AOT PTX of every plugin kernel for sm_90: TensorRT's parameter layout (inputs, int32 scalars, outputs)
read from the PTX .entry, zero scratch, and aot_impl's launch parameters (no GPU, no TensorRT).

The compiles run in one subprocess (aot_probe.py) without TRITON_INTERPRET, which the test session sets
for the CPU-interpreted kernel tests and which triton.compile cannot work under."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3export.plugins import _aot, rules

pytest.importorskip("triton", reason="the AOT compile needs the triton package")

EXPECTED = {  # kernel -> (op, inputs, int32 scalars, outputs)
    "kda_recurrent": ("kda", 6, 2, 2),
    "kda_chunk": ("kda", 6, 2, 2),
    "situ_glu": ("situ_glu", 2, 1, 1),
    "moe_route": ("moe_route", 2, 0, 2),
}


@pytest.fixture(scope="module")
def probe():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("aot_probe.py")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


def _kernel(info):
    return _aot.PluginKernel(**{k: info[k] for k in (
        "op", "name", "ptx", "num_warps", "shared", "global_scratch", "profile_scratch", "n_inputs", "n_scalars",
        "n_outputs")})


def test_every_listed_plugin_kernel_is_covered():
    from k3export.ops.aot import list_plugin_kernels

    assert set(list_plugin_kernels()) == set(EXPECTED)


@pytest.mark.parametrize("kernel", list(EXPECTED))
def test_ptx_entry_has_the_tensorrt_layout(probe, kernel):
    op, n_in, n_sc, n_out = EXPECTED[kernel]
    info = probe["kernels"][kernel]
    assert info["op"] == op and (info["n_inputs"], info["n_scalars"], info["n_outputs"]) == (n_in, n_sc, n_out)
    assert ".target sm_90" in info["ptx"]
    params = _aot.ptx_entry_params(info["ptx"], info["name"])
    layout = [".u64 .ptr"] * n_in + [".u32"] * n_sc + [".u64 .ptr"] * n_out
    assert params[: len(layout)] == layout
    # only Triton's hidden scratch pointers may follow, and they must be unused (size 0)
    assert params[len(layout):] in ([], [".u64 .ptr"], [".u64 .ptr"] * 2)
    assert (info["global_scratch"], info["profile_scratch"]) == (0, 0)
    assert info["block_x"] == 32 * info["num_warps"]
    _aot.check_plugin_layout(_kernel(info))


def test_float_attributes_are_baked_in(probe):
    a, b = probe["kernels"]["kda_recurrent_fp32_scale025"], probe["kernels"]["kda_recurrent_fp32_scale05"]
    assert a["ptx"] != b["ptx"]  # one compile per attribute value


def test_layout_check_rejects_wrong_order_and_scratch(probe):
    k = _kernel(probe["kernels"]["situ_glu"])
    with pytest.raises(_aot.PluginKernelError, match="TensorRT passes 2 input pointers, 2 int32 scalars"):
        _aot.check_plugin_layout(dataclasses.replace(k, n_scalars=2, n_outputs=0))
    with pytest.raises(_aot.PluginKernelError, match="scratch"):
        _aot.check_plugin_layout(dataclasses.replace(k, global_scratch=256))
    with pytest.raises(_aot.PluginKernelError, match="no .entry"):
        _aot.ptx_entry_params("// empty", "nothing")


def test_aot_impl_returns_kernel_grid_and_scalars(probe):
    B, T, H, K = 2, 5, 4, 16
    for tactic, name in ((rules.KDA_TACTIC_RECURRENT, "kda_recurrent_kernel"), (rules.KDA_TACTIC_CHUNKED, "kda_chunk_kernel")):
        r = probe["aot_impl"][f"kda_{tactic}"]
        assert r["name"] == name and r["has_entry"]
        assert r["grid"][1:] == [B * H, 1] and r["grid"][0] >= 1
        assert r["scalars"] == [T, H]
        assert r["block_x"] % 32 == 0
    r = probe["aot_impl"]["situ_glu"]
    assert r["name"] == "situ_glu_kernel" and r["scalars"] == [3 * 7 * 32] and r["has_entry"]
    r = probe["aot_impl"]["moe_route"]
    assert r["name"] == "moe_route_kernel" and r["grid"] == [9, 1, 1] and r["scalars"] == []


def test_kda_autotune_offers_chunk_only_within_default_shared_memory(probe):
    shared = probe["kernels"]["kda_chunk"]["shared"]
    assert probe["kda_autotune_tactics"] == rules.kda_tactics(shared)
