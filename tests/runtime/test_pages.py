"""`k3export.runtime.pages.huge_pages`: resident anonymous memory collapsed into 2 MiB pages, read back from the
kernel's own account of the mapping (/proc/self/smaps), its bytes unchanged, nothing added to the resident set."""

from __future__ import annotations

import ctypes
import mmap
import platform
import sys

import numpy as np
import pytest

from k3export.runtime import pages


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _kernel() -> tuple[int, int]:
    major, minor = platform.release().split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() in (None, "never") or _kernel() < (6, 1),
    reason="MADV_COLLAPSE needs Linux >= 6.1 with transparent huge pages not disabled")

MIB = 1 << 20


@pytest.fixture
def mappings():
    """`take(n)`: n private anonymous mappings of 16 MiB each, 2 MiB-aligned, as writable numpy byte arrays with
    their addresses, a 2 MiB inaccessible gap between each two, so that each is a mapping of its own (`_smaps`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    held = []

    def take(n: int) -> list[tuple[np.ndarray, int]]:
        size = n * 18 * MIB + 2 * MIB
        base = libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert base not in (None, ctypes.c_void_p(-1).value)
        held.append((base, size))
        out = []
        for i in range(n):
            at = -(-base // (2 * MIB)) * (2 * MIB) + i * 18 * MIB
            assert libc.mprotect(at, 16 * MIB, mmap.PROT_READ | mmap.PROT_WRITE) == 0
            out.append((np.ctypeslib.as_array((ctypes.c_ubyte * (16 * MIB)).from_address(at)), at))
        return out

    yield take
    for base, size in held:
        libc.munmap(base, size)


def _smaps(addr: int, size: int = 16 * MIB) -> dict[str, int]:
    """The kB fields of the mapping [addr, addr + size) (/proc/self/smaps)."""
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
                if inside:
                    assert (lo, hi) == (addr, addr + size), "the test's mapping was merged with another"
            elif inside and len(head) >= 2 and head[1].isdigit():
                fields[head[0].rstrip(":")] = int(head[1])
    assert fields, f"no mapping at {addr:#x}"
    return fields


def test_resident_memory_becomes_huge_pages_with_its_bytes(mappings):
    [(raw, addr)] = mappings(1)
    data = raw.view(np.float32)
    data[:] = np.random.default_rng(0).standard_normal(data.size, dtype=np.float32)
    want = data.copy()
    assert _smaps(addr)["AnonHugePages"] == 0
    done = pages.huge_pages()
    huge = _smaps(addr)["AnonHugePages"] * 1024
    assert huge >= 14 * MIB  # every aligned 2 MiB of the 16 (at most one lost to alignment at each end)
    assert done >= huge
    np.testing.assert_array_equal(data, want)


def test_memory_not_all_resident_or_skipped_is_left_alone(mappings):
    (partial, at_p), (skipped, at_s) = mappings(2)
    partial[::8192] = 1  # every other 4 KiB page: no 2 MiB of it is whole
    rss = _smaps(at_p)["Rss"]
    skipped[:] = 7
    pages.huge_pages(skip=[(at_s, at_s + 16 * MIB)])
    assert _smaps(at_p)["AnonHugePages"] == 0 and _smaps(at_p)["Rss"] == rss  # nothing was filled in
    assert _smaps(at_s)["AnonHugePages"] == 0
    pages.huge_pages()  # the control: the same call without `skip` does collapse it
    assert _smaps(at_s)["AnonHugePages"] >= 14 * 1024


def test_without_cuts_spans_out():
    assert pages.without((0, 100), [(10, 20), (50, 60), (90, 200)]) == [(0, 10), (20, 50), (60, 90)]
    assert pages.without((0, 100), [(-5, 300)]) == []
    assert pages.without((0, 100), []) == [(0, 100)]


def test_sessions_collapse_unless_switched_off(tmp_path, monkeypatch):
    """An ORT session collapses the process's resident memory once it is built; ``K3EXPORT_HUGE_PAGES=0`` stops it."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from k3export.runtime.ort_session import OrtSession

    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((1024, 2048), dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2048])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024])], [w])
    path = tmp_path / "gemm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    monkeypatch.setenv(pages.ENV_SWITCH, "0")
    assert OrtSession(path, k3_ops=False).huge_pages == 0
    monkeypatch.delenv(pages.ENV_SWITCH)
    session = OrtSession(path, k3_ops=False)
    assert session.huge_pages >= 2 * MIB  # at least the 8 MiB weight's prepacked copy
    x = np.random.default_rng(2).standard_normal((1, 2048), dtype=np.float32)
    got = session.run({"x": x})["y"]
    want = x.astype(np.float64) @ numpy_helper.to_array(w).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
