"""The class-based IPluginV3 k3 plugins (`k3export.plugins.v3`) on the installed TensorRT-RTX, without a GPU: what the
creator makes from an ONNX node's attributes, what a plugin serialises and what the runtime creator makes of it, the
output dtypes, and the argument buffer ``enqueue`` hands the CUDA driver (a recording stand-in for ``libcuda``),
checked against the PTX entry's own parameter list and the launch rule written out by hand."""

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from k3export.ops import aot
from k3export.plugins import cuda_launch, kda, situ_glu, v3
from k3export.plugins.flavour import flavour_status, load_flavour

pytestmark = pytest.mark.skipif(flavour_status() is not None or load_flavour().plugin_problem is not None,
                                reason=f"needs a TensorRT whose parser takes plugins: {flavour_status()}")
TARGET = ("cuda", 86, 32)


@pytest.fixture(scope="module")
def flavour():
    f = load_flavour()
    v3.register(f, [kda, situ_glu])
    return f


def _fields(trt, **attrs):
    keep = []
    fields = []
    for name, value in attrs.items():
        if isinstance(value, str):
            arr, kind = np.frombuffer(value.encode() + b"\0", np.int8), trt.PluginFieldType.CHAR
        elif isinstance(value, float):
            arr, kind = np.array([value], np.float32), trt.PluginFieldType.FLOAT32
        else:
            arr, kind = np.array([value], np.int32), trt.PluginFieldType.INT32
        keep.append(arr)
        fields.append(trt.PluginField(name, arr, kind))
    return trt.PluginFieldCollection(fields), keep


def test_a_plugin_serialises_its_attributes_and_kernels_and_the_runtime_creator_reads_them_back(flavour):
    trt = flavour.trt
    creator = v3.creators(flavour)["kda"]
    fc, _keep = _fields(trt, scale=0.25)
    plugin = creator.create_plugin("layers.0/kda", fc, trt.TensorRTPhase.BUILD)
    assert plugin.attrs == {"scale": 0.25} and plugin.num_outputs == 2
    assert (plugin.plugin_name, plugin.plugin_namespace) == ("kda", "k3")
    kernel = aot.compile_kernel("kda_recurrent", "fp32", {"scale": 0.25}, {"K": 16, "V": 16}, TARGET)
    plugin.kernels, plugin.tactic = {1: kernel}, 1
    assert plugin.get_valid_tactics() == [1]
    back = creator.create_plugin("layers.0/kda", plugin.get_fields_to_serialize(), trt.TensorRTPhase.RUNTIME)
    assert back.attrs == {"scale": 0.25} and back.kernels == {1: kernel}
    assert ".target sm_86" in back.kernels[1].ptx


def test_a_missing_attribute_is_named_not_a_bare_creation_failure(flavour):
    trt = flavour.trt
    v3.clear_errors()
    fc, _keep = _fields(trt, beta1=4.0)
    assert v3.creators(flavour)["situ_glu"].create_plugin("n_situ", fc, trt.TensorRTPhase.BUILD) is None
    (failure,) = v3.errors()
    assert failure.node == "n_situ" and "missing attribute 'beta2'" in str(failure)


def test_output_dtypes_follow_the_spec(flavour):
    trt = flavour.trt
    fc, _keep = _fields(trt, scale=0.5)
    plugin = v3.creators(flavour)["kda"].create_plugin("k", fc, trt.TensorRTPhase.BUILD)
    f32, bf16 = trt.DataType.FLOAT, trt.DataType.BF16
    assert plugin.get_output_data_types([bf16, bf16, bf16, f32, f32, f32]) == [bf16, f32]  # o like q, state fp32


class _Driver:
    """libcuda as a recorder: every call succeeds; cuLaunchKernel keeps its arguments."""

    def __init__(self):
        self.launches = []
        self.loaded = []

    def cuCtxGetCurrent(self, ref):
        ref._obj.value = 0x1234
        return 0

    def cuModuleLoadData(self, ref, ptx):
        self.loaded.append(ptx.value)
        ref._obj.value = 0x10
        return 0

    def cuModuleGetFunction(self, ref, module, name):
        ref._obj.value = 0x20
        return 0

    def cuFuncSetAttribute(self, fn, attr, value):
        return 0

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launches.append(((gx, gy, gz), (bx, by, bz), shared, stream.value, params))
        return 0


def _read(params, i, ctype):
    return ctypes.cast(params[i], ctypes.POINTER(ctype)).contents.value


def test_enqueue_launches_the_kernel_with_the_entry_parameters_in_order(flavour, monkeypatch):
    """KDA, batch 2, 3 tokens, 4 heads of 16: grid (cdiv(V, BV), B*H, 1), scalars (T, H), pointers in contract order,
    a null for each of Triton's hidden scratch pointers; as many parameters as the PTX entry declares."""
    trt = flavour.trt
    fake = _Driver()
    monkeypatch.setattr(cuda_launch, "_driver", [cuda_launch.Driver(fake)])
    fc, _keep = _fields(trt, scale=0.25)
    plugin = v3.creators(flavour)["kda"].create_plugin("k", fc, trt.TensorRTPhase.RUNTIME)
    kernel = aot.compile_kernel("kda_recurrent", "fp32", {"scale": 0.25}, {"K": 16, "V": 16}, TARGET)
    plugin.kernels = {1: kernel}
    plugin.set_tactic(1)
    B, T, H, K, V = 2, 3, 4, 16, 16
    dims = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H), (B, H, K, V)]
    inputs, outputs = [0x1000 * (i + 1) for i in range(6)], [0x9000, 0xA000]
    plugin.enqueue([SimpleNamespace(dims=d) for d in dims], [SimpleNamespace(dims=(B, T, H, V))] * 2, inputs,
                   outputs, 0, 77)
    (grid, block, shared, stream, params), = fake.launches
    BV = kernel.constexprs["BV"]
    assert grid == (-(-V // BV), B * H, 1) and block == (kernel.num_warps * 32, 1, 1) and stream == 77
    assert shared == kernel.shared and fake.loaded == [kernel.ptx.encode()]
    entry = aot.ptx_params(kernel.ptx, kernel.entry)
    assert len(params) == len(entry)
    values = [_read(params, i, ctypes.c_uint64 if p.endswith(".ptr") else ctypes.c_int32) for i, p in enumerate(entry)]
    assert values == inputs + [T, H] + outputs + [0] * (len(entry) - 10)


def test_an_empty_grid_launches_nothing_and_scalars_must_fit_int32():
    kernel = aot.compile_kernel("situ_glu", "fp32", {"beta1": 4.0, "beta2": 25.0}, None, TARGET)
    fake = _Driver()
    driver = cuda_launch.Driver(fake)
    assert driver.launch(kernel, (0, 1, 1), [1, 2], [0], [3], 0) is False and not fake.launches
    assert driver.launch(kernel, (5, 1, 1), [1, 2], [4096], [3], 0) is True
    with pytest.raises(ValueError, match="does not fit int32"):
        cuda_launch.argument_buffer(kernel, [1, 2], [2**31], [3])
    with pytest.raises(ValueError, match="takes 2 inputs, 1 scalars, 1 outputs"):
        cuda_launch.argument_buffer(kernel, [1], [4], [3])
