"""From a released-layout Kimi K3 checkpoint to a validated ONNX export ready for the Hub, in Python.

    python examples/end_to_end.py [WORK_DIR]

Uses a tiny synthetic checkpoint in the exact released layout (nested text_config, MXFP4 experts,
vision tensors) so it runs on a laptop CPU in about a minute; point SRC at a real download to do the
same with moonshotai/Kimi-K3 (on a machine sized for it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k3export.converters.checkpoints import convert, make_plan
from k3export.converters.checkpoints.synthetic import write_checkpoint
from k3export.converters.onnx import export_onnx
from k3export.hub import plan_push
from k3export.validate.api import raise_on_failure, run_validation


def main(work: Path) -> None:
    src = write_checkpoint(work / "released", layout="kimi_k3", num_shards=3)  # or a real snapshot folder
    plan = make_plan(src, dtype="fp32")
    print(f"plan: {len(plan.tensors)} tensors, {plan.bytes_in:,d} bytes in -> {plan.bytes_out:,d} bytes out")

    # 1. released layout (MXFP4 experts) -> our safetensors format, streamed shard by shard
    manifest = convert(src, work / "k3", dtype="fp32", max_shard_bytes=256 * 1024)
    print(f"converted {len(manifest['source']['files'])} source shards into {len(manifest['outputs'])} outputs")

    # 2. our checkpoint -> one ONNX decoder graph for prefill and decode, with its state manifest
    result = export_onnx(work / "k3", work / "onnx", dtype="fp32", debug_outputs=True)
    print(f"exported {result.model_path}: {result.num_nodes} nodes, {len(result.manifest['states'])} states")

    # 3. ONNX Runtime against the PyTorch reference over prefill + decode (writes onnx/validation.json)
    run = run_validation(work / "k3", runtimes=["ort"], onnx_dir=work / "onnx", prompt_len=16, steps=16,
                         batch=2, report_path=work / "report.json")
    raise_on_failure(run)
    print("validation passed")

    # 4. what `k3export push work/onnx org/name` would publish (no network needed for the plan)
    push = plan_push(work / "onnx", "your-org/kimi-k3-tiny-onnx")
    for name, size in push.files:
        print(f"  {size:>12,d}  {name}")
    print(push.card[:600])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work_dir", nargs="?", type=Path, default=Path("k3export-example"),
                    help="where the checkpoints and the export go (default: ./k3export-example)")
    main(ap.parse_args().work_dir)
