"""The tiny K3 (the root conftest's `tiny_k3`) and its fp32 exports with per-layer debug outputs: the default graph
form (`export_dir`) and the inlined form (`inlined_dir`, what OpenVINO reads), a runner of each runtime, and the
k3 ORT library built for this CPU (`ort_lib`) and for each target its kernels' tests cover (`kernels`)."""

import platform
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny(tiny_k3):
    return tiny_k3


@pytest.fixture(scope="session")
def export_dir(tiny, tmp_path_factory) -> Path:
    from k3export.converters.onnx import export_onnx

    out = tmp_path_factory.mktemp("runtime") / "export"
    export_onnx(tiny, out, dtype="fp32", debug_outputs=True)
    return out


@pytest.fixture(scope="session")
def inlined_dir(tiny, tmp_path_factory) -> Path:
    from k3export.converters.onnx import export_onnx

    out = tmp_path_factory.mktemp("runtime") / "inlined"
    export_onnx(tiny, out, dtype="fp32", debug_outputs=True, form="inlined")
    return out


#: the runtimes that run the tiny export on this CPU, and the export fixture each reads
EXPORT_RUNTIMES = {"ort": "export_dir", "openvino": "inlined_dir", "openvino-stateless": "inlined_dir",
                   "onnx-reference": "export_dir"}


@pytest.fixture
def make(request, tiny):
    """``make(runtime)``: a fresh runner of `runtime` (torch: the tiny model; others: the export it reads)."""
    from k3export.runtime import Target, TorchRunner, make_runner

    def build(runtime: str):
        if runtime == "torch":
            return TorchRunner(tiny)
        if runtime.startswith("openvino"):
            pytest.importorskip("openvino")
        return make_runner(runtime, Target(onnx_dir=request.getfixturevalue(EXPORT_RUNTIMES[runtime])))

    return build


#: the targets the k3 kernels are tested on, each compiling another branch of the kernels (``ops/csrc/kernels/``): this CPU's build
#: (AVX-512 where it has it), x86-64-v3 (AVX2 and FMA, what a CPU without AVX-512 runs) and x86-64 (no AVX: the
#: generic vector code and the one-value-at-a-time MXFP4 decode, for any other CPU), each with the CPU flags it needs
KERNEL_TARGETS = {"native": set(), "x86-64-v3": {"avx2", "fma"}, "x86-64": set()}


@pytest.fixture(scope="session", params=list(KERNEL_TARGETS))
def kernel_target(request) -> str:
    target = request.param
    if target != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={target} is an x86-64 target and this is {platform.machine()}")
    from k3export.runtime import native

    lacks = sorted(KERNEL_TARGETS[target] - native.cpu_flags())
    if lacks:
        pytest.skip(f"this CPU cannot run a -march={target} build: it lacks {lacks}")
    return target


def _ort_library(arch: str) -> Path:
    """The k3 ORT library built for ``-march={arch}`` (`ort_ops.build`); the test skipped where it cannot be built."""
    from k3export.runtime import ort_ops

    try:
        return ort_ops.build(arch=arch)
    except ort_ops.BuildError as exc:  # no compiler / headers / network here: nothing to test
        pytest.skip(f"k3 ORT ops not buildable here for -march={arch}: {exc}")


@pytest.fixture(scope="session")
def ort_lib() -> Path:
    """The k3 ORT library built for this CPU."""
    from k3export.runtime import ort_ops

    return _ort_library(ort_ops.ARCH)


@pytest.fixture(scope="session")
def kernels(kernel_target) -> Path:
    """The k3 ORT library built for `kernel_target`."""
    return _ort_library(kernel_target)
