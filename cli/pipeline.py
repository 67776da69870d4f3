"""``k3export deploy-plan``: a model over N devices (bytes per stage, state per token, longest context that fits),
plus what ``export --stages``, ``run PIPELINE_DIR`` and ``validate --runtimes ...,pipeline,ray`` call.

Why a separate name and not ``plan --devices``: ``k3export plan SRC_DIR`` plans a checkpoint conversion (tensors,
shards, peak memory of the converter); this plans a deployment (stages, device memory, context). The two share no
option, and one command doing both would make every option's meaning depend on another's presence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from .common import bytes_bar, console, user_errors


def register(app: typer.Typer) -> None:
    app.command("deploy-plan")(deploy_plan)


def _expert_format(experts: str, model: str, config_json: dict[str, Any] | None) -> str:
    """mxfp4, nvfp4 or dense: as asked, or (auto) as the checkpoint stores them (`quantization_format`)."""
    from k3export.pipeline import PipelineError

    if experts not in ("auto", "mxfp4", "nvfp4", "dense"):
        raise PipelineError(f"--experts {experts!r}: choose auto, mxfp4, nvfp4 or dense")
    if experts != "auto":
        return experts
    if model == "k3":  # the released model ships its routed experts in MXFP4
        return "mxfp4"
    if config_json is None:
        return "dense"
    from k3export.converters.checkpoints.layouts import quantization_format

    return quantization_format(config_json, model) or "dense"


def _vision_config(name: str, config_json: dict[str, Any] | None) -> Any:
    """The vision tower `export` would write image graphs for (the ``k3`` preset's, a folder's MoonViT-V2
    ``vision_config``), else None: a tower k3export does not implement exports, and so plans, text-only."""
    from k3export.checkpoint_io import preset_model_config
    from k3export.converters.onnx.export import resolve_vision
    from k3export.errors import ConfigError

    preset = preset_model_config(name)
    try:
        vl = resolve_vision(preset, None) if preset is not None else resolve_vision(name, config_json)
    except ConfigError:
        return None
    return None if vl is None else vl.vision_config


def deploy_plan(
    model: str | None = typer.Argument(None, metavar="[MODEL]", help="Model folder (its config.json) or a preset: "
                                                                     "k3, tiny, tiny-kimi-linear."),
    config: str | None = typer.Option(None, "--config", help="A preset instead of MODEL: k3, tiny, tiny-kimi-linear."),
    devices: int = typer.Option(..., "--devices", min=1, max=1 << 16, help="Devices, one pipeline stage each."),
    device_memory: str = typer.Option(..., "--device-memory", help="Memory of one device, e.g. 141GB, 80GiB."),
    context: int | None = typer.Option(None, "--context", min=0, max=1 << 40,
                                       help="Tokens per sequence to fit (default: report the longest that fits)."),
    batch: int = typer.Option(1, "--batch", min=1, max=1 << 20, help="Sequences decoded together."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weights and activations: bf16, fp16 or fp32."),
    experts: str = typer.Option("auto", "--experts", help="Routed experts: mxfp4 (4.25 bits/weight), nvfp4 (4.5), "
                                                          "dense (--dtype) or auto (as the checkpoint stores them; "
                                                          "mxfp4 for k3)."),
    reserve: str = typer.Option("8GB", "--reserve", help="Memory per device kept for the runtime (CUDA context, "
                                                         "activations, engine workspace)."),
    stage_plan: Path | None = typer.Option(None, "--stage-plan", help="Use these layer ranges instead of planning."),
    write_plan: Path | None = typer.Option(None, "--write-plan", help="Write the stage plan for "
                                                                      "`export --stage-plan`."),
    text_only: bool = typer.Option(False, "--text-only", help="Plan the text model alone, without the vision tower "
                                                              "and projector stage 0 holds for an image + text model."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Plan MODEL over --devices devices: bytes per stage, state per token, the longest context that fits.

    An image + text model (k3, a folder with a vision_config) puts its vision tower and projector on stage 0, as
    `export --stages` does. A plan that does not fit is refused (exit 2, one line), saying by how much."""
    with user_errors():
        from .convert import parse_size

        mem = parse_size(device_memory, "--device-memory")
        keep = parse_size(reserve, "--reserve") if reserve.strip() not in ("0", "0B") else 0
        from rich.table import Table

        from k3export.checkpoint_io import load_config
        from k3export.files import read_json
        from k3export.pipeline import PipelineError, deploy_plan as plan_deployment, read_stage_plan
        from k3export.units import format_bytes

        from k3export.checkpoint_io import PRESETS
        from k3export.dtypes import export_dtype

        if model is None and config is None:
            raise PipelineError(f"give MODEL (a model folder or a preset: {', '.join(PRESETS)}) or --config PRESET")
        if model is not None and config is not None:
            raise PipelineError("give MODEL or --config PRESET, not both")
        export_dtype(dtype)  # one line naming what --dtype takes (fp32, bf16, fp16)
        name = config or model
        cfg = load_config(name)
        path = Path(name) / "config.json"
        config_json = read_json(path) if path.is_file() else None
        fmt = _expert_format(experts, name, config_json)
        ranges = read_stage_plan(stage_plan, cfg.num_hidden_layers) if stage_plan is not None else None
        vision = None if text_only else _vision_config(name, config_json)
        dp = plan_deployment(cfg, devices, mem, context=context, batch=batch, dtype=dtype,
                             mxfp4_experts=fmt == "mxfp4", nvfp4_experts=fmt == "nvfp4", reserve=keep, ranges=ranges,
                             vision_config=vision)
        if write_plan is not None:
            dp.plan.write(write_plan)
    if as_json:
        typer.echo(json.dumps(dp.to_json(), indent=1))
        return
    ctx = context or 0
    longest = dp.max_context
    table = Table(title=f"{name} on {devices} x {device_memory} ({format_bytes(mem)}), {dp.plan.costs.dtype}, "
                        f"routed experts {fmt.upper() if fmt != 'dense' else 'dense'}, batch {batch}")
    for col in ("stage", "layers", "weights", "state / token", "state fixed", f"total @ {ctx}", "longest context"):
        table.add_column(col, justify="left" if col in ("stage", "layers") else "right")
    for s in dp.plan.stages:
        c = dp.stage_context(s)
        table.add_row(str(s.index), s.span, format_bytes(s.weight_bytes), format_bytes(s.state_per_token * batch),
                      format_bytes(s.state_constant * batch), format_bytes(dp.need(s) - dp.reserve),
                      "unbounded" if c is None else f"{c:,}")
    console.print(table)
    total = sum(s.weight_bytes for s in dp.plan.stages)
    worst = max(dp.plan.stages, key=lambda s: dp.need(s))
    tower = f" (the vision tower + projector, {format_bytes(dp.plan.costs.vision)}, on stage 0)" if vision else ""
    console.print(f"weights {format_bytes(total)} in all{tower}; largest stage {worst.index} needs "
                  f"{format_bytes(dp.need(worst))} of {format_bytes(mem)} with {format_bytes(keep)} reserved at "
                  f"context {ctx}; longest context that fits: "
                  f"{'unbounded' if longest is None else f'{longest:,} tokens'} x batch {batch}", highlight=False)
    if write_plan is not None:
        console.print(f"stage plan written to {write_plan} (k3export export MODEL OUT --stage-plan {write_plan})",
                      highlight=False)


