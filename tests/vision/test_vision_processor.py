"""The image processor (resize within the patch budget, pad, normalise, pack with the grid) and the processor
(placeholder expansion in a chat-templated prompt, several images of different sizes, video chunks), checked
against sizes worked out by hand and pixels cut out of the image here; plus the bad inputs a user hands over."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from k3export.modeling import K3ImageError, K3ImageProcessor, K3Processor
from vision_helpers import MEDIA_PAD_ID, random_image, tiny_tokenizer

RELEASED = K3ImageProcessor()  # patch 14, merge 2x2, 16384 patches, 512 a side


@pytest.mark.parametrize("size, resized, padding, grid, tokens", [
    # 71 x 57 = 4047 patches: within the budget, never enlarged; padded to 28-pixel blocks
    ((1000, 800), (1000, 800), (8, 12), (58, 72), 29 * 36),
    # 285 x 214 = 60990 patches: scale sqrt(16384 / 60990) = 0.51830...; padding adds part of a block row/column
    ((4000, 3000), (2073, 1554), (27, 14), (112, 150), 56 * 75),
    # 7168 pixels a side at most (512 patches): the long side caps the scale at 0.3584
    ((20000, 20), (7168, 7), (0, 21), (2, 512), 1 * 256),
    # smaller than one merge block: one token
    ((5, 5), (5, 5), (23, 23), (2, 2), 1),
])
def test_resize_plan_follows_the_released_rule(size, resized, padding, grid, tokens):
    plan = RELEASED.resize_plan(*size)
    assert (plan.width, plan.height) == resized
    assert (plan.pad_width, plan.pad_height) == padding
    assert (plan.rows, plan.columns) == grid and plan.tokens == tokens


def test_resize_plan_properties_over_many_sizes():
    rng = np.random.default_rng(0)
    for w, h in rng.integers(1, 9000, size=(300, 2)):
        plan = RELEASED.resize_plan(int(w), int(h))
        assert plan.width <= w and plan.height <= h  # never enlarged
        assert plan.rows % 2 == 0 and plan.columns % 2 == 0
        assert plan.rows <= 512 and plan.columns <= 512
        # the released rule bounds the original's floor grid: the resized one may exceed the budget by the floor
        # rounding (< (1 + 1/32)^2 once the budget binds: each side then has 32+ patches), the padding by one block
        # row and column more (measured over 200k sizes: 1.022 and 1.081)
        assert (plan.width // 14) * (plan.height // 14) <= 16384 * (1 + 1 / 32) ** 2
        assert plan.rows * plan.columns <= 16384 * 1.09
        assert plan.rows * plan.columns <= (plan.height // 14 + 2) * (plan.width // 14 + 2)
        assert plan.tokens == plan.rows * plan.columns // 4


def _expected_patches(image: Image.Image, size: tuple[int, int], pad: tuple[int, int], p: int) -> np.ndarray:
    """Resize with PIL, pad black, normalise with mean = std = 0.5, cut patch after patch (row-major)."""
    arr = np.asarray(image.resize(size, Image.Resampling.BICUBIC)).astype(np.float64)
    arr = np.pad(arr, ((0, pad[1]), (0, pad[0]), (0, 0)))
    arr = (arr / 255.0 - 0.5) / 0.5
    rows, cols = arr.shape[0] // p, arr.shape[1] // p
    return np.stack([arr[r * p:(r + 1) * p, c * p:(c + 1) * p].transpose(2, 0, 1)
                     for r in range(rows) for c in range(cols)])


def test_pixels_are_resized_padded_normalised_and_packed():
    proc = K3ImageProcessor(patch_size=4, in_patch_limit=16, patch_limit_on_one_side=12)
    a, b = random_image(10, 7, seed=1), random_image(40, 20, seed=2)  # b is over the 16-patch budget
    out = proc.preprocess([a, b])
    # a: 2 x 1 patches, within budget -> 10 x 7, padded to 16 x 8; b: scale sqrt(16 / 50) -> 22 x 11 -> 24 x 16
    assert out["grid_thws"].tolist() == [[1, 2, 4], [1, 4, 6]] and out["num_tokens"] == [2, 6]
    want = np.concatenate([_expected_patches(a, (10, 7), (6, 1), 4), _expected_patches(b, (22, 11), (2, 5), 4)])
    assert out["pixel_values"].dtype == torch.float32 and tuple(out["pixel_values"].shape) == want.shape
    assert np.abs(out["pixel_values"].numpy() - want).max() < 1e-6


def test_a_video_chunk_packs_its_frames_and_costs_one_frame_of_tokens():
    proc = K3ImageProcessor(patch_size=4, in_patch_limit=16, patch_limit_on_one_side=12)
    f0, f1 = random_image(10, 7, seed=3), random_image(10, 7, seed=4)
    out = proc.preprocess([[f0, f1]])
    assert out["grid_thws"].tolist() == [[2, 2, 4]] and out["num_tokens"] == [2]
    want = np.concatenate([_expected_patches(f, (10, 7), (6, 1), 4) for f in (f0, f1)])
    assert np.abs(out["pixel_values"].numpy() - want).max() < 1e-6


def test_placeholder_expands_to_header_pads_and_end():
    proc = K3Processor(K3ImageProcessor(patch_size=4, in_patch_limit=16, patch_limit_on_one_side=12))
    text = proc.expand_text("a<|kimi_image_placeholder|>b", ["image"], [(10, 7)], [2])
    assert text == "a<|media_begin|>image 10x7<|media_content|><|media_pad|><|media_pad|><|media_end|>b"


@pytest.fixture(scope="module")
def processor():
    ip = K3ImageProcessor(patch_size=4, in_patch_limit=64, patch_limit_on_one_side=12, max_frames_per_chunk=2)
    return K3Processor(ip, tiny_tokenizer(), media_placeholder_token_id=MEDIA_PAD_ID)


def _segments(ids: list[int]) -> list[int]:
    """Lengths of the runs of the media pad token, in order."""
    runs, n = [], 0
    for t in ids + [-1]:
        if t == MEDIA_PAD_ID:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_chat_template_prompt_with_several_images_of_different_sizes(processor):
    images = [random_image(30, 20, seed=5), random_image(9, 40, seed=6), random_image(17, 17, seed=7)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " what is in this "},
                                             {"type": "image"}, {"type": "text", "text": " and that "},
                                             {"type": "image"}, {"type": "text", "text": " ?"}]}]
    prompt = processor.apply_chat_template(messages)
    assert prompt.count("<|kimi_image_placeholder|>") == 3
    out = processor(text=prompt, images=images)
    tokens = [processor.image_processor.resize_plan(*im.size).tokens for im in images]
    assert len(set(tokens)) == 3  # three different sizes
    ids = out["input_ids"][0].tolist()
    assert _segments(ids) == tokens
    assert out["grid_thws"].shape == (3, 3) and int(out["grid_thws"].prod(-1).sum()) == out["pixel_values"].shape[0]
    headers = [ids[i + 1:i + 3] for i, t in enumerate(ids) if t == processor.tokenizer.convert_tokens_to_ids(
        "<|media_begin|>")]
    assert len(headers) == 3 and all(h[0] == processor.tokenizer.convert_tokens_to_ids("image") for h in headers)


def test_tokenised_prompt_expands_each_placeholder_token(processor):
    images = [random_image(30, 20, seed=8), [random_image(12, 12, seed=9), random_image(12, 12, seed=10)]]
    out = processor(input_ids=[4, MEDIA_PAD_ID, 5, MEDIA_PAD_ID, 6], images=images)
    ids = out["input_ids"][0].tolist()
    tokens = out["grid_thws"][:, 1:].prod(-1).div(4).int().tolist()
    assert _segments(ids) == tokens and ids[0] == 4 and ids[-1] == 6
    assert out["grid_thws"][:, 0].tolist() == [1, 2]


def test_auto_classes_read_the_checkpoint_processor(tmp_path):
    from transformers import AutoImageProcessor, AutoProcessor

    from k3export.converters.checkpoints.synthetic_vision import write_vision_checkpoint

    folder = write_vision_checkpoint(tmp_path / "ckpt", num_shards=1)
    auto_ip = AutoImageProcessor.from_pretrained(folder, trust_remote_code=True)
    auto_p = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    assert type(auto_p).__name__ == "K3Processor" and auto_p.media_placeholder_token_id == MEDIA_PAD_ID
    image = random_image(50, 30, seed=11)
    mine = K3ImageProcessor.from_pretrained(folder).preprocess([image])
    for other in (auto_ip.preprocess([image]), auto_p(input_ids=[MEDIA_PAD_ID], images=[image])):
        assert torch.equal(other["pixel_values"], mine["pixel_values"])
        assert torch.equal(other["grid_thws"], mine["grid_thws"])


# ------------------------------------------------------------------------------------------- bad inputs


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_missing_and_corrupt_images_are_refused(processor, tmp_path):
    with pytest.raises(K3ImageError, match="is not a file") as info:
        processor(input_ids=[MEDIA_PAD_ID], images=[str(tmp_path / "cat.png")])
    assert "cat.png" in _one_line(info)
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4)
    with pytest.raises(K3ImageError, match="cannot be read as an image") as info:
        processor(input_ids=[MEDIA_PAD_ID], images=[str(bad)])
    assert "broken.png" in _one_line(info)
    with pytest.raises(K3ImageError, match="expected a PIL image"):
        processor(input_ids=[MEDIA_PAD_ID], images=[42])


def test_an_image_file_is_read(processor, tmp_path):
    path = tmp_path / "ok.png"
    random_image(20, 12, seed=12).save(path)
    out = processor(input_ids=[MEDIA_PAD_ID], images=[str(path)])
    assert out["grid_thws"].tolist() == [[1, 4, 6]]


@pytest.mark.parametrize("text, images, phrase", [
    ("<|kimi_image_placeholder|> what", 2, "2 images but the prompt has 1 placeholders"),
    ("<|kimi_image_placeholder|><|kimi_image_placeholder|>", 1, "has 2 placeholders but 1 images"),
    ("what is this", 1, "1 images but the prompt has 0 placeholders"),
])
def test_placeholders_and_images_must_pair_up(processor, text, images, phrase):
    with pytest.raises(K3ImageError, match=phrase) as info:
        processor(text=text, images=[random_image(8, 8, seed=i) for i in range(images)])
    _one_line(info)


def test_too_many_ids_placeholders_or_frames_are_refused(processor):
    with pytest.raises(K3ImageError, match="input_ids has 2 placeholder tokens .* but 1 images"):
        processor(input_ids=[MEDIA_PAD_ID, MEDIA_PAD_ID], images=[random_image(8, 8)])
    with pytest.raises(K3ImageError, match="needs 1..2 frames .* got 3"):
        processor(input_ids=[MEDIA_PAD_ID], images=[[random_image(8, 8)] * 3])
    with pytest.raises(K3ImageError, match="placeholder 1 is a image .* media 0 is a video"):
        processor(text="<|kimi_image_placeholder|>", images=[[random_image(8, 8)] * 2])


@pytest.mark.parametrize("kwargs, phrase", [
    ({"patch_size": 0}, "patch_size must be a positive integer"),
    ({"merge_kernel_size": [2]}, "merge_kernel_size must be"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std must be positive"),
    ({"in_patch_limit": math.inf}, "in_patch_limit must be a positive integer"),
])
def test_bad_processor_settings_name_the_field(kwargs, phrase):
    with pytest.raises(K3ImageError, match=phrase):
        K3ImageProcessor(**kwargs)
