"""This process's memory pages under the runtimes' weights (Linux; a no-op elsewhere).

- `huge_pages`: the runtimes' own copies of the weights (ONNX Runtime's prepacked products, OpenVINO's repacked
  ones) are anonymous memory in 4 KiB pages; a decode step reads all of them once, and in 4 KiB pages the hardware
  prefetchers stop at every page and every page costs a TLB entry. Collapsed into 2 MiB pages (``MADV_COLLAPSE``,
  Linux >= 6.1, whatever the system's transparent-huge-page default) they read faster
  (`bench/exports_ab.py DIR DIR --pages 4k,2m`).
- `release_mapped_pages`: drop the resident pages of mapped weight files that the runtime has copied.

``K3EXPORT_HUGE_PAGES=0`` turns `huge_pages` off for the sessions that call it (`enabled`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable, Iterator, Sequence

#: the environment switch: ``K3EXPORT_HUGE_PAGES=0`` leaves the sessions' memory in the system's default pages
ENV_SWITCH = "K3EXPORT_HUGE_PAGES"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _huge_page() -> int:
    try:  # the size of a transparent huge page (2 MiB on x86-64)
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _huge_page()
_MADV_DONTNEED, _MADV_COLLAPSE = 4, 25

Span = tuple[int, int]


def enabled() -> bool:
    """Whether sessions back their resident weights with huge pages (``K3EXPORT_HUGE_PAGES`` unset or on:
    `k3export.switches`)."""
    from k3export import switches

    return switches.flag(ENV_SWITCH)


def session_loaded(on_cpu: bool = True) -> int:
    """What a session calls once its weights are in place: `huge_pages` for a session whose weights are in host
    memory, unless switched off (`enabled`); the bytes now in huge pages."""
    return huge_pages() if on_cpu and enabled() else 0


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


def _mappings() -> Iterator[tuple[Span, str, str]]:
    """(span, permissions, path or pseudo-name or '') of each of this process's mappings."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        yield (lo, hi), parts[1], parts[5] if len(parts) == 6 else ""


def anonymous_memory() -> list[Span]:
    """This process's private writable anonymous mappings (the heap and named ones included), as address spans."""
    return [span for span, perms, name in _mappings()
            if perms.startswith("rw") and (name in ("", "[heap]") or name.startswith("[anon:"))]


def without(span: Span, skip: Sequence[Span]) -> list[Span]:
    """The parts of `span` outside every span of `skip`."""
    parts = [span]
    for lo, hi in skip:
        parts = [p for a, b in parts for p in ((a, min(b, lo)), (max(a, hi), b)) if p[1] > p[0]]
    return parts


def huge_pages(skip: Sequence[Span] = ()) -> int:
    """Collapse the resident anonymous memory of this process into huge pages (`HUGE_PAGE`, 2 MiB on x86-64), every
    aligned huge page's worth whose small pages are all resident (so nothing is added to the resident set), leaving
    the address spans `skip` alone; returns the bytes now in huge pages (0 off Linux, on a kernel without
    ``MADV_COLLAPSE``, or when the system forbids huge pages).

    Sessions call it once their weights are in place (`session_loaded`). Collapsing copies the
    memory once (~0.1 s for big_cfg's ~90 MB)."""
    libc = _libc()
    if libc is None:
        return 0
    vec = (ctypes.c_ubyte * (HUGE_PAGE // PAGE))()
    done = 0
    for span in anonymous_memory():
        for lo, hi in without(span, skip):
            for at in range(-(-lo // HUGE_PAGE) * HUGE_PAGE, hi - HUGE_PAGE + 1, HUGE_PAGE):
                if libc.mincore(at, HUGE_PAGE, vec) != 0 or 0 in bytes(vec):  # a page not resident
                    continue
                if libc.madvise(at, HUGE_PAGE, _MADV_COLLAPSE) == 0:
                    done += HUGE_PAGE
    return done


def release_mapped_pages(files: Iterable[str]) -> int:
    """Drop this process's resident pages of its read-only mappings of `files` (resolved paths); returns the bytes
    of mapping they spanned (0 off Linux, or when nothing maps them).

    OpenVINO maps an ONNX file's external data, and its CPU plugin reads all of it while compiling (each fp32
    constant is scanned for subnormals, the projections repacked into memory of its own): the pages it read stay
    resident, though the repacked originals are never read again. ``MADV_DONTNEED`` on a mapping that cannot be
    written only forgets the pages; what is still read (the k3 extension's experts, the embedding rows) faults back
    from the page cache when next touched. `OpenVinoSession` calls it while compiling and after."""
    files = set(files)
    libc = _libc() if files else None
    if libc is None:
        return 0
    names = {os.path.basename(f) for f in files}  # resolve only the mappings that may be ours
    done = 0
    for (lo, hi), perms, name in _mappings():
        if "w" in perms or os.path.basename(name) not in names or os.path.realpath(name) not in files:
            continue
        if libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            done += hi - lo
    return done
