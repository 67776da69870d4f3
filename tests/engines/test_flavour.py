"""Which TensorRT (`k3export.plugins.flavour`) and what it can build for (`checks.check_target`), on stand-ins for
datacenter TensorRT and on the installed TensorRT-RTX; and that a process which imported ``tensorrt_rtx`` before
k3export is refused a plugin build in one line instead of ending at the parser's first plugin node."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from trt_builds import rtx_reason  # tests/engines is on sys.path

from k3export.converters.tensorrt import checks
from k3export.errors import ExportError
from k3export.plugins.flavour import Flavour, parse_cc


def _datacenter() -> Flavour:
    return Flavour("tensorrt", "10.13.0", SimpleNamespace(__version__="10.13.0"))


def test_compute_capabilities_parse_in_every_spelling():
    assert parse_cc("8.6") == parse_cc("86") == parse_cc("sm_86") == parse_cc((8, 6)) == (8, 6)
    assert parse_cc("12.0") == parse_cc("sm_120") == (12, 0)
    with pytest.raises(ExportError, match="expected MAJOR.MINOR"):
        parse_cc("ampere")


def test_datacenter_tensorrt_builds_only_for_the_gpu_it_runs_on():
    dc = _datacenter()
    assert dc.targets is None and not dc.builds_without_gpu
    assert checks.check_target(dc, None, (9, 0)) == (9, 0) == checks.check_target(dc, (9, 0), (9, 0))
    with pytest.raises(ExportError, match=r"TensorRT 10.13.0 builds for the GPU it runs on \(compute capability "
                                          r"9.0\), not for 8.6: .*TensorRT-RTX"):
        checks.check_target(dc, (8, 6), (9, 0))
    with pytest.raises(ExportError, match="builds on an NVIDIA GPU, for that GPU, and none is visible"):
        checks.check_target(dc, None, None)


def test_tensorrt_rtx_builds_for_its_listed_targets_with_or_without_a_gpu():
    why = rtx_reason()
    if why is not None:
        pytest.skip(why)
    from k3export.plugins.flavour import load_flavour

    rtx = load_flavour()
    members = {n for n in rtx.trt.ComputeCapability.__members__ if n.startswith("SM")}  # the enum, read here
    assert {f"SM{a}{b}" for a, b in rtx.targets} == members and rtx.builds_without_gpu
    assert checks.check_target(rtx, (8, 6), None) == (8, 6) and checks.check_target(rtx, None, (8, 9)) == (8, 9)
    with pytest.raises(ExportError, match=r"pass --target-cc, one of 7.5, "):
        checks.check_target(rtx, None, None)
    with pytest.raises(ExportError, match=r"cannot build for compute capability 9.0; .*datacenter TensorRT"):
        checks.check_target(rtx, None, (9, 0))  # an H200 here: refused, not built for the wrong chip


def test_tensorrt_rtx_imported_before_k3export_is_refused_in_one_line():
    """In a fresh process: ``import tensorrt_rtx`` first, then ask for the plugins: one line saying why and what to
    do; nothing registered, the process lives on."""
    why = rtx_reason()
    if why is not None:
        pytest.skip(why)
    code = ("import tensorrt_rtx\n"
            "from k3export.plugins import register_plugins, TensorRTUnavailable\n"
            "try:\n    register_plugins()\nexcept TensorRTUnavailable as e:\n    print('REFUSED', e)\n"
            "print('ALIVE')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "ALIVE" and lines[0].startswith("REFUSED") and len(lines) == 2
    assert "opens libtensorrt_rtx.so from its folder" in lines[0] and "Import k3export.plugins.flavour" in lines[0]
