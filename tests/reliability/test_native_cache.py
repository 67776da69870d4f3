"""The native libraries' cache and the environment switches under hostile input, in process (no model, ~1 s):

- a cached library cut short or replaced by random bytes is never handed to the loader (mapping a truncated ELF
  file kills the process with SIGBUS): `build_cached`, shared by the ONNX Runtime and OpenVINO libraries, checks the
  sha256 recorded when it built the file, builds it again, or refuses in one line where it cannot;
- every switch reads ``off`` / ``false`` / ``0`` as off, and refuses any other word in one line naming it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3export.errors import K3ExportError
from k3export.runtime import native, ort_ops, ov_ext, pages
from k3export import switches

SOURCE = 'extern "C" __attribute__((visibility("default"))) int k3_probe() { return 42; }\n'


def _build(root: Path, src: Path) -> Path:
    return native.build_cached(root, "k3_probe", (src,), "", lambda cxx, out, flags: [
        cxx, *flags, str(src), "-o", str(out)])


@pytest.fixture
def probe(tmp_path):
    if shutil.which(os.environ.get("CXX") or "g++") is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "probe.cpp"
    src.write_text(SOURCE)
    root = tmp_path / "cache"
    lib = _build(root, src)
    return root, src, lib


def _loads(lib: Path) -> int:
    """What the library's function returns, loaded in a child process (a crash there is a negative exit code)."""
    code = f"import ctypes, sys; sys.exit(ctypes.CDLL({str(lib)!r}).k3_probe())"
    return subprocess.run([sys.executable, "-c", code], timeout=60).returncode


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "digest missing"])
def test_a_damaged_cached_library_is_built_again_never_loaded(probe, damage):
    root, src, lib = probe
    good = lib.read_bytes()
    assert native.verified(lib) and native.digest_path(lib).is_file()
    if damage == "truncated":
        lib.write_bytes(good[:len(good) // 3])
        assert _loads(lib) != 42  # what the cache used to hand the loader (SIGBUS here, or a loader error)
    elif damage == "random bytes":
        lib.write_bytes(os.urandom(len(good)))
    else:
        native.digest_path(lib).unlink()
    assert not native.verified(lib)
    again = _build(root, src)
    assert again == lib and native.verified(lib)
    assert ctypes.CDLL(str(again)).k3_probe() == 42 and _loads(again) == 42


def test_a_damaged_library_that_cannot_be_built_again_is_refused_in_one_line(probe, monkeypatch):
    root, src, lib = probe
    lib.write_bytes(lib.read_bytes()[:1000])
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ort_ops.BuildError) as err:
        _build(root, src)
    assert "no C++ compiler" in str(err.value) and "\n" not in str(err.value)
    assert not native.verified(lib)


@pytest.mark.parametrize("value,on", [("0", False), ("off", False), ("OFF", False), ("false", False), ("no", False),
                                      ("1", True), ("on", True), ("True", True), ("yes", True), ("", True)])
def test_every_switch_reads_the_same_words(monkeypatch, value, on):
    for name, read in ((ort_ops.ENV_SWITCH, ort_ops.enabled), (ov_ext.ENV_SWITCH, ov_ext.enabled),
                       (pages.ENV_SWITCH, pages.enabled)):
        monkeypatch.setenv(name, value)
        assert read() is on, (name, value)


@pytest.mark.parametrize("name", [ort_ops.ENV_SWITCH, ov_ext.ENV_SWITCH, pages.ENV_SWITCH, "K3EXPORT_DEBUG",
                                  "K3EXPORT_TENSORRT", "K3EXPORT_MP_START", "K3EXPORT_OPS_BACKEND"])
def test_a_value_a_switch_does_not_take_is_refused_in_one_line_naming_it(monkeypatch, name):
    for other in switches.SWITCHES:
        monkeypatch.delenv(other, raising=False)
    switches.check_all()
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(K3ExportError) as err:
        switches.check_all()
    assert name in str(err.value) and "'maybe'" in str(err.value) and "\n" not in str(err.value)


def test_the_switches_are_declared_once_and_documented():
    """Every switch the code reads is declared in `k3export.switches` (the one home), with its meaning."""
    root = Path(__file__).resolve().parents[2]
    import re

    read = set()
    for path in [*(root / "k3export").rglob("*.py"), *(root / "cli").rglob("*.py")]:
        read |= set(re.findall(r"os\.environ(?:\.get)?[\[(]\s*\"((?:K3_|K3EXPORT_)\w+)\"", path.read_text()))
    assert not read, f"read outside k3export.switches: {sorted(read)}"
    assert all(s.meaning for s in switches.SWITCHES.values())


def test_every_switch_has_the_one_prefix_and_the_short_one_is_refused(monkeypatch):
    """One prefix (`switches.PREFIX`); a switch set under ``K3_`` would be silently ignored, so it is refused in one
    line naming the name that is read."""
    assert all(name.startswith(switches.PREFIX) for name in switches.SWITCHES)
    for other in switches.SWITCHES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv("K3_ORT_OPS", "0")
    with pytest.raises(K3ExportError, match="K3_ORT_OPS: k3export reads K3EXPORT_ORT_OPS") as err:
        switches.check_all()
    assert "\n" not in str(err.value)
    monkeypatch.setenv("K3_SOMETHING_ELSE", "1")  # not one of ours under the short prefix: left alone
    monkeypatch.delenv("K3_ORT_OPS")
    switches.check_all()
