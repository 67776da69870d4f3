"""Float64 numpy decoders of NVIDIA's NVFP4 layout, from the bit fields, for the tests (independent of k3export)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

PREFIX = "language_model."


def e2m1(nibbles: np.ndarray) -> np.ndarray:
    """E2M1 codes (bit 3 sign, 2 exponent bits, 1 mantissa bit) -> float64."""
    exp, man = (nibbles >> 1) & 3, (nibbles & 1).astype(np.float64)
    mag = np.where(exp == 0, man * 0.5, (1 + man / 2) * np.exp2(exp.astype(np.float64) - 1))
    return np.where(nibbles & 8, -mag, mag)


def e4m3(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes (bias 7, subnormals, 0x7f / 0xff NaN) -> float64."""
    exp, man = ((b >> 3) & 15).astype(np.float64), (b & 7).astype(np.float64)
    mag = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * np.exp2(exp - 7))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return np.where(b & 0x80, -mag, mag)


def _raw(h, name: str) -> np.ndarray:
    t = h.get_tensor(name)
    return t.view(torch.uint8).numpy() if t.dtype in (torch.uint8, torch.float8_e4m3fn) else t.double().numpy()


def reference_weights(folder: Path) -> dict[str, np.ndarray]:
    """Every text tensor by our name, dequantised in float64 from the shards' bits."""
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for name in h.keys():
                tensors[name] = _raw(h, name)
    out = {}
    for name, value in tensors.items():
        if not name.startswith(PREFIX) or name.endswith(("_scale", "_scale_2", "input_scale")):
            continue
        ours = name[len(PREFIX):]
        scale = tensors.get(name + "_scale")
        if scale is None:
            out[ours] = value
        elif value.dtype == np.uint8 and scale.dtype == np.uint8 and ".experts." in name:  # NVFP4
            nib = np.stack([value & 15, value >> 4], -1).reshape(value.shape[0], -1)
            block = np.repeat(e4m3(scale), 16, axis=1)
            out[ours] = e2m1(nib) * block * float(tensors[name + "_scale_2"])
        else:  # FP8 block weight
            tiles = np.repeat(np.repeat(scale, 128, 0), 128, 1)[: value.shape[0], : value.shape[1]]
            out[ours] = e4m3(value) * tiles
    return out


def reference_model(folder: Path, weights: dict[str, np.ndarray] | None = None):
    """A float64 `K3ForCausalLM` built from `reference_weights` of the checkpoint `folder` (or `weights`)."""
    from k3export.converters.checkpoints import scan_checkpoint
    from k3export.converters.checkpoints.loader import build_empty_model

    weights = reference_weights(folder) if weights is None else weights
    model = build_empty_model(scan_checkpoint(folder).config, torch.float64)
    state = {}
    for name, p in model.named_parameters():
        w = torch.from_numpy(weights[name])
        state[name] = w.reshape(-1)[: p.numel()].reshape(p.shape) if w.shape != p.shape else w
    model.load_state_dict(state, strict=True)
    return model.eval()
