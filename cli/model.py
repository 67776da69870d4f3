"""`k3export tiny` and `k3export info`: make a tiny random K3 (with a small tokenizer), describe any K3 model or a
TensorRT engine `k3export build` wrote."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from k3export.units import format_bytes

from .common import console, forms_table, user_errors


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{suffix}{unit}"
        n /= 1000
    return f"{n:.3g}E{unit}"


def _span(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}-{last}"


def _spans_by_kind(kinds: dict[int, str]) -> str:
    """{0: "dense", 1: "dense", 7: "mlp"} -> "layers 0-1: dense, layer 7: mlp"."""
    parts: list[str] = []
    for layer in sorted(kinds):
        if parts and layer == last + 1 and kinds[layer] == kinds[first]:
            last = layer
            parts[-1] = f"layers {_span(first, last)}: {kinds[first]}"
            continue
        first = last = layer
        parts.append(f"layer {layer}: {kinds[layer]}")
    return ", ".join(parts)


def tiny(
    out_dir: Path = typer.Argument(..., help="Folder to write the checkpoint into (must not exist or be empty)."),
    seed: int = typer.Option(0, help="Random seed for the weights."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT_DIR."),
    vision: bool = typer.Option(False, "--vision", help="Image + text: add a tiny MoonViT-V2 tower and projector, "
                                "K3's media tokens and the processor files (the released model's layout)."),
) -> None:
    """Write a tiny random K3 checkpoint (all K3 features on, activations O(1)) with a small BPE tokenizer;
    --vision: with a tiny vision tower, so an image goes in and text comes out."""
    with user_errors():
        from k3export.checkpoint_io import write_tiny_checkpoint, write_tiny_vision_checkpoint

        write = write_tiny_vision_checkpoint if vision else write_tiny_checkpoint
        path = write(out_dir, seed=seed, overwrite=overwrite)
        kind, example = ("image + text K3", '"What is in this picture?" --image cat.png') if vision \
            else ("K3", '"Hello"')
        console.print(f"wrote tiny {kind} checkpoint (seed {seed}) to [bold]{path}[/]; try: k3export generate {path} "
                      f"{example}", highlight=False)


def _engine_info(engine: Path) -> None:
    from k3export.info import engine_summary

    table = Table(title=f"TensorRT engine {engine.name}", show_header=False)
    table.add_column("")
    table.add_column("")
    for label, value in engine_summary(engine):
        table.add_row(label, value)
    console.print(table)


def _is_engine(model: str) -> bool:
    """A file with an engine's suffix, or one with an engine sidecar beside it."""
    from k3export.artifacts import EngineSidecar

    path = Path(model)
    return path.is_file() and (path.suffix in (".engine", ".plan")
                               or (path.parent / (path.name + EngineSidecar.SUFFIX)).is_file())


def info(
    model: str = typer.Argument(..., help="A model folder (config.json), a preset (k3, tiny, tiny-kimi-linear), or a "
                                          "TensorRT engine built by `k3export build`."),
    context: int = typer.Option(131072, min=0, max=1 << 40, help="Context length for the per-sequence decode-state size."),
    batch: int = typer.Option(1, min=1, max=1 << 20, help="Batch size for the decode-state size."),
    dtype: str = typer.Option("bf16", help="Activation dtype of conv states and latents: bf16, fp16 or fp32."),
) -> None:
    """Print the layer layout, parameter counts (total, active per token) and decode-state bytes; for an engine, how
    it was built (TensorRT flavour and version, target, plugins, layers)."""
    with user_errors():
        if _is_engine(model):
            _engine_info(Path(model))
            return
        from k3export.checkpoint_io import load_config, load_vision_config
        from k3export.dtypes import export_dtype
        from k3export.info import count_parameters, count_vision_parameters, decode_state_bytes, layer_layout

        export_dtype(dtype)  # one line naming the choices for anything but fp32 / bf16 / fp16
        config = load_config(model)
        layers = layer_layout(config)
        layout = Table(title=f"{model}: {layers.num_layers} layers", show_lines=False)
        layout.add_column("layers (0-based)")
        layout.add_column("attention")
        for run in layers.attention:
            layout.add_row(_span(run.start, run.stop - 1), str(run))
        console.print(layout)
        others = _spans_by_kind(layers.ffn_exceptions)
        console.print(f"FFN: {layers.ffn}" + (f", except {others}" if others else " in every layer"), highlight=False)
        features = {
            "KDA gate": "bounded sigmoid" if config.linear_attn_config["gate_lower_bound"] is not None else "softplus",
            "MLA output gate": config.mla_use_output_gate,
            "LatentMoE": config.use_latent_moe,
            "Attention Residuals": f"blocks of {config.attn_res_block_size}" if config.use_attn_res else False,
            "FFN activation": config.hidden_act,
        }
        console.print("features: " + ", ".join(f"{k}={v}" for k, v in features.items()))
        counts = count_parameters(config)
        vision = load_vision_config(model)
        table = Table(title="parameters")
        table.add_column("kind")
        table.add_column("count", justify="right")
        for kind, n in sorted(counts.by_kind.items(), key=lambda kv: -kv[1]):
            table.add_row(kind, _human(n))
        if vision is not None:  # once per image, not per text token: in the total, not in the active count
            for kind, n in count_vision_parameters(vision).items():
                counts.add(kind, n, active=0)
                table.add_row(f"{kind} (per image)", _human(n))
        table.add_row("[bold]total[/]", f"[bold]{_human(counts.total)}[/]")
        table.add_row("[bold]active per token[/]", f"[bold]{_human(counts.active)}[/]")
        console.print(table)
        console.print(forms_table(config))
        state = decode_state_bytes(config, context=context, batch=batch, dtype=dtype)
        console.print(
            f"decode state ({dtype} activations, fp32 KDA state, batch {batch}): "
            f"{format_bytes(state.per_token)} per token (MLA latents), {format_bytes(state.constant)} constant (KDA), "
            f"{format_bytes(state.per_sequence)} for a {context}-token context"
        )


def register(app: typer.Typer) -> None:
    app.command("tiny")(tiny)
    app.command("info")(info)
