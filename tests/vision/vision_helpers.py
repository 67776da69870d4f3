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


def two_image_inputs():
    """Two images of different sizes in one chat-templated prompt, through the real processor (`K3Processor`)."""
    from k3export.modeling import K3ImageProcessor, K3Processor

    ip = K3ImageProcessor(patch_size=4, in_patch_limit=24, patch_limit_on_one_side=8, max_frames_per_chunk=2)
    proc = K3Processor(ip, tiny_tokenizer(), media_placeholder_token_id=MEDIA_PAD_ID)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image"},
                                             {"type": "text", "text": " and that "}, {"type": "image"},
                                             {"type": "text", "text": " ?"}]}]
    out = proc(text=proc.apply_chat_template(messages), images=[random_image(20, 12, 1), random_image(9, 17, 2)])
    assert len({tuple(g) for g in out["grid_thws"].tolist()}) == 2  # two different sizes
    return out


def torch_reference(model, inputs, steps: int):
    """PyTorch's own prefill + greedy decode with the hybrid cache: (last-position logits of every call, tokens)."""
    import torch

    from k3export.modeling import K3Cache

    cache = K3Cache(model.config.text_config)
    with torch.no_grad():
        out = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                    grid_thws=inputs["grid_thws"], cache=cache, use_cache=True)
        logits, tokens = [out.logits[:, -1].numpy()], [int(out.logits[0, -1].argmax())]
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
            logits.append(out.logits[:, -1].numpy())
            tokens.append(int(out.logits[0, -1].argmax()))
    return logits, tokens


def worst_against_reference(runner, inputs, want_logits, want_tokens, steps: int) -> float:
    """`runner` through the shared loop on the image prompt, fed its own greedy tokens for `steps` steps: asserts
    its tokens are the reference's and each step's logits pass the fp32 tolerances; returns the largest absolute
    logit difference."""
    from k3export.runtime import Decoding, next_tokens
    from k3export.runtime.loop import Images, with_images
    from k3export.validate.compare import DEFAULT_TOLERANCES, compare

    d = Decoding(with_images(runner, Images(inputs["pixel_values"].numpy(), inputs["grid_thws"].numpy())))
    out = d.feed(inputs["input_ids"].numpy())
    got_logits, got_tokens = [np.asarray(out.logits)[:, -1]], [int(next_tokens(out)[0])]
    for _ in range(steps):
        out = d.feed(np.array([[got_tokens[-1]]], np.int64))
        got_logits.append(np.asarray(out.logits)[:, -1])
        got_tokens.append(int(next_tokens(out)[0]))
    assert got_tokens == want_tokens
    worst = 0.0
    for step, (g, w) in enumerate(zip(got_logits, want_logits)):
        m = compare(g, w, "logits", DEFAULT_TOLERANCES["float32"])
        assert m.passed, f"step {step}: {m.reason}"
        worst = max(worst, float(np.abs(g.astype(np.float64) - w).max()))
    return worst


def corrupted_vision_copy(export, tmp_path, tensor: str, scale: float):
    """A copy of `export` (in ``tmp_path / "corrupt"``) whose vision data holds `tensor` multiplied by `scale`, its
    bytes rewritten in place."""
    import shutil

    import onnx

    from k3export.converters.onnx.vision import VISION_FILE

    bad = tmp_path / "corrupt"
    shutil.copytree(export, bad)
    graph = onnx.load(str(bad / VISION_FILE), load_external_data=False)
    init = next(i for i in graph.graph.initializer if i.name == tensor)
    info = {e.key: e.value for e in init.external_data}
    offset, length = int(info.get("offset", 0)), int(info["length"])
    with open(bad / info["location"], "r+b") as f:
        f.seek(offset)
        values = np.frombuffer(f.read(length), dtype=np.float32) * scale
        f.seek(offset)
        f.write(values.astype(np.float32).tobytes())
    return bad
