"""Our own checkpoint folders: load a config from a folder or preset, write the tiny demo checkpoint.

Writes go through `k3export.safety.output_folder`: a temporary sibling renamed into place when complete (so an
interrupted write never leaves a folder that looks like a finished checkpoint), locked, and replacing only a
checkpoint k3export wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

from k3export.errors import CheckpointError, K3ExportError
from k3export.files import CONFIG_NAME, read_config_json
from k3export.modeling import K3Config
from k3export.modeling.configuration_k3 import K3VisionConfig
from k3export.safety import CHECKPOINT, check_output, output_folder

PRESETS = {"k3": K3Config.k3, "tiny": K3Config.tiny, "tiny-kimi-linear": K3Config.tiny_kimi_linear}


def preset_config(name: str) -> K3Config | None:
    """The preset called `name` (``k3``, ``tiny``, ``tiny-kimi-linear``; '_' works for '-'), else None."""
    factory = PRESETS.get(str(name).replace("_", "-"))
    return factory() if factory is not None else None


def load_config(model: str | os.PathLike[str]) -> K3Config:
    """A preset name (see `preset_config`) or a folder whose ``config.json`` is ours,
    the released K3 one (nested ``text_config``) or a Kimi-Linear one."""
    preset = preset_config(str(model))
    if preset is not None:
        return preset
    path = Path(model) / CONFIG_NAME
    if not os.path.lexists(path):
        raise CheckpointError(f"{model}: no config.json (expected a model folder or one of {sorted(PRESETS)})")
    data = read_config_json(model)
    try:
        return K3Config.from_released_dict(data)
    except (ValueError, TypeError) as exc:  # K3ConfigError is a ValueError: name the file it came from
        raise CheckpointError(f"{path}: {exc}") from None


def load_vision_config(model: str | os.PathLike[str]) -> K3VisionConfig | None:
    """The vision tower's config of a preset (``k3``: the released tower) or a model folder's ``config.json``
    (its ``vision_config``), or None for a text-only model."""
    if preset_config(str(model)) is not None:
        return K3VisionConfig(text_hidden_size=K3Config.k3().hidden_size) if str(model) == "k3" else None
    data = read_config_json(model)
    vision = data.get("vision_config")
    if vision is None:
        return None
    if not isinstance(vision, dict):
        raise CheckpointError(f"{Path(model) / CONFIG_NAME}: vision_config must be an object, got "
                              f"{type(vision).__name__}")
    try:
        return K3VisionConfig(**vision)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{Path(model) / CONFIG_NAME}: {exc}") from None


def write_tiny_checkpoint(out_dir: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """A tiny random K3 (``K3Config.tiny()``, `randomize_weights`) saved in our format, with a small byte-level BPE
    tokenizer (`k3export.tokenizer.write_tiny_tokenizer`), so text goes in and comes out."""
    from k3export.modeling import save_pretrained, tiny_model
    from k3export.tokenizer import write_tiny_tokenizer

    if not 0 <= seed < 2**64:
        raise K3ExportError(f"--seed must be in [0, 2**64), got {seed}")
    check_output(out_dir, CHECKPOINT, overwrite=overwrite)  # refuse before building the model
    model = tiny_model(seed)
    with output_folder(out_dir, CHECKPOINT, overwrite=overwrite) as tmp:
        try:
            save_pretrained(model, tmp)
        except Exception as exc:
            if type(exc).__name__ != "SafetensorError":  # safetensors' writer: disk full, I/O error
                raise
            raise CheckpointError(f"{out_dir}: could not write the checkpoint ({exc})") from None
        write_tiny_tokenizer(tmp, model.config)
    return Path(out_dir)
