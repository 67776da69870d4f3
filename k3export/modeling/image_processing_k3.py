# Copyright 2026 the k3export authors. Apache-2.0.
"""Image preprocessing for K3's vision tower, and the processor that puts images into a prompt.

`K3ImageProcessor` (``preprocessor_config.json``) turns images into what `K3ForConditionalGeneration` reads:

1. resize (bicubic) so that the image holds at most ``in_patch_limit`` patches and at most
   ``patch_limit_on_one_side`` on a side, never enlarging;
2. pad (bottom and right, black) to a multiple of ``merge_kernel_size * patch_size`` on each axis;
3. normalise: (x / 255 - image_mean) / image_std;
4. cut into patches, packed: ``pixel_values`` [patches, 3, p, p], frame by frame, row-major, and ``grid_thws``
   [images, 3] = (frames, rows, columns) in patches.

A video chunk (a list of up to ``max_frames_per_chunk`` frames) is one entry with frames > 1: every frame is resized
as the first is; the tower averages the frames of each merged block, so a chunk costs as many text tokens as one of
its frames. The budget is the released rule's: it bounds the original image's whole-patch grid, so the resized
image may hold up to ~2% more patches, and the padding of step 2 adds up to one merge row and column (at most ~8%
over ``in_patch_limit`` in all, measured over 200k sizes at the released settings).

`K3Processor` expands each image's placeholder in the prompt (``<|kimi_image_placeholder|>``, one per image, as
K3's chat template writes it) into ``<|media_begin|>image {W}x{H}<|media_content|>`` + one ``<|media_pad|>`` per
merged token + ``<|media_end|>`` (W x H: the image as given), or, for a prompt already tokenised, each placeholder
token id into one per merged token. ``AutoProcessor`` / ``AutoImageProcessor`` with ``trust_remote_code=True`` read
it from a checkpoint folder. The choices and their sources are in ``docs/vision.md``.

This file is copied next to saved checkpoints (``trust_remote_code``): it imports numpy, Pillow, torch, transformers
and the sibling configuration file, never k3export.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

from .configuration_k3 import MEDIA_PLACEHOLDER_TOKEN_ID

#: the text of the token whose embedding each merged image token replaces (`MEDIA_PLACEHOLDER_TOKEN_ID`)
MEDIA_PAD = "<|media_pad|>"
#: what a prompt carries per image / per video chunk before expansion
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
VIDEO_PLACEHOLDER = "<|kimi_video_placeholder|>"
PROCESSOR_CONFIG = "processor_config.json"
#: the largest patch budget (in all, and on one side) a processor accepts: 2^20 patches are already ~2.5 GB of
#: fp32 pixel values and a 2^20-token attention pass, 64x the released budget
MAX_PATCHES, MAX_SIDE_PATCHES = 1 << 20, 1 << 13
#: the code a saved processor folder carries (this file and the configuration it imports)
CODE_FILES = ("image_processing_k3.py", "configuration_k3.py")
AUTO_MAP = {"AutoImageProcessor": "image_processing_k3.K3ImageProcessor",
            "AutoProcessor": "image_processing_k3.K3Processor"}


class K3ImageError(ValueError):
    """An image or prompt the processor cannot use; the message names the image and what was expected."""


@dataclass(frozen=True)
class ResizePlan:
    """What one image (or video chunk) becomes: resized to ``width`` x ``height``, padded by ``pad_width`` /
    ``pad_height``, ``rows`` x ``columns`` patches, ``tokens`` merged text tokens."""

    width: int
    height: int
    pad_width: int
    pad_height: int
    rows: int
    columns: int
    tokens: int


def _load(image: Any, where: str) -> Any:
    """A PIL image in RGB from a PIL image, a path, or an H x W (x C) uint8 array; one clear error otherwise."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        if not os.path.isfile(path):
            raise K3ImageError(f"{where}: {path!r} is not a file")
        try:
            with warnings.catch_warnings():
                # Pillow warns above MAX_IMAGE_PIXELS and refuses above twice that: both are a refusal here, before
                # the decode allocates what the header claims
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(path) as im:
                    im.load()
                    return im.convert("RGB")
        except (Image.DecompressionBombError, Image.DecompressionBombWarning, MemoryError) as exc:
            raise K3ImageError(f"{where}: {path!r} is too large to decode ({exc})") from None
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise K3ImageError(f"{where}: {path!r} cannot be read as an image ({type(exc).__name__}: {exc})") \
                from None
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise K3ImageError(f"{where}: an array image must be uint8 [H, W] or [H, W, 1|3|4], got {image.dtype} "
                               f"{list(image.shape)}")
        return Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image).convert("RGB")
    raise K3ImageError(f"{where}: expected a PIL image, a path or a uint8 array, got {type(image).__name__}")


