"""Shared helpers of the vision tests: a real (tiny) tokenizer with K3's media tokens and a chat template."""

from __future__ import annotations

import numpy as np

MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|kimi_image_placeholder|>",
                "<|kimi_video_placeholder|>", "<|im_user|>", "<|im_assistant|>", "<|im_end|>"]
#: renders each image part of a message as the placeholder, the way K3's template does
CHAT_TEMPLATE = ("{% for m in messages %}<|im_{{ m.role }}|>{% for part in m.content %}"
                 "{% if part.type == 'image' %}<|kimi_image_placeholder|>{% else %}{{ part.text }}{% endif %}"
                 "{% endfor %}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>{% endif %}")


#: the id of ``<|media_pad|>`` in `tiny_tokenizer`: the tiny model's media_placeholder_token_id (`K3VLConfig.tiny`)
MEDIA_PAD_ID = 3


def tiny_tokenizer():
    """A word-level tokenizer over a few words (ids < 64), ``<|media_pad|>`` at `MEDIA_PAD_ID`, K3's media markers
    as special tokens above it, and `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<eos>", "<|media_pad|>", "what", "is", "in", "this", "picture", "and", "that", "?",
             "image", "video"]
    vocab = {w: i for i, w in enumerate(words)}
    assert vocab["<|media_pad|>"] == MEDIA_PAD_ID
    for i, t in enumerate(MEDIA_TOKENS):
        vocab[t] = 40 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": ["<|media_pad|>", *MEDIA_TOKENS]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def random_image(width: int, height: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
