"""Export the graph of the released K3 (93 layers, 896 experts) without weights; print wall time and peak RSS.

    python bench/export_full.py [--dtype bf16] [--out DIR]

Weights are declared (external-data references) but not written; see k3export.converters.onnx.
Targets: < 15 min and peak RSS < 8 GiB on a 2-core machine.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", type=Path, default=None, help="keep the export here (default: a temp folder)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    from k3export.converters.onnx import export_onnx
    from k3export.modeling.configuration_k3 import K3Config

    tmp = None
    out = args.out
    if out is None:
        tmp = tempfile.mkdtemp()
        out = Path(tmp) / "k3_full"
    try:
        res = export_onnx(K3Config.k3(), out, dtype=args.dtype, weights=False, overwrite=True)
        wall = time.perf_counter() - t0
        rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        size = res.model_path.stat().st_size
        print(f"full K3 graph ({args.dtype}, no weights): {res.num_nodes} nodes, {res.num_initializers} "
              f"initializers, {res.weight_bytes / 2**40:.2f} TiB declared in {len(res.data_files)} shard files, "
              f"{len(res.manifest['states'])} state tensors, model.onnx {size / 2**20:.1f} MiB")
        print(f"time {wall:.1f} s (export {res.seconds:.1f} s), peak RSS {rss_gib:.2f} GiB")
        ok = wall < 15 * 60 and rss_gib < 8
        print("within targets (< 15 min, < 8 GiB):", ok)
        raise SystemExit(0 if ok else 1)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