class K3ImageProcessor(BaseImageProcessor):
    r"""Resize, pad, normalise and pack images for MoonViT-V2 (see the module docstring).

    ``merge_kernel_size`` and ``patch_size`` must be the model's ``vision_config`` values; ``max_frames_per_chunk``
    at most its ``init_pos_emb_time``."""

    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, patch_size: int = 14, merge_kernel_size: Sequence[int] | int = (2, 2),
                 in_patch_limit: int = 16384, patch_limit_on_one_side: int = 512,
                 image_mean: Sequence[float] = (0.5, 0.5, 0.5), image_std: Sequence[float] = (0.5, 0.5, 0.5),
                 max_frames_per_chunk: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        mk = [merge_kernel_size] * 2 if isinstance(merge_kernel_size, int) else list(merge_kernel_size)
        for name, value in (("patch_size", patch_size), ("in_patch_limit", in_patch_limit),
                            ("patch_limit_on_one_side", patch_limit_on_one_side),
                            ("max_frames_per_chunk", max_frames_per_chunk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise K3ImageError(f"K3ImageProcessor: {name} must be a positive integer, got {value!r}")
        if len(mk) != 2 or not all(isinstance(k, int) and k >= 1 for k in mk):
            raise K3ImageError(f"K3ImageProcessor: merge_kernel_size must be [kh, kw], got {merge_kernel_size!r}")
        for name, value in (("image_mean", image_mean), ("image_std", image_std)):
            if len(value) != 3 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in value):
                raise K3ImageError(f"K3ImageProcessor: {name} must be three finite numbers, got {value!r}")
        if not all(s > 0 for s in image_std):
            raise K3ImageError(f"K3ImageProcessor: image_std must be positive, got {image_std!r}")
        for name, value, most in (("in_patch_limit", in_patch_limit, MAX_PATCHES),
                                  ("patch_limit_on_one_side", patch_limit_on_one_side, MAX_SIDE_PATCHES)):
            if value > most:
                raise K3ImageError(f"K3ImageProcessor: {name} must be at most {most}, got {value}")
        if patch_limit_on_one_side < max(mk):
            raise K3ImageError(f"K3ImageProcessor: patch_limit_on_one_side ({patch_limit_on_one_side}) must hold "
                               f"one merge block ({max(mk)} patches)")
        self.patch_size = patch_size
        self.merge_kernel_size = mk
        self.in_patch_limit = in_patch_limit
        self.patch_limit_on_one_side = patch_limit_on_one_side
        self.image_mean = [float(v) for v in image_mean]
        self.image_std = [float(v) for v in image_std]
        self.max_frames_per_chunk = max_frames_per_chunk
        self.auto_map = dict(AUTO_MAP)

    # ------------------------------------------------------------------ sizes
    def resize_plan(self, width: int, height: int) -> ResizePlan:
        """The released NaViT rule: scale = min(1, sqrt(limit / (W//p * H//p)), side*p / W, side*p / H), sizes
        truncated (at least 1 pixel, at most side*p), then padded up to whole merge blocks."""
        p, side = self.patch_size, self.patch_limit_on_one_side
        kh, kw = self.merge_kernel_size
        scale = min(1.0, math.sqrt(self.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p))),
                    side * p / width, side * p / height)
        new_w = min(max(1, int(width * scale)), side * p)
        new_h = min(max(1, int(height * scale)), side * p)
        pad_w, pad_h = (-new_w) % (kw * p), (-new_h) % (kh * p)
        rows, cols = (new_h + pad_h) // p, (new_w + pad_w) // p
        return ResizePlan(new_w, new_h, pad_w, pad_h, rows, cols, (rows // kh) * (cols // kw))

    def num_tokens(self, image: Any) -> int:
        """Merged text tokens of one image or video chunk (the placeholder count it needs)."""
        frames = image if isinstance(image, (list, tuple)) else [image]
        return self.resize_plan(*_load(frames[0], "image").size).tokens

    # ------------------------------------------------------------------ pixels
    def _frames(self, frames: list[Any], plan: ResizePlan) -> np.ndarray:
        from PIL import Image

        out = np.zeros((len(frames), plan.height + plan.pad_height, plan.width + plan.pad_width, 3), np.uint8)
        for i, frame in enumerate(frames):
            out[i, : plan.height, : plan.width] = np.asarray(frame.resize((plan.width, plan.height),
                                                                           Image.Resampling.BICUBIC))
        return out

    def pack(self, frames: np.ndarray) -> np.ndarray:
        """uint8 [T, H, W, 3] (H, W whole patches) -> normalised float32 patches [T * H/p * W/p, 3, p, p]."""
        p = self.patch_size
        x = (frames.astype(np.float32) / 255.0 - np.asarray(self.image_mean, np.float32)) \
            * (1.0 / np.asarray(self.image_std, np.float32))
        t, h, w, c = x.shape
        return x.reshape(t, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4).reshape(-1, c, p, p)

    def preprocess(self, images: Any, return_tensors: str | None = "pt", **kwargs: Any) -> BatchFeature:
        """`images`: one image or a list; an entry that is itself a list is a video chunk (its frames). Returns
        ``pixel_values``, ``grid_thws``, ``num_tokens`` (per entry) and ``image_sizes`` ((W, H) as given)."""
        items = images if isinstance(images, (list, tuple)) else [images]
        if not items:
            raise K3ImageError("no images given")
        pixels, grids, tokens, sizes = [], [], [], []
        for i, item in enumerate(items):
            chunk = isinstance(item, (list, tuple))
            frames = [_load(f, f"image {i} frame {j}") for j, f in enumerate(item)] if chunk \
                else [_load(item, f"image {i}")]
            if not frames or len(frames) > self.max_frames_per_chunk:
                raise K3ImageError(f"image {i}: a video chunk needs 1..{self.max_frames_per_chunk} frames "
                                   f"(max_frames_per_chunk), got {len(frames)}; split the video into chunks")
            plan = self.resize_plan(*frames[0].size)
            pixels.append(self.pack(self._frames(frames, plan)))
            grids.append([len(frames), plan.rows, plan.columns])
            tokens.append(plan.tokens)
            sizes.append(list(frames[0].size))
        data = {"pixel_values": np.concatenate(pixels), "grid_thws": np.asarray(grids, np.int64),
                "num_tokens": tokens, "image_sizes": sizes}
        if return_tensors == "pt":
            data["pixel_values"] = torch.from_numpy(data["pixel_values"])
            data["grid_thws"] = torch.from_numpy(data["grid_thws"])
        return BatchFeature(data=data)


class K3Processor:
    """Images + prompt -> ``input_ids`` with each placeholder expanded, ``pixel_values``, ``grid_thws``.

    The tokenizer is only needed for text prompts; it is loaded from the folder on first use when not given."""

    def __init__(self, image_processor: K3ImageProcessor, tokenizer: Any = None,
                 media_placeholder_token_id: int = MEDIA_PLACEHOLDER_TOKEN_ID,
                 image_placeholder: str = IMAGE_PLACEHOLDER, video_placeholder: str = VIDEO_PLACEHOLDER,
                 tokenizer_path: str | None = None) -> None:
        self.image_processor = image_processor
        self._tokenizer = tokenizer
        self._tokenizer_path = tokenizer_path
        self.media_placeholder_token_id = media_placeholder_token_id
        self.image_placeholder = image_placeholder
        self.video_placeholder = video_placeholder

    # ------------------------------------------------------------------ loading and saving
    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoProcessor") -> None:
        """AutoProcessor calls this on a remote-code class; saving writes ``auto_map`` itself."""

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], tokenizer: Any = None, **kwargs: Any) -> K3Processor:
        path = os.fspath(path)
        image_processor = K3ImageProcessor.from_pretrained(path)
        settings: dict[str, Any] = {}
        config = os.path.join(path, PROCESSOR_CONFIG)
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                settings = json.load(f)
        known = ("media_placeholder_token_id", "image_placeholder", "video_placeholder")
        return cls(image_processor, tokenizer, tokenizer_path=path, **{k: settings[k] for k in known if k in settings})

    def save_pretrained(self, out_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        """``preprocessor_config.json`` (the image processor) and ``processor_config.json`` (the placeholders),
        both with ``auto_map``, and the code they name; the tokenizer saves its own files."""
        self.image_processor.save_pretrained(out_dir)
        settings = {"processor_class": "K3Processor", "auto_map": {"AutoProcessor": AUTO_MAP["AutoProcessor"]},
                    "media_placeholder_token_id": self.media_placeholder_token_id,
                    "image_placeholder": self.image_placeholder, "video_placeholder": self.video_placeholder}
        with open(os.path.join(os.fspath(out_dir), PROCESSOR_CONFIG), "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=2)
            f.write("\n")
        here = os.path.dirname(os.path.abspath(__file__))
        for name in CODE_FILES:  # so that AutoProcessor(..., trust_remote_code=True) finds the classes
            shutil.copyfile(os.path.join(here, name), os.path.join(os.fspath(out_dir), name))

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._tokenizer_path is None:
                raise K3ImageError("a text prompt needs a tokenizer: pass tokenizer=, or input_ids instead of text")
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path, trust_remote_code=True)
            except Exception as exc:  # noqa: BLE001 - any failure means the same thing to the caller
                raise K3ImageError(f"{self._tokenizer_path}: no usable tokenizer ({type(exc).__name__}); pass "
                                   "tokenizer=, or input_ids instead of text") from None
        return self._tokenizer

    # ------------------------------------------------------------------ prompts
    def media_text(self, kind: str, size: Sequence[int], tokens: int) -> str:
        """What one placeholder becomes: the media header, one ``<|media_pad|>`` per merged token, the end marker."""
        header = f"image {size[0]}x{size[1]}" if kind == "image" else "video"
        return f"<|media_begin|>{header}<|media_content|>{MEDIA_PAD * tokens}<|media_end|>"

    def expand_text(self, text: str, kinds: Sequence[str], sizes: Sequence[Sequence[int]],
                    tokens: Sequence[int]) -> str:
        """`text` with its placeholders, in order, replaced by `media_text` of each image / video chunk."""
        marks = {"image": self.image_placeholder, "video": self.video_placeholder}
        out, pos = [], 0
        for i, kind in enumerate(kinds):
            found = sorted((text.find(m, pos), k) for k, m in marks.items() if text.find(m, pos) >= 0)
            if not found:
                raise K3ImageError(f"{len(kinds)} images but the prompt has {i} placeholders; put one "
                                   f"{marks[kind]} where each {kind} goes")
            at, seen = found[0]
            if seen != kind:
                raise K3ImageError(f"placeholder {i + 1} is a {seen} ({marks[seen]}) but media {i} is a {kind}")
            out += [text[pos:at], self.media_text(kind, sizes[i], tokens[i])]
            pos = at + len(marks[kind])
        rest = text[pos:]
        extra = sum(rest.count(m) for m in marks.values())
        if extra:
            raise K3ImageError(f"the prompt has {len(kinds) + extra} placeholders but {len(kinds)} images were given")
        return "".join(out) + rest

    def expand_input_ids(self, input_ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """A tokenised prompt with one placeholder token per image -> one per merged token of each image."""
        pid = self.media_placeholder_token_id
        have = sum(1 for t in input_ids if t == pid)
        if have != len(tokens):
            raise K3ImageError(f"input_ids has {have} placeholder tokens (id {pid}) but {len(tokens)} images were "
                               "given; one placeholder token per image")
        queue = list(tokens)
        out: list[int] = []
        for t in input_ids:
            out.extend([pid] * queue.pop(0) if t == pid else [t])
        return out

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The tokenizer's chat template, as text (its image parts render as the placeholder)."""
        kwargs.setdefault("add_generation_prompt", True)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    def __call__(self, text: str | None = None, images: Any = None, input_ids: Sequence[int] | None = None,
                 return_tensors: str = "pt", **kwargs: Any) -> BatchFeature:
        """One prompt (`text`, or `input_ids` already tokenised) and its images, in prompt order."""
        if (text is None) == (input_ids is None):
            raise K3ImageError("pass exactly one of text or input_ids")
        items = [] if images is None else (images if isinstance(images, (list, tuple)) else [images])
        data: dict[str, Any] = {}
        tokens: list[int] = []
        if items:
            feats = self.image_processor.preprocess(items, return_tensors=return_tensors)
            tokens = list(feats["num_tokens"])
            data.update(pixel_values=feats["pixel_values"], grid_thws=feats["grid_thws"])
        if text is not None:
            kinds = ["video" if isinstance(it, (list, tuple)) else "image" for it in items]
            prompt = self.expand_text(text, kinds, feats["image_sizes"] if items else [], tokens)
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            got = sum(1 for t in ids if t == self.media_placeholder_token_id)
            if got != sum(tokens):
                raise K3ImageError(f"the tokenizer turned {sum(tokens)} {MEDIA_PAD} into {got} tokens of id "
                                   f"{self.media_placeholder_token_id}; the tokenizer and media_placeholder_token_id "
                                   "disagree")
        else:
            ids = self.expand_input_ids(list(input_ids), tokens)
        data["input_ids"] = torch.tensor([ids]) if return_tensors == "pt" else [ids]
        data["attention_mask"] = torch.ones_like(data["input_ids"]) if return_tensors == "pt" else [[1] * len(ids)]
        return BatchFeature(data=data)


__all__ = ["IMAGE_PLACEHOLDER", "K3ImageError", "K3ImageProcessor", "K3Processor", "MEDIA_PAD", "ResizePlan",
           "VIDEO_PLACEHOLDER"]
