"""``k3export convert`` and ``k3export plan``: released K3 / Kimi-Linear checkpoints -> our layout."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import typer
from rich.table import Table

from k3export.units import format_bytes

from .common import console, forms_table, user_errors

_SIZE_RX = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


MAX_SIZE = 2**62  # 4.6 EB: far beyond any disk, far below what overflows


def parse_size(text: str, option: str = "--max-shard-size") -> int:
    """'5GB' -> 5_000_000_000; '512MiB', '1e6' and plain byte counts work too; from 1 byte to `MAX_SIZE`."""
    m = _SIZE_RX.match(text)
    try:
        if m is None or m.group(2).upper() not in _UNITS:
            value = float(text)
        else:
            value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    except ValueError:
        raise typer.BadParameter(f"not a size: {text!r} (e.g. 5GB, 512MiB, 1000000)", param_hint=option) from None
    if not (math.isfinite(value) and 1 <= value <= MAX_SIZE):
        raise typer.BadParameter(f"{text!r} is out of range (1 byte to {format_bytes(MAX_SIZE)})",
                                 param_hint=option)
    return int(value)


_EXPERTS_HELP = ("Routed experts: dense (decoded, the default), mxfp4 (kept packed, as --keep-mxfp4) or nvfp4 "
                 "(the MXFP4 release cast bit-exactly into NVIDIA's NVFP4 layout).")


def _experts(experts: str | None, keep_mxfp4: bool) -> str | None:
    """--experts, with --keep-mxfp4 as its old spelling of mxfp4; both at odds: one line."""
    from k3export.errors import CheckpointError

    if keep_mxfp4 and experts not in (None, "mxfp4"):
        raise CheckpointError(f"--keep-mxfp4 and --experts {experts} disagree: give one")
    return experts


def register(app: typer.Typer) -> None:
    @app.command("convert")
    def convert_cmd(
        src_dir: Path = typer.Argument(..., help="Released K3 / Kimi-Linear checkpoint folder."),
        out_dir: Path = typer.Argument(..., help="Output folder (our layout)."),
        dtype: str = typer.Option("bf16", "--dtype", help="Output dtype of dense weights: bf16 or fp32."),
        keep_mxfp4: bool = typer.Option(False, "--keep-mxfp4", help="Keep routed experts packed as MXFP4."),
        experts: str = typer.Option(None, "--experts", help=_EXPERTS_HELP),
        workers: int = typer.Option(1, "--workers", min=1, max=1024,
                                    help="Parallel processes (one source shard each)."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output shard, e.g. 5GB."),
        allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite",
                                             help="Convert NaN/Inf weights and NaN MXFP4 scales instead of refusing."),
        overwrite: bool = typer.Option(False, "--overwrite",
                                       help="Replace OUT_DIR if it is a checkpoint k3export converted (or discard an "
                                            "interrupted conversion that cannot be resumed)."),
        repo_id: str = typer.Option(None, "--repo-id", help="Hub repo of the source, for conversion.json."),
        revision: str = typer.Option(None, "--revision", help="Hub revision of the source, for conversion.json."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
        ray: bool = typer.Option(False, "--ray", help="Run the units of work as Ray tasks across a cluster (source and"
                                                      " OUT_DIR on shared storage at the same paths)."),
        ray_address: str = typer.Option(None, "--ray-address", help="The cluster for --ray (auto, HOST:PORT, "
                                                                    "ray://HOST:10001; default: RAY_ADDRESS, else a "
                                                                    "local cluster)."),
        text_only: bool = typer.Option(False, "--text-only", help="Write the text model alone (K3ForCausalLM's "
                                       "layout) of a source with a vision tower, its vision tensors skipped."),
    ) -> None:
        """Convert a checkpoint into k3export's sharded safetensors layout (streaming, resumable)."""
        max_shard_bytes = parse_size(max_shard_size)
        with user_errors():
            from k3export.safety import CHECKPOINT, check_output

            check_output(out_dir, CHECKPOINT, overwrite=overwrite, sources=[src_dir])  # before the heavy imports
            from k3export.converters.checkpoints import convert

            executor = None
            if ray or ray_address:
                from k3export.converters.checkpoints.ray_convert import RayExecutor
                from k3export.pipeline.ray_cluster import check_ray_address

                check_ray_address(ray_address)  # nothing there: one line within a bounded time, not Ray's retries
                executor = RayExecutor(ray_address)
            try:
                manifest = convert(src_dir, out_dir, dtype=dtype, keep_mxfp4=keep_mxfp4, workers=workers,
                                   max_shard_bytes=max_shard_bytes, allow_nonfinite=allow_nonfinite,
                                   overwrite=overwrite, progress=progress, repo_id=repo_id, revision=revision,
                                   executor=executor, text_only=text_only,
                                   experts=_experts(experts, keep_mxfp4))
            finally:
                if executor is not None:
                    executor.shutdown(wait=False, cancel_futures=True)
        total = sum(o["bytes"] for o in manifest["outputs"])
        skipped = ", ".join(f"{k} {v}" for k, v in manifest["skipped"].items()) or "none"
        console.print(f"[green]converted[/] {src_dir} -> {out_dir}: {len(manifest['outputs'])} shards, "
                      f"{format_bytes(total)}; skipped {skipped}", highlight=False)
        cast = manifest.get("nvfp4_cast")
        if cast:
            console.print(f"NVFP4 blocks: {cast['lossless_blocks']} of {cast['blocks']} cast bit-exactly, "
                          f"{cast['fallback_blocks']} from an amax scale", highlight=False)

    @app.command("plan")
    def plan_cmd(
        src_dir: Path = typer.Argument(..., help="Released K3 / Kimi-Linear checkpoint folder."),
        dtype: str = typer.Option("bf16", "--dtype", help="Output dtype of dense weights: bf16 or fp32."),
        keep_mxfp4: bool = typer.Option(False, "--keep-mxfp4", help="Keep routed experts packed as MXFP4."),
        experts: str = typer.Option(None, "--experts", help=_EXPERTS_HELP),
        workers: int = typer.Option(1, "--workers", min=1, max=1024,
                                    help="Parallel processes the conversion would use."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output shard, e.g. 5GB."),
        as_json: bool = typer.Option(False, "--json", help="Print the full plan (every shard and tensor) as JSON."),
        text_only: bool = typer.Option(False, "--text-only", help="Plan the text model alone of a source with a "
                                       "vision tower (its vision tensors skipped)."),
    ) -> None:
        """Show what `convert` would do: tensors by kind, bytes in/out, peak memory and disk, skipped tensors."""
        max_shard_bytes = parse_size(max_shard_size)
        with user_errors():
            from k3export.converters.checkpoints import make_plan, plan_to_json

            plan = make_plan(src_dir, dtype=dtype, keep_mxfp4=keep_mxfp4, workers=workers,
                             max_shard_bytes=max_shard_bytes, text_only=text_only,
                             experts=_experts(experts, keep_mxfp4))
        if as_json:
            from k3export.converters.onnx.quantize import quantized_param_names
            from k3export.info import bits_by_part

            data = plan_to_json(plan)
            data["bits_per_weight_by_part"] = {
                r.part: {"parameters": r.params, **r.bits, **({"mxfp4": r.mxfp4_bits} if r.mxfp4_bits else {})}
                for r in bits_by_part(plan.config, quantized_param_names(plan.config))}
            typer.echo(json.dumps(data, indent=2))
            return
        s = plan.summary()
        target = ("NVIDIA's NVFP4 layout" if plan.options.get("experts") == "nvfp4" else
                  "image + text" if s["vision"] else "text model")
        table = Table(title=f"plan: {src_dir} ({s['layout']} layout -> {target})")
        table.add_column("kind")
        table.add_column("tensors", justify="right")
        table.add_column("bytes in", justify="right")
        table.add_column("bytes out", justify="right")
        for kind, row in s["by_kind"].items():
            table.add_row(kind, str(row["tensors"]), format_bytes(row["bytes_in"]), format_bytes(row["bytes_out"]))
        for group, count in s["skipped"].items():
            table.add_row(f"skipped: {group}", str(count), "", "")
        table.add_row("[bold]total[/]", str(s["tensors_out"]), format_bytes(s["bytes_in"]), format_bytes(s["bytes_out"]))
        console.print(table)
        console.print(f"source files: {s['source_files']}   output shards: {s['output_shards']}   "
                      f"skipped bytes: {format_bytes(s['skipped_bytes'])}", highlight=False)
        console.print(f"predicted peak memory: {format_bytes(s['peak_memory_bytes'])} ({s['workers']} worker(s))   "
                      f"disk needed: {format_bytes(s['disk_bytes'])}", highlight=False)
        console.print(forms_table(plan.config))
