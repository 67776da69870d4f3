"""Our own checkpoint folders: load a config from a folder or preset, write the tiny demo checkpoint.

Writes go to a temporary sibling folder that is renamed into place when complete, so an interrupted
write never leaves a folder that looks like a finished checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from k3export.errors import CheckpointError, K3ExportError
from k3export.files import read_json
from k3export.modeling import K3Config

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
    path = Path(model) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model}: no config.json (expected a model folder or one of {sorted(PRESETS)})")
    return K3Config.from_released_dict(read_json(path, CheckpointError))


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `out_dir`; rename it to `out_dir` only if the block succeeds."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise K3ExportError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(tmp, out)


def write_tiny_checkpoint(out_dir: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """A tiny random K3 (``K3Config.tiny()``, `randomize_weights`) saved in our format."""
    from k3export.modeling import save_pretrained, tiny_model

    model = tiny_model(seed)
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        save_pretrained(model, tmp)
    return Path(out_dir)
