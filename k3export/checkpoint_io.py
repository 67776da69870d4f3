"""Our own checkpoint folders: load a config from a folder or preset, write the tiny demo checkpoints (text, or
image + text with ``k3export tiny --vision``).

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
from k3export.modeling.configuration_k3 import K3VisionConfig, K3VLConfig
from k3export.modeling.image_processing_k3 import IMAGE_PLACEHOLDER, MEDIA_PAD, VIDEO_PLACEHOLDER
from k3export.safety import CHECKPOINT, check_output, output_folder

PRESETS = {"k3": K3Config.k3, "tiny": K3Config.tiny, "tiny-kimi-linear": K3Config.tiny_kimi_linear}
#: the presets that are image + text models: the released K3 carries the MoonViT-V2 tower (the others are text-only)
VISION_PRESETS = frozenset({"k3"})


def preset_config(name: str) -> K3Config | None:
    """The preset called `name` (``k3``, ``tiny``, ``tiny-kimi-linear``; '_' works for '-'), else None."""
    factory = PRESETS.get(str(name).replace("_", "-"))
    return factory() if factory is not None else None


def preset_model_config(name: str, *, vision: bool = True) -> K3Config | K3VLConfig | None:
    """The whole model a preset names, as `export` builds its graphs: the released ``k3`` is image + text (a
    `K3VLConfig`: the text model of `preset_config` with the released tower) unless `vision` is False; every other
    preset is its text `K3Config`. None for an unknown name."""
    text = preset_config(name)
    if text is None or not vision or str(name).replace("_", "-") not in VISION_PRESETS:
        return text
    return K3VLConfig(text_config=text)  # its default vision_config is the released tower


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
    preset = preset_model_config(str(model))
    if preset is not None:
        return preset.vision_config if isinstance(preset, K3VLConfig) else None
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


#: the image tokens of the tiny image + text checkpoint's tokenizer, appended after the tiny BPE's ids in this
#: order; the first is the placeholder the image features replace (`K3VLConfig.media_placeholder_token_id`)
TINY_MEDIA_TOKENS = (MEDIA_PAD, "<|media_begin|>", "<|media_content|>", "<|media_end|>", IMAGE_PLACEHOLDER,
                     VIDEO_PLACEHOLDER)
#: the tiny checkpoint's image budget: a few dozen patches per image, so any photo costs ~16 text tokens
TINY_IMAGE_BUDGET = {"in_patch_limit": 64, "patch_limit_on_one_side": 16}


def _write_tiny_vision_tokenizer(folder: Path, config: K3Config) -> int:
    """`write_tiny_tokenizer` over the first ids of `config`'s vocabulary, then `TINY_MEDIA_TOKENS` as special
    tokens on its last ids (tokenizer.json and tokenizer_config.json's ``added_tokens_decoder`` alike). Returns the
    id of ``<|media_pad|>``."""
    import json
    from types import SimpleNamespace

    from tokenizers import AddedToken, Tokenizer

    from k3export.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, write_tiny_tokenizer

    base = int(config.vocab_size) - len(TINY_MEDIA_TOKENS)
    write_tiny_tokenizer(folder, SimpleNamespace(vocab_size=base, pad_token_id=config.pad_token_id,
                                                 bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id))
    tok = Tokenizer.from_file(str(folder / TOKENIZER_JSON))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in TINY_MEDIA_TOKENS])
    ids = [tok.token_to_id(t) for t in TINY_MEDIA_TOKENS]
    if ids != list(range(base, int(config.vocab_size))):  # a BPE token spelt like a media token would take its id
        raise K3ExportError(f"tiny tokenizer: the media tokens got ids {ids}, expected {base}..{config.vocab_size - 1}")
    tok.save(str(folder / TOKENIZER_JSON))
    settings_path = folder / TOKENIZER_CONFIG
    settings = json.loads(settings_path.read_text(encoding="utf-8"))
    for token, i in zip(TINY_MEDIA_TOKENS, ids):
        settings["added_tokens_decoder"][str(i)] = {"content": token, "lstrip": False, "normalized": False,
                                                    "rstrip": False, "single_word": False, "special": True}
    settings_path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    return ids[0]


def write_tiny_vision_checkpoint(out_dir: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """A tiny random image + text K3 (`tiny_vision_model`: the tiny text model with a 2-layer MoonViT-V2 tower) saved
    as `K3ForConditionalGeneration.save_pretrained` saves it (released layout, dense experts, code files), with the
    tiny BPE tokenizer plus K3's media tokens (`TINY_MEDIA_TOKENS`) and the processor files (`K3Processor`, budget
    `TINY_IMAGE_BUDGET`): ``k3export generate OUT "What is in this picture?" --image cat.png`` runs it."""
    from k3export.modeling import K3ImageProcessor, K3Processor, tiny_vision_model

    if not 0 <= seed < 2**64:
        raise K3ExportError(f"--seed must be in [0, 2**64), got {seed}")
    check_output(out_dir, CHECKPOINT, overwrite=overwrite)  # refuse before building the model
    text = K3Config.tiny()
    placeholder = int(text.vocab_size) - len(TINY_MEDIA_TOKENS)  # `_write_tiny_vision_tokenizer` puts it there
    model = tiny_vision_model(seed, media_placeholder_token_id=placeholder)
    v = model.config.vision_config
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    with output_folder(out_dir, CHECKPOINT, overwrite=overwrite) as tmp:
        hf_logging.disable_progress_bar()  # one shard of a few MB: transformers' bar would only clutter the CLI
        try:
            model.save_pretrained(tmp)
        except Exception as exc:
            if type(exc).__name__ != "SafetensorError":  # safetensors' writer: disk full, I/O error
                raise
            raise CheckpointError(f"{out_dir}: could not write the checkpoint ({exc})") from None
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        if _write_tiny_vision_tokenizer(Path(tmp), text) != placeholder:
            raise K3ExportError("tiny tokenizer: <|media_pad|> is not the model's media_placeholder_token_id")
        images = K3ImageProcessor(patch_size=v.patch_size, merge_kernel_size=list(v.merge_kernel_size),
                                  max_frames_per_chunk=v.init_pos_emb_time, **TINY_IMAGE_BUDGET)
        K3Processor(images, media_placeholder_token_id=placeholder).save_pretrained(tmp)
    return Path(out_dir)
