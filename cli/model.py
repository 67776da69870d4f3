"""`k3export tiny` and `k3export info`: make a tiny random K3, describe any K3 model."""

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


def tiny(
    out_dir: Path = typer.Argument(..., help="Folder to write the checkpoint into (must not exist or be empty)."),
    seed: int = typer.Option(0, help="Random seed for the weights."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT_DIR."),
) -> None:
    """Write a tiny random K3 checkpoint (all K3 features on, activations O(1))."""
    with user_errors():
        from k3export.checkpoint_io import write_tiny_checkpoint

        path = write_tiny_checkpoint(out_dir, seed=seed, overwrite=overwrite)
        console.print(f"wrote tiny K3 checkpoint (seed {seed}) to [bold]{path}[/]")


def info(
    model: str = typer.Argument(..., help="A model folder (config.json) or a preset: k3, tiny, tiny-kimi-linear."),
    context: int = typer.Option(131072, min=0, max=1 << 40, help="Context length for the per-sequence decode-state size."),
    batch: int = typer.Option(1, min=1, max=1 << 20, help="Batch size for the decode-state size."),
    dtype: str = typer.Option("bf16", help="Activation dtype of conv states and latents: bf16, fp16 or fp32."),
) -> None:
    """Print the layer layout, parameter counts (total, active per token) and decode-state bytes."""
    with user_errors():
        from k3export.checkpoint_io import load_config
        from k3export.dtypes import export_dtype
        from k3export.info import count_parameters, decode_state_bytes

        export_dtype(dtype)  # one line naming the choices for anything but fp32 / bf16 / fp16
        config = load_config(model)
        kinds = [f"{a}+{m}" for a, m in zip(config.attn_types, config.mlp_types)]
        layout = Table(title=f"{model}: {config.num_hidden_layers} layers", show_lines=False)
        layout.add_column("layers (0-based)")
        layout.add_column("attention + FFN")
        start = 0
        for i in range(1, len(kinds) + 1):
            if i == len(kinds) or kinds[i] != kinds[start]:
                span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
                layout.add_row(span, kinds[start])
                start = i
        console.print(layout)
        features = {
            "KDA gate": "bounded sigmoid" if config.linear_attn_config["gate_lower_bound"] is not None else "softplus",
            "MLA output gate": config.mla_use_output_gate,
            "LatentMoE": config.use_latent_moe,
            "Attention Residuals": f"blocks of {config.attn_res_block_size}" if config.use_attn_res else False,
            "FFN activation": config.hidden_act,
        }
        console.print("features: " + ", ".join(f"{k}={v}" for k, v in features.items()))
        counts = count_parameters(config)
        table = Table(title="parameters")
        table.add_column("kind")
        table.add_column("count", justify="right")
        for kind, n in sorted(counts.by_kind.items(), key=lambda kv: -kv[1]):
            table.add_row(kind, _human(n))
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
