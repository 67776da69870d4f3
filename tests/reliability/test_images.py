"""Hostile images and processor files, through the Python path (``K3ImageProcessor``: `generate` takes no image
yet), each in a real process under a memory limit (RLIMIT_AS), as the CLI corpus runs its memory bombs.

Each case must end in one `K3ImageError` whose one-line message names the file (or the field), within the limit
and the time-out: no other exception, no `MemoryError`, nothing written. The images are built byte by byte here (a
PNG's header claims its size before any pixel), so a bomb costs the test a few hundred bytes of disk.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ROOT  # noqa: E402

pytest.importorskip("PIL")

MB = 1 << 20
LIMIT = 512 * MB  # address space the child may map beyond what it holds once torch and transformers are imported


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png(width: int, height: int, rows: int | None = None) -> bytes:
    """An RGB PNG of `width` x `height` whose IDAT holds only `rows` rows of zeros (all of them when None): a
    header that claims any size, behind a stream of a few bytes."""
    raw = (b"\x00" + b"\x00" * (3 * width)) * (height if rows is None else rows)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))


def _jpeg(tmp: Path) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp / "whole.jpg", quality=90)
    return (tmp / "whole.jpg").read_bytes()


def _cases(tmp: Path) -> dict[str, dict]:
    """name -> {file, data | sparse size | config, expect (words of the message)}."""
    jpeg = _jpeg(tmp)
    return {
        "png-decompression-bomb-40000x40000": dict(file="bomb.png", data=_png(40_000, 40_000, rows=1),
                                                   expect=["bomb.png"]),
        "png-bomb-under-pillow-error-limit": dict(file="big.png", data=_png(10_000, 10_000, rows=1),
                                                  expect=["big.png"]),
        "png-header-only": dict(file="cut.png", data=_png(64, 64)[:40], expect=["cut.png", "cannot be read"]),
        "png-garbage-after-signature": dict(file="garbage.png", data=b"\x89PNG\r\n\x1a\n" + os.urandom(512),
                                            expect=["garbage.png", "cannot be read"]),
        "jpeg-truncated": dict(file="cut.jpg", data=jpeg[: len(jpeg) // 2], expect=["cut.jpg", "cannot be read"]),
        "not-an-image-text": dict(file="notes.png", data=b"just some words\n" * 100,
                                  expect=["notes.png", "cannot be read"]),
        "huge-sparse-file": dict(file="huge.jpg", sparse=2 * LIMIT, expect=["huge.jpg", "cannot be read"]),
        "a-folder": dict(file="folder.png", folder=True, expect=["folder.png", "not a file"]),
        "processor-in-patch-limit-1e12": dict(config={"in_patch_limit": 10**12}, expect=["in_patch_limit"]),
        "processor-side-limit-1e9": dict(config={"patch_limit_on_one_side": 10**9},
                                         expect=["patch_limit_on_one_side"]),
        "processor-patch-size-string": dict(config={"patch_size": "14"}, expect=["patch_size"]),
    }


_CHILD = r"""
import json, resource, sys
from k3export.modeling.image_processing_k3 import K3ImageError, K3ImageProcessor

def vm():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize:"))

limit = vm() + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
results = {}
for name, case in json.loads(sys.argv[1]).items():
    try:
        if "config" in case:
            K3ImageProcessor.from_pretrained(case["folder"])
        else:
            K3ImageProcessor().preprocess([case["path"]])
        results[name] = {"kind": "accepted"}
    except K3ImageError as exc:
        results[name] = {"kind": "K3ImageError", "message": str(exc)}
    except BaseException as exc:
        results[name] = {"kind": type(exc).__name__, "message": str(exc)[:300]}
print(json.dumps(results))
"""


def _stat(root: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of everything under `root` (hashing the sparse gigabytes would take a minute)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _prepare(name: str, case: dict, tmp: Path) -> dict:
    if "config" in case:
        folder = tmp / name
        folder.mkdir()
        (folder / "preprocessor_config.json").write_text(json.dumps(
            {"image_processor_type": "K3ImageProcessor", **case["config"]}))
        return {"config": True, "folder": str(folder)}
    path = tmp / case["file"]
    if case.get("folder"):
        path.mkdir()
    elif "sparse" in case:
        with open(path, "wb") as fh:
            fh.truncate(case["sparse"])
    else:
        path.write_bytes(case["data"])
    return {"path": str(path)}


#: every case
NAMES = ("png-decompression-bomb-40000x40000", "png-bomb-under-pillow-error-limit", "png-header-only",
         "png-garbage-after-signature", "jpeg-truncated", "not-an-image-text", "huge-sparse-file", "a-folder",
         "processor-in-patch-limit-1e12", "processor-side-limit-1e9", "processor-patch-size-string")


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> tuple[Path, dict, dict, dict]:
    """Every case prepared under one folder and run in one child process (imports cost seconds); (the folder, the
    cases, what each became, the folder's snapshot before the run)."""
    tmp = tmp_path_factory.mktemp("images")
    (tmp / "in").mkdir()
    cases = _cases(tmp)
    requests = {name: _prepare(name, case, tmp / "in") for name, case in cases.items()}
    before = _stat(tmp / "in")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(requests), str(LIMIT)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, cases, json.loads(proc.stdout.strip().splitlines()[-1]), before


@pytest.mark.parametrize("name", NAMES)
def test_hostile_image_is_refused_in_one_line(name, refused):
    tmp, cases, results, before = refused
    out = results[name]
    assert out["kind"] == "K3ImageError", out
    message = out["message"]
    assert "\n" not in message.strip(), message
    for word in cases[name]["expect"]:
        assert word in message, (word, message)
    assert _stat(tmp / "in") == before  # the processor only read


def test_image_cases_are_all_listed(tmp_path):
    assert set(NAMES) == set(_cases(tmp_path))
