"""The vision tower + projector of an image + text export, per runtime: PyTorch eager (`get_image_features`), ONNX
Runtime and OpenVINO on the exported ``vision.onnx``, side by side in one process.

    python bench/vision.py                       # released tower width, 4 blocks, one 448 x 448 image
    python bench/vision.py --layers 27 --size 896 --images 2

The tower is the released MoonViT-V2's (`K3VisionConfig` defaults: width 1024, patch 14, 2 x 2 merge) cut to
--layers blocks, random fp32 weights (`tiny_vision_model`'s `vision_weight`), its projector into the tiny text
model's width. The images are seeded noise, prepared by `K3ImageProcessor` (a 448 x 448 image is 1024 patches).
Every runtime runs the same feeds; the runtimes alternate over --repeats rounds, in reversed order every other round
(PEERS.md: interleave, never time one runtime alone), after one warm-up call each. Prints the median ms per call, the
ratio to ORT, and each runtime's largest relative difference from PyTorch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch



def main() -> None:
    from PIL import Image

    from k3export.converters.onnx.vision import VISION_FILE, export_vision
    from k3export.modeling import K3ImageProcessor, tiny_vision_model
    from k3export.modeling.configuration_k3 import K3Config, K3VisionConfig
    from k3export.modeling.contract import IMAGE_FEATURES, vision_feeds
    from k3export.runtime.openvino_session import OpenVinoSession, openvino_status
    from k3export.runtime.ort_session import OrtSession

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="vision blocks (the released tower has 27)")
    ap.add_argument("--size", type=int, default=448, help="image side in pixels")
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    text = K3Config.tiny()
    vision = K3VisionConfig(vt_num_hidden_layers=args.layers, text_hidden_size=text.hidden_size)
    model = tiny_vision_model(seed=0, text_config=text, vision_config=vision)
    budget = max(16384, args.images * (args.size // vision.patch_size) ** 2)
    processor = K3ImageProcessor(patch_size=vision.patch_size, merge_kernel_size=list(vision.merge_kernel_size),
                                 in_patch_limit=budget)
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
                for _ in range(args.images)]
    packed = processor(pictures)
    pixels, grids = packed["pixel_values"], packed["grid_thws"]
    feeds = vision_feeds(vision, pixels.numpy(), grids.numpy())

    with tempfile.TemporaryDirectory() as tmp:
        export_vision(model, Path(tmp) / "vision", dtype="fp32")
        graph = Path(tmp) / "vision" / VISION_FILE
        calls = {"torch": lambda: model.get_image_features(pixels, grids).numpy()}
        ort = OrtSession(graph, threads=args.threads)
        calls["ort"] = lambda: ort.run(feeds)[IMAGE_FEATURES]
        if openvino_status() is None:
            ov = OpenVinoSession(graph, threads=args.threads)
            calls["openvino"] = lambda: ov.run(feeds)[IMAGE_FEATURES]
        with torch.no_grad():
            ref = calls["torch"]().astype(np.float64)
            diffs = {name: float(np.abs(call() - ref).max() / np.abs(ref).max()) for name, call in calls.items()}
            times: dict[str, list[float]] = {name: [] for name in calls}
            for r in range(args.repeats):
                for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                    t0 = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - t0)
    print(f"vision tower: {args.layers} blocks of width {vision.vt_hidden_size}, {args.images} image(s) of "
          f"{args.size} x {args.size}: {int(pixels.shape[0])} patches -> {ref.shape[0]} image tokens; "
          f"{args.threads} threads, median of {args.repeats}")
    base = statistics.median(times["ort"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:9s} {1000 * med:8.1f} ms   x{med / base:5.2f} of ort   max rel diff vs torch {diffs[name]:.1e}")


if __name__ == "__main__":
    main()
