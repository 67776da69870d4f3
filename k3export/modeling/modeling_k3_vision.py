# Copyright 2026 the k3export authors. Apache-2.0.
"""PyTorch MoonViT-V2, K3's vision tower, its PatchMergerMLPV2 projector, and `K3ForConditionalGeneration`.

    pixels -> patch embed (+ divided_fixed position) -> N x [2D-RoPE attention, MLP] -> sd2_tpool merge -> projector

Read top to bottom: the tower's ops in plain PyTorch, its modules, the projector, then the image + text model that
writes the projected features over the embeddings of the placeholder tokens and runs the text model on them.
Parameter names are the released checkpoint's (``vision_tower.*``, ``mm_projector.*``, ``language_model.*``).
The maths, and which public source each choice follows, are in ``docs/vision.md``.

Images travel packed (NaViT): ``pixel_values`` [patches, C, p, p] holds every image's patches one after the other
(row-major, frame by frame), ``grid_thws`` [images, 3] each image's (frames, rows, columns) in patches. Attention
runs per image (a loop over the packed segments, plain PyTorch on any device). A video chunk is an image with
frames > 1: its frames attend jointly and are averaged by the merge.

This file is copied next to saved checkpoints (``trust_remote_code``): it imports torch, transformers, safetensors
and its sibling modeling files, never k3export.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel

from .configuration_k3 import K3ConfigError, K3VisionConfig, K3VLConfig
from .contract import K3VisionInputError, grid_list
from .loading_k3 import K3CheckpointError, layout_loader, read_config_json
from .modeling_k3 import K3Cache, K3CausalLMOutput, K3ForCausalLM, K3PreTrainedModel

#: base of the 2D rotary frequencies (MoonViT's)
ROPE_THETA = 10000.0
#: base of the temporal sin/cos embedding
TIME_THETA = 10000.0
#: the checkpoint prefixes of the vision tensors
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


# ============================================================================ inputs
# K3VisionInputError and grid_list live in the contract (torch-free: a runtime checks its image feeds with them)


def merged_token_counts(grids: Sequence[tuple[int, int, int]], config: K3VisionConfig) -> list[int]:
    """Text tokens each image becomes: one per kh x kw block of patches (frames are pooled)."""
    kh, kw = config.merge_kernel_size
    return [(h // kh) * (w // kw) for _, h, w in grids]


# ============================================================================ tower ops


def vision_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps). ``eps`` None is the tower's: the activation dtype's machine epsilon
    (``torch.nn.RMSNorm``'s default, which the released tower was trained with)."""
    return F.rms_norm(x, weight.shape, weight, torch.finfo(x.dtype).eps if eps is None else eps)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the rotary / position tables: float64 for a float64 model (a reference), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def interpolated_pos_emb(weight: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The learned [H0, W0, D] grid resized (bilinear, half-pixel centres) to [rows * cols, D]; as stored when the
    grid already has that size."""
    if tuple(weight.shape[:2]) == (rows, cols):
        return weight.flatten(0, 1)
    grid = F.interpolate(weight.permute(2, 0, 1).unsqueeze(0), size=(rows, cols), mode="bilinear",
                         align_corners=False)
    return grid.squeeze(0).permute(1, 2, 0).flatten(0, 1)


def temporal_sincos(dim: int, frames: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The fixed temporal embedding [frames, dim]: [sin(f * w_k) | cos(f * w_k)], w_k = 10000^(-k / (dim/2))."""
    acc = _acc(dtype)
    omega = TIME_THETA ** (-torch.arange(dim // 2, dtype=acc, device=device) / (dim / 2))
    angles = torch.arange(frames, dtype=acc, device=device)[:, None] * omega
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(dtype)


def rope_2d_angles(grids: Sequence[tuple[int, int, int]], head_dim: int, device: torch.device | str,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rotation angle of every (patch, pair of channels) [patches, head_dim / 2]. Pair 2i turns with the patch's
    column, pair 2i + 1 with its row, both at frequency 10000^(-4i / head_dim); every frame repeats the grid."""
    freqs = ROPE_THETA ** (-torch.arange(0, head_dim, 4, dtype=dtype, device=device)[: head_dim // 4] / head_dim)
    out = []
    for t, h, w in grids:
        y, x = torch.meshgrid(torch.arange(h, dtype=dtype, device=device), torch.arange(w, dtype=dtype, device=device),
                              indexing="ij")
        ang = torch.stack([x.reshape(-1, 1) * freqs, y.reshape(-1, 1) * freqs], dim=-1).flatten(1)  # [h*w, hd/2]
        out.append(ang.repeat(t, 1))
    return torch.cat(out)


def apply_rope_2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair (2j, 2j + 1) of x [patches, heads, head_dim] by angles [patches, head_dim / 2]."""
    acc = _acc(x.dtype)
    pairs = x.to(acc).unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
    """Bidirectional attention of q, k, v [patches, heads, head_dim] within each packed segment
    [cu_seqlens[i], cu_seqlens[i+1]) (one image), nothing across: [patches, heads * head_dim]. A loop keeps the
    scores per image ([heads, n_i, n_i]), not over the whole batch."""
    outs = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1))
    return torch.cat(outs).flatten(1)


def sd2_tpool(x: torch.Tensor, grids: Sequence[tuple[int, int, int]], kernel: Sequence[int]) -> torch.Tensor:
    """``sd2_tpool``: each kh x kw block of patches becomes one token of kh * kw * D values (block rows outer,
    block columns inner, then channels), averaged over frames: [merged tokens, kh * kw * D], images in order."""
    kh, kw = int(kernel[0]), int(kernel[1])
    d = x.shape[-1]
    outs, offset = [], 0
    for t, h, w in grids:
        seq = x[offset: offset + t * h * w].view(t, h // kh, kh, w // kw, kw, d)
        outs.append(seq.permute(0, 1, 3, 2, 4, 5).mean(0).reshape((h // kh) * (w // kw), kh * kw * d))
        offset += t * h * w
    return torch.cat(outs)


# ============================================================================ tower modules


class K3VisionRMSNorm(nn.Module):
    """RMSNorm; ``eps`` None: the activation dtype's epsilon (see `vision_rms_norm`)."""

    def __init__(self, dim: int, eps: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vision_rms_norm(x, self.weight, self.eps)


class K3VisionPosEmb(nn.Module):
    """``divided_fixed``: a learned [H0, W0, D] spatial grid, resized to each image, plus (for more than one frame)
    the fixed temporal sin/cos embedding of each frame."""

    def __init__(self, config: K3VisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.init_pos_emb_height, config.init_pos_emb_width,
                                               config.vt_hidden_size))

    def forward(self, x: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        pos = []
        for t, h, w in grids:
            spatial = interpolated_pos_emb(self.weight, h, w)
            if t > 1:  # one frame gets no temporal term (its cos half would add 1)
                time = temporal_sincos(spatial.shape[-1], t, spatial.dtype, spatial.device)
                spatial = (spatial.unsqueeze(0) + time.unsqueeze(1)).flatten(0, 1)
            pos.append(spatial)
        return x + torch.cat(pos).to(x.dtype)


class K3VisionPatchEmbed(nn.Module):
    """Each C x p x p patch through the (bias-free) patch convolution, which on one patch is a linear map."""

    def __init__(self, config: K3VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(config.in_channels, config.vt_hidden_size, kernel_size=config.patch_size,
                              stride=config.patch_size, bias=False)
        self.pos_emb = K3VisionPosEmb(config)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        w = self.proj.weight
        x = F.linear(pixel_values.to(w.dtype).flatten(1), w.flatten(1))
        return self.pos_emb(x, grids)


class K3VisionMLP(nn.Module):
    """``mlp2``: fc1(gelu_tanh(fc0(x)))."""

    def __init__(self, config: K3VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(config.vt_hidden_size, config.vt_intermediate_size, bias=False)
        self.fc1 = nn.Linear(config.vt_intermediate_size, config.vt_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class K3VisionBlock(nn.Module):
    """Pre-norm encoder layer: x + wo(attention(rope(wqkv(norm0(x))))), then x + mlp(norm1(x)). ``wqkv`` packs
    q, k, v as [3, heads, head_dim] on its output axis."""

    def __init__(self, config: K3VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.vt_num_attention_heads, config.head_dim
        self.norm0 = K3VisionRMSNorm(config.vt_hidden_size)
        self.norm1 = K3VisionRMSNorm(config.vt_hidden_size)
        self.wqkv = nn.Linear(config.vt_hidden_size, 3 * config.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(config.qkv_hidden_size, config.vt_hidden_size, bias=False)
        self.mlp = K3VisionMLP(config)

    def attention(self, x: torch.Tensor, cu_seqlens: Sequence[int], angles: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        return self.wo(varlen_attention(apply_rope_2d(q, angles), apply_rope_2d(k, angles), v, cu_seqlens))

    def forward(self, x: torch.Tensor, cu_seqlens: Sequence[int], angles: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), cu_seqlens, angles)
        return x + self.mlp(self.norm1(x))


class K3VisionEncoder(nn.Module):
    def __init__(self, config: K3VisionConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.blocks = nn.ModuleList([K3VisionBlock(config) for _ in range(config.vt_num_hidden_layers)])
        self.final_layernorm = K3VisionRMSNorm(config.vt_hidden_size)

    def forward(self, x: torch.Tensor, grids: Sequence[tuple[int, int, int]],
                output_hidden_states: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cu_seqlens = [0]
        for t, h, w in grids:
            cu_seqlens.append(cu_seqlens[-1] + t * h * w)
        angles = rope_2d_angles(grids, self.head_dim, x.device, _acc(x.dtype))
        hidden = []
        for block in self.blocks:
            x = block(x, cu_seqlens, angles)
            if output_hidden_states:
                hidden.append(x)
        return self.final_layernorm(x), hidden


class K3VisionTower(nn.Module):
    """MoonViT-V2: patch embedding, encoder, ``sd2_tpool`` merge. Packed pixels in, merged tokens out."""

    def __init__(self, config: K3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = K3VisionPatchEmbed(config)
        self.encoder = K3VisionEncoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """pixel_values [patches, C, p, p], grid_thws [images, 3] -> [merged tokens, kh * kw * vt_hidden_size]."""
        c = self.config
        want = (c.in_channels, c.patch_size, c.patch_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want:
            raise K3VisionInputError(f"pixel_values must be [patches, {', '.join(map(str, want))}] (packed patches), "
                                     f"got {list(pixel_values.shape)}")
        grids = grid_list(grid_thws, c, pixel_values.shape[0])
        x, _ = self.encoder(self.patch_embed(pixel_values, grids), grids)
        return sd2_tpool(x, grids, c.merge_kernel_size)


class K3PatchMergerMLPV2(nn.Module):
    """``patchmergerv2``: post_norm(proj.2(gelu(proj.0(merged token)))), into the text model's width. GELU is the
    exact (erf) one here; the tower's MLP uses the tanh one."""

    def __init__(self, config: K3VisionConfig) -> None:
        super().__init__()
        width = config.projector_in_size
        self.proj = nn.Sequential(nn.Linear(width, width, bias=False), nn.GELU(),
                                  nn.Linear(width, config.text_hidden_size, bias=False))
        self.post_norm = K3VisionRMSNorm(config.text_hidden_size, eps=config.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged))


# ============================================================================ image + text model


class K3VLPreTrainedModel(PreTrainedModel):
    config_class = K3VLConfig
    config: K3VLConfig
    base_model_prefix = ""
    _no_split_modules = ["K3DecoderLayer", "K3VisionBlock"]
    _keep_in_fp32_modules_strict = K3PreTrainedModel._keep_in_fp32_modules_strict
    _is_stateful = True
    _supports_cache_class = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.text_config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            module.weight.normal_(0.0, std)
        elif isinstance(module, K3VisionRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, K3VisionPosEmb):
            module.weight.normal_(0.0, 1.0)


class K3ForConditionalGeneration(K3VLPreTrainedModel, GenerationMixin):
    """K3 with its vision tower (``KimiK3ForConditionalGeneration``'s layout): images and text in, logits out.

    Each image's projected tokens replace, in order, the embeddings of the ``media_placeholder_token_id``
    tokens of the prompt (the processor expands one placeholder per image into one per merged token). Without
    images this is exactly `K3ForCausalLM` (``language_model``)."""

    _tied_weights_keys: dict[str, str] = {}

    def __init__(self, config: K3VLConfig, language_model: K3ForCausalLM | None = None) -> None:
        super().__init__(config)
        self.language_model = language_model if language_model is not None else K3ForCausalLM(config.text_config)
        self.vision_tower = K3VisionTower(config.vision_config)
        self.mm_projector = K3PatchMergerMLPV2(config.vision_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Linear:
        return self.language_model.get_output_embeddings()

    def get_image_features(self, pixel_values: torch.Tensor,
                           grid_thws: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """Packed pixels -> one text-width embedding per merged token [tokens, text hidden], images in order."""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def splice_image_features(self, input_ids: torch.LongTensor, features: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `input_ids` with `features` written, row by row, over the placeholder positions
        (batch row-major, as the processor laid the images out)."""
        embeds = self.get_input_embeddings()(input_ids)
        mask = input_ids == self.config.media_placeholder_token_id
        n = int(mask.sum())
        if n != features.shape[0]:
            raise K3VisionInputError(
                f"the prompt has {n} image placeholder tokens (id {self.config.media_placeholder_token_id}) but the "
                f"images give {features.shape[0]} tokens; expand each image's placeholder with the processor")
        return embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))

    def forward(self, input_ids: torch.LongTensor | None = None, pixel_values: torch.Tensor | None = None,
                grid_thws: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: K3Cache | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, logits_to_keep: int = 0, **kwargs: Any) -> K3CausalLMOutput:
        if pixel_values is not None:
            if input_ids is None or inputs_embeds is not None:
                raise K3VisionInputError("images need input_ids (to find the placeholder tokens), not inputs_embeds")
            if grid_thws is None:
                raise K3VisionInputError("pixel_values needs its grid_thws (frames, rows, columns per image)")
            inputs_embeds = self.splice_image_features(input_ids, self.get_image_features(pixel_values, grid_thws))
            input_ids = None
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                                   inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                   output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep, **kwargs)

    # -- generation: the text model's hybrid cache; images are read at the prefill step only
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args: Any, **kwargs: Any) -> None:
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = K3Cache(self.config.text_config)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, **kwargs: Any) -> dict[str, Any]:
        cache = kwargs.get("cache")
        started = cache is not None and cache.get_seq_length() > 0
        pixel_values, grid_thws = kwargs.pop("pixel_values", None), kwargs.pop("grid_thws", None)
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        if not started:
            inputs.update(pixel_values=pixel_values, grid_thws=grid_thws)
        return inputs

    # -- loading and saving: the released layout (and the development checkpoint's); see `load_vision_weights`
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args: Any, **kwargs: Any) -> K3ForConditionalGeneration:
        """Load a K3 folder (or Hub id) with a vision tower: the text model through k3export's loader (any layout it
        reads: released MXFP4 experts, dense), then every ``vision_tower.*`` / ``mm_projector.*`` tensor, checked
        by name and shape before any is read."""
        path = str(pretrained_model_name_or_path)
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, revision=kwargs.get("revision"))
        config_json = read_config_json(path)
        if config_json is None:
            raise K3CheckpointError(f"{path}: no readable config.json (a JSON object): not a model folder")
        try:
            config = K3VLConfig.from_released_dict(config_json)
        except K3ConfigError as exc:
            raise K3CheckpointError(f"{path}/config.json: {exc}") from None
        loader = layout_loader()
        if loader is None:  # copied next to a checkpoint without k3export installed
            raise ValueError(f"{pretrained_model_name_or_path} is a kimi_k3 checkpoint; loading it needs k3export "
                             "(pip install k3export)")
        dtype = kwargs.get("torch_dtype", kwargs.get("dtype"))
        check_vision_tensors(path, config)  # refuse a bad vision tensor before the text model is read
        text = loader(path, config_json, torch_dtype=dtype)
        model = cls.assemble(config, text)
        load_vision_weights(model, path)
        model._k3_source = path  # noqa: SLF001 - provenance, as K3ForCausalLM's loader records it
        return model.eval()

    @classmethod
    def assemble(cls, config: K3VLConfig, language_model: K3ForCausalLM) -> K3ForConditionalGeneration:
        """A model around an already built (loaded) text model; the vision parts are allocated, uninitialised, in
        the text model's dtype and device."""
        from transformers.initialization import no_init_weights

        embed = language_model.get_input_embeddings().weight
        previous = torch.get_default_dtype()
        torch.set_default_dtype(embed.dtype)
        try:
            with no_init_weights(), torch.device(embed.device):
                return cls(config, language_model=language_model)
        finally:
            torch.set_default_dtype(previous)

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any) -> None:
        """Safetensors in the released layout (dense experts) + config with ``auto_map`` + the code files, so that
        ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` loads it (with k3export for the text loader)."""
        self.config.architectures = ["K3ForConditionalGeneration"]
        self.config.auto_map = dict(AUTO_MAP)
        kwargs.setdefault("safe_serialization", True)
        super().save_pretrained(save_directory, *args, **kwargs)
        here = os.path.dirname(os.path.abspath(__file__))
        for name in CODE_FILES:
            if os.path.isfile(os.path.join(here, name)):
                shutil.copyfile(os.path.join(here, name), os.path.join(str(save_directory), name))


#: what a saved image + text checkpoint maps the auto classes to (the released config maps both model classes to its
#: one class, as here)
AUTO_MAP = {
    "AutoConfig": "configuration_k3.K3VLConfig",
    "AutoModel": "modeling_k3_vision.K3ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_k3_vision.K3ForConditionalGeneration",
}
#: the files a saved image + text checkpoint carries for trust_remote_code (image_processing_k3.py: the processor)
CODE_FILES = ("configuration_k3.py", "contract.py", "loading_k3.py", "modeling_k3.py", "modeling_k3_vision.py",
              "image_processing_k3.py")


# ============================================================================ vision tensors of a checkpoint


def _open(folder: str, fname: str) -> Any:
    """`safetensors.safe_open` of a shard; one `K3CheckpointError` line when it is not a readable safetensors file."""
    from safetensors import safe_open

    try:
        return safe_open(os.path.join(folder, fname), framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for every kind of damage
        raise K3CheckpointError(f"{folder}/{fname}: not a readable safetensors file ({exc})") from None


def _shard_files(folder: str) -> dict[str, list[str]]:
    """Safetensors file -> the vision tensor names it holds (from the index when there is one, else every
    ``*.safetensors`` header). A file name that leaves the folder is refused."""
    index = os.path.join(folder, "model.safetensors.index.json")
    names: dict[str, list[str]] = {}
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            items = [(str(t), str(f)) for t, f in weight_map.items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise K3CheckpointError(f"{index}: not a safetensors index with a weight_map ({type(exc).__name__})") \
                from None
        for tensor, fname in items:
            if tensor.startswith(VISION_PREFIXES):
                names.setdefault(fname, []).append(tensor)
    else:
        for fname in sorted(os.listdir(folder)):
            if fname.endswith(".safetensors"):
                with _open(folder, fname) as f:
                    found = [k for k in f.keys() if k.startswith(VISION_PREFIXES)]
                if found:
                    names[fname] = found
    real = os.path.realpath(folder)
    for fname in names:
        full = os.path.realpath(os.path.join(folder, fname))
        if os.path.dirname(full) != real or not os.path.isfile(full):
            raise K3CheckpointError(f"{index}: vision tensors are mapped to {fname!r}, which is not a file in {folder}")
    return names


def expected_vision_tensors(config: K3VLConfig) -> dict[str, tuple[int, ...]]:
    """Every vision parameter and its shape, in checkpoint names, from modules built on the meta device (the
    modules are the one home of these shapes)."""
    with torch.device("meta"):
        parts = {"vision_tower": K3VisionTower(config.vision_config), "mm_projector": K3PatchMergerMLPV2(
            config.vision_config)}
    return {f"{prefix}.{n}": tuple(p.shape) for prefix, m in parts.items() for n, p in m.named_parameters()}


_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def check_vision_tensors(folder: str, config: K3VLConfig) -> dict[str, str]:
    """Check every vision tensor of `folder` from the headers (present, expected, right shape, float dtype) and
    return tensor -> file. One `K3CheckpointError` line names the tensor, its file and what was expected."""
    expected = expected_vision_tensors(config)
    where: dict[str, str] = {}
    for fname, tensors in sorted(_shard_files(folder).items()):
        with _open(folder, fname) as f:
            stored = set(f.keys())
            for name in tensors:
                if name not in stored:
                    raise K3CheckpointError(f"{folder}: the index maps {name!r} to {fname}, which does not hold it")
                view = f.get_slice(name)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                if name not in expected:
                    raise K3CheckpointError(f"{fname}: unexpected vision tensor {name!r} {list(shape)}, which "
                                            "vision_config does not call for")
                if name in where:
                    raise K3CheckpointError(f"vision tensor {name!r} is stored twice ({where[name]} and {fname})")
                if shape != expected[name]:
                    raise K3CheckpointError(f"{fname}: tensor {name!r} has shape {list(shape)}; vision_config "
                                            f"needs {list(expected[name])}")
                if dtype not in _FLOAT_DTYPES:
                    raise K3CheckpointError(f"{fname}: tensor {name!r} has dtype {dtype}; expected a float dtype "
                                            f"({', '.join(sorted(_FLOAT_DTYPES))})")
                where[name] = fname
    missing = [n for n in expected if n not in where]
    if missing:
        raise K3CheckpointError(f"{folder}: missing vision tensor {missing[0]!r} {list(expected[missing[0]])} "
                                f"required by vision_config ({len(missing)} missing in all)")
    return where


@torch.no_grad()
def load_vision_weights(model: K3ForConditionalGeneration, folder: str, check_finite: bool = False) -> None:
    """Fill `model`'s vision tower and projector from `folder` (checked first, see `check_vision_tensors`)."""
    where = check_vision_tensors(folder, model.config)
    params = dict(model.named_parameters())
    by_file: dict[str, list[str]] = {}
    for name, fname in where.items():
        by_file.setdefault(fname, []).append(name)
    for fname, names in sorted(by_file.items()):
        with _open(folder, fname) as f:
            for name in names:
                value = f.get_tensor(name)
                if check_finite and not bool(torch.isfinite(value).all()):
                    raise K3CheckpointError(f"{fname}: tensor {name!r} has NaN or Inf values")
                params[name].copy_(value)


__all__ = [
    "K3ForConditionalGeneration", "K3PatchMergerMLPV2", "K3VLPreTrainedModel", "K3VisionBlock", "K3VisionInputError",
    "K3VisionTower", "apply_rope_2d", "check_vision_tensors", "expected_vision_tensors", "grid_list",
    "interpolated_pos_emb", "load_vision_weights", "merged_token_counts", "rope_2d_angles", "sd2_tpool",
    "temporal_sincos", "varlen_attention",
]
