"""``python -m k3export.runtime.build_native``: build k3export's native libraries now, ONNX Runtime's k3 ops
(`ort_ops`) and OpenVINO's k3 extension (`ov_ext`), into their caches (`native.build_cached`). CI runs it before the
tests; a user may, to pay the build before the first session. Prints each library's path or the one line saying why
it cannot be built here; exits 1 when one cannot."""

from __future__ import annotations

import sys

from . import ort_ops, ov_ext
from .native import BuildError


def main(argv: list[str] | None = None) -> int:
    """Build both libraries now: print each one's path, or why it cannot be built here; 1 when one cannot."""
    failed = 0
    for name, build in (("onnxruntime k3 ops", ort_ops.build), ("openvino k3 extension", ov_ext.build)):
        try:
            print(f"{name}: {build()}")
        except BuildError as exc:
            print(f"{name}: not built: {exc}")
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
