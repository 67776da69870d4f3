"""`load_pretrained`: build `K3ForCausalLM` straight from a released K3, Kimi-Linear or k3export folder.

Everything is checked before anything is allocated: the config (every field present, typed, finite, in range),
the bytes it implies against the shard sizes on disk, and every expected tensor (present, right shape, float
dtype) from the shard headers. The model is then allocated once, uninitialised (transformers' ``no_init_weights``
under the target default dtype), and filled tensor by tensor, shard by shard: a dense tensor is read and copied
into its parameter; an MXFP4 or NVFP4 expert or an FP8 block weight is decoded directly into its parameter's
dtype. Peak memory is the model plus one tensor. Vision/projector tensors are skipped with a logged count. ``config.json`` is read once per load.
A tensor holding NaN / Inf is loaded with a warning naming its file and tensor (`check_finite` refuses it).

`check_folder` is what `K3ForCausalLM.from_pretrained` runs on a folder of our own layout, which transformers
reads: the same file checks, before transformers opens a shard, and the same NaN / Inf warning after. Both go
through `k3export.loaders` entry points (the modeling file never imports k3export).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from k3export.dtypes import dtype_among
from k3export.errors import CheckpointError
from k3export.files import CONFIG_NAME, INDEX_NAME, read_config_json
from k3export.modeling.configuration_k3 import DTYPES
from k3export.modeling.contract import keeps_fp32
from k3export.safety import confined_file

from .layouts import DENSE, fit_stored
from .plan import scan_checkpoint
from .safetensors_io import nonfinite_count, nonfinite_note, open_checkpoint, warn_nonfinite

logger = logging.getLogger(__name__)

def _resolve_dtype(torch_dtype: Any, config_json: dict[str, Any]) -> torch.dtype:
    """The model dtype: a torch.dtype as given, "auto" the config's, None fp32; a name in any spelling of
    `k3export.dtypes` (fp32, bfloat16, torch.float16, ...) among the dtypes a config may name (`DTYPES`)."""
    if isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    if torch_dtype in (None, "auto"):
        stored = config_json.get("torch_dtype") or config_json.get("dtype")
        if stored is None and isinstance(config_json.get("text_config"), dict):
            stored = config_json["text_config"].get("torch_dtype") or config_json["text_config"].get("dtype")
        if torch_dtype is None or stored is None:
            return torch.float32
        torch_dtype = stored
    d = dtype_among(torch_dtype, DTYPES)
    if d is None:
        raise CheckpointError(f"unsupported torch_dtype {torch_dtype!r}; use {', '.join(DTYPES)}")
    return d.torch


def build_empty_model(config: Any, dtype: torch.dtype, device: str | torch.device = "cpu") -> Any:
    """`K3ForCausalLM(config)` with uninitialised storage in `dtype` (fp32-kept parameters stay fp32)."""
    from transformers.initialization import no_init_weights

    from k3export.modeling import K3ForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), torch.device(device):
            model = K3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    for name, p in model.named_parameters():
        if keeps_fp32(name) and p.dtype.itemsize < 4:  # kept fp32 in a bf16 / fp16 model; a float64 model is all float64
            p.data = p.data.float()
    return model


@torch.no_grad()
def load_pretrained(path: str | Path, torch_dtype: Any = None, device: str | torch.device = "cpu",
                    check_finite: bool = False, config_json: dict[str, Any] | None = None) -> Any:
    """Load a K3 / Kimi-Linear checkpoint folder (released or converted layout) into `K3ForCausalLM`.

    ``torch_dtype``: a dtype, its name, ``"auto"`` (the checkpoint's) or None (float32). ``config_json``: the
    folder's config.json when the caller has read it (it is not read again).
    """
    path = Path(path)
    if config_json is None:
        config_json = read_config_json(path)
    scan = scan_checkpoint(path, config_json=config_json)  # config, bytes and headers: all before allocating
    dtype = _resolve_dtype(torch_dtype, config_json)  # after the config's own check, which names the file
    try:
        model = build_empty_model(scan.config, dtype, device)
        params = dict(model.named_parameters())
        if any(scan.skipped.values()):
            logger.info("%s: skipped %s tensors not part of the text model (%s)", path,
                        sum(scan.skipped.values()), ", ".join(f"{k}: {v}" for k, v in scan.skipped.items()))
        loaded = set()
        for fname in sorted(scan.files):
            reader = scan.readers[fname]
            for t in sorted((t for t in scan.tensors.values() if t.file == fname), key=lambda t: t.begin):
                param = params.get(t.name)
                if param is None:  # the contract and the model disagree
                    raise CheckpointError(f"{t.file}: tensor {t.stored!r} is no parameter of the model "
                                          f"({t.name!r})")
                # MXFP4 / NVFP4 experts and FP8 block weights decoded straight into the parameter's dtype
                value = scan.read_value(t, param.dtype) if t.kind != DENSE else reader.read(t.stored)
                bad = nonfinite_count(value)
                if bad and check_finite:
                    raise CheckpointError(f"{nonfinite_note(t.file, t.stored, bad)} (refused: NaN or Inf weights, "
                                          "check_finite=True)")
                if bad:
                    warn_nonfinite(t.file, t.stored, bad)
                param.copy_(fit_stored(t.name, value, t.model_shape))
                loaded.add(t.name)
                del value
        missing = [n for n in params if n not in loaded]
        if missing:  # scan_checkpoint already checked this; kept as a last line of defence
            raise CheckpointError(f"{path}: parameters {missing[:5]} were not loaded")
    finally:
        scan.close()
    model.eval()
    model._k3_source = str(path)  # noqa: SLF001 - provenance for later export steps
    return model


def load_layout(path: str | Path, config_json: dict[str, Any] | None = None, torch_dtype: Any = None,
                device: str | torch.device = "cpu") -> Any:
    """The ``k3export.loaders:layouts`` entry point: `load_pretrained` for code that must not import the exporter.
    `K3ForCausalLM.from_pretrained` calls it for other layouts, with the config.json it has read (used as is: the
    file is not read again, but a config.json linked out of the folder is refused as every k3export reader refuses
    it); the PyTorch runner (`k3export.runtime.torch_runner.load_model`) for every layout, without one."""
    if config_json is not None:
        confined_file(Path(path), CONFIG_NAME, "config", error=CheckpointError, label="model folder")
    return load_pretrained(path, torch_dtype=torch_dtype, device=device, config_json=config_json)


def check_folder(path: str | os.PathLike[str]) -> Callable[[torch.nn.Module], None]:
    """The ``k3export.loaders:checks`` entry point: `K3ForCausalLM.from_pretrained` calls it on a local folder of
    our layout before transformers reads it, and calls what it returns on the loaded model.

    The folder's files are checked as every k3export reader checks them (`open_checkpoint`): config.json (confined
    to the folder, a JSON object of a model_type k3export reads: `read_config_json`) and each shard confined to the
    folder (an index naming ``../x.safetensors`` is refused naming that path), every shard
    header against its file (a truncated shard, a header length past the end, offsets past the data), the index
    against the headers. The refusal is the `CheckpointError` ``k3export export`` prints for the same folder. A
    folder with neither an index nor a ``.safetensors`` file is left to the caller (which names what is missing).
    The returned check warns (`warn_nonfinite`) for each loaded parameter holding NaN / Inf, naming its file."""
    path = Path(path)
    if os.path.lexists(path / CONFIG_NAME):
        # leaving the folder, not JSON, not an object, another model_type: the line convert and export print
        read_config_json(path)
    if not os.path.lexists(path / INDEX_NAME) and not any(p.name.endswith(".safetensors") for p in path.iterdir()):
        return lambda model: None
    readers, located = open_checkpoint(path)
    for reader in readers.values():
        reader.close()

    def warn_on_nonfinite(model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            if param.device.type != "meta":
                bad = nonfinite_count(param.detach())
                if bad:
                    warn_nonfinite(located.get(name, str(path)), name, bad)

    return warn_on_nonfinite


__all__ = ["build_empty_model", "check_folder", "load_layout", "load_pretrained"]
