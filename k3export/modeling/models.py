"""The k3export-only helpers over the modeling files: config and code beside a checkpoint, saving, random and
tiny models (`k3export.modeling` re-exports them).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from .configuration_k3 import K3Config, K3ConfigError, K3VisionConfig, K3VLConfig
from .image_processing_k3 import K3ImageError, K3ImageProcessor, K3Processor
from .modeling_k3 import K3Cache, K3ForCausalLM, K3Model, K3PreTrainedModel
from .modeling_k3_vision import K3ForConditionalGeneration, K3VisionInputError, K3VisionTower

AUTO_MAP = {
    "AutoConfig": "configuration_k3.K3Config",
    "AutoModel": "modeling_k3.K3Model",
    "AutoModelForCausalLM": "modeling_k3.K3ForCausalLM",
}
CODE_FILES = ("configuration_k3.py", "contract.py", "loading_k3.py", "modeling_k3.py")
_HERE = Path(__file__).resolve().parent


def save_config_and_code(config: K3Config, out_dir: str | os.PathLike[str]) -> None:
    """Write ``config.json`` (with ``auto_map``) and copy the configuration/modeling files into `out_dir`,
    so that ``AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)`` needs no k3export."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.auto_map = dict(AUTO_MAP)
    config.architectures = ["K3ForCausalLM"]
    config.save_pretrained(out)
    for name in CODE_FILES:
        shutil.copyfile(_HERE / name, out / name)


def save_pretrained(model: K3ForCausalLM, out_dir: str | os.PathLike[str], max_shard_size: str | int = "5GB") -> None:
    """Safetensors shards + index + config with ``auto_map`` + the code files (``model.save_pretrained``
    does all of it, since the classes are registered for the auto classes)."""
    model.save_pretrained(out_dir, max_shard_size=max_shard_size, safe_serialization=True)


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int = 0) -> None:
    """Fan-in-scaled random weights so that activations stay O(1) through a tiny model (for tests and demos).

    Gates and pseudo-queries get enough spread that routing, AttnRes and decay are all exercised.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_((torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean).to(t.dtype))

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 2)
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log().to(p.dtype))
        elif name.endswith("dt_bias"):
            dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            p.copy_((dt + torch.log(-torch.expm1(-dt))).to(p.dtype))
        elif name.endswith("e_score_correction_bias"):
            normal(p, 0.1)
        elif name.endswith("_res_proj.weight"):
            normal(p, 1.0 / math.sqrt(p.shape[-1]))
        elif "norm" in leaf[-2] if len(leaf) >= 2 else False:
            normal(p, 0.1, mean=1.0)
        elif name.endswith("conv1d.weight"):
            normal(p, 0.5)
        elif name.endswith("embed_tokens.weight"):
            normal(p, 1.0)
        elif p.dim() == 2:
            normal(p, 1.0 / math.sqrt(p.shape[1]))
        else:
            normal(p, 0.02)


def tiny_model(seed: int = 0, **overrides) -> K3ForCausalLM:
    """A tiny random K3 (all features on) in fp32, with `randomize_weights`."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.tiny(**overrides)).eval()
    randomize_weights(model, seed)
    return model


def vision_weight(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A float32 vision tensor with trained-like statistics: norms near 1, the learned position grid O(1), every map
    fan-in scaled (so activations stay O(1) through a tiny tower)."""
    randn = torch.randn(shape, generator=generator)
    if "norm" in name.rsplit(".", 2)[-2]:
        return 1.0 + 0.1 * randn
    if name.endswith("pos_emb.weight"):
        return 0.5 * randn
    return randn / math.sqrt(math.prod(shape[1:]))


@torch.no_grad()
def tiny_vision_model(seed: int = 0, **overrides) -> K3ForConditionalGeneration:
    """A tiny random K3 with its vision tower (`K3VLConfig.tiny`) in fp32: text as `tiny_model`, vision weights
    from `vision_weight`."""
    torch.manual_seed(seed)
    model = K3ForConditionalGeneration(K3VLConfig.tiny(**overrides)).eval()
    randomize_weights(model.language_model, seed)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.startswith(("vision_tower.", "mm_projector.")):
            p.copy_(vision_weight(name, tuple(p.shape), gen))
    return model


__all__ = [
    "AUTO_MAP", "K3Cache", "K3Config", "K3ConfigError", "K3ForCausalLM", "K3ForConditionalGeneration",
    "K3ImageError", "K3ImageProcessor", "K3Model", "K3PreTrainedModel", "K3Processor", "K3VLConfig",
    "K3VisionConfig", "K3VisionInputError", "K3VisionTower", "randomize_weights", "save_config_and_code",
    "save_pretrained", "tiny_model", "tiny_vision_model", "vision_weight",
]