# ---------------------------------------------------------------------------------------------- for other commands
def export_stages(source: Any, target: Path, *, stages: int | None, stage_plan: Path | None, dtype: str,
                  opset: int, weights: bool, overwrite: bool, debug_outputs: bool, experts: str | None = None,
                  allow_nonfinite: bool = False, progress: bool = True, vision: bool | None = None,
                  state_window: int = 0) -> None:
    """The body of ``k3export export ... --stages N | --stage-plan FILE`` (inside the command's `user_errors`)."""
    from k3export.pipeline import export_pipeline
    from k3export.units import format_bytes

    with bytes_bar(progress and weights, "writing weights") as bar:
        result = export_pipeline(source, target, stages=stages, stage_plan=stage_plan, dtype=dtype, opset=opset,
                                 weights=weights, overwrite=overwrite, debug_outputs=debug_outputs, experts=experts,
                                 allow_nonfinite=allow_nonfinite, vision=vision, state_window=state_window,
                                 progress=lambda m: console.print(m, highlight=False),
                                 bytes_progress=bar)
    state = "weights written" if result.weights_materialized else "weights declared only (not written)"
    per_stage = ", ".join(format_bytes(b) for b in result.weight_bytes)
    console.print(f"exported {len(result.plan)} stages to {result.out_dir} (pipeline.json, export "
                  f"{result.export_id[:12]}): {sum(result.num_nodes)} nodes, {state}; weights per stage: {per_stage}; "
                  f"{result.seconds:.1f} s", highlight=False)


def open_runner(path: Path, *, ray: bool = False, address: str | None = None, runtime: str = "trt") -> Any:
    """The runner of a pipeline export for ``k3export run``: its stages chained in this process, or one Ray actor
    per stage; each stage on `runtime` (trt: the engine in its folder, ort, ort-cuda)."""
    if ray:
        from k3export.pipeline.ray_runner import RayPipelineRunner

        return RayPipelineRunner(path, address=address, runtime=runtime)
    from k3export.pipeline.runner import PipelineRunner

    return PipelineRunner(path, runtime=runtime)
