"""`K3ForConditionalGeneration`: image features land on the placeholder positions, in order; text-only use is exactly
`K3ForCausalLM`; greedy generation with the hybrid cache equals recomputing the whole prompt at every step."""

from __future__ import annotations

import pytest
import torch

from k3export.modeling import tiny_model, tiny_vision_model
from k3export.modeling.modeling_k3_vision import K3VisionInputError
from vision_helpers import MEDIA_PAD_ID, two_image_inputs


@pytest.fixture(scope="module")
def model():
    return tiny_vision_model(seed=0)


@pytest.fixture(scope="module")
def inputs():
    """Two images of different sizes in one chat-templated prompt, through the real processor."""
    return two_image_inputs()


def test_features_replace_the_placeholder_embeddings_in_order(model, inputs):
    ids, pixels, grids = inputs["input_ids"], inputs["pixel_values"], inputs["grid_thws"]
    with torch.no_grad():
        got = model(input_ids=ids, pixel_values=pixels, grid_thws=grids, use_cache=False).logits
        feats = model.get_image_features(pixels, grids)
        embeds = model.get_input_embeddings()(ids).clone()
        k = 0
        for pos in range(ids.shape[1]):  # by hand: the k-th placeholder gets the k-th merged token
            if ids[0, pos] == MEDIA_PAD_ID:
                embeds[0, pos] = feats[k]
                k += 1
        want = model.language_model(inputs_embeds=embeds, use_cache=False).logits
        text_only = model(input_ids=ids, use_cache=False).logits
    assert k == feats.shape[0] == int((ids == MEDIA_PAD_ID).sum()) and k > 4
    assert torch.equal(got, want)
    first = int((ids[0] == MEDIA_PAD_ID).nonzero()[0])
    # causal: nothing before the first image changes (up to the rounding of KDA's chunked solve, which mixes a chunk)
    assert torch.allclose(got[:, :first], text_only[:, :first], atol=1e-5, rtol=0)
    assert not torch.allclose(got[:, first:], text_only[:, first:])


def test_text_only_is_exactly_the_text_model(model):
    ids = torch.tensor([[1, 7, 9, 200, 3, 3, 11]])  # placeholder ids without images are ordinary tokens
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
        want = tiny_model(seed=0)(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, want)


def test_greedy_generation_with_images_equals_full_recompute(model, inputs):
    ids, pixels, grids = inputs["input_ids"], inputs["pixel_values"], inputs["grid_thws"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=inputs["attention_mask"], pixel_values=pixels,
                             grid_thws=grids, max_new_tokens=5, do_sample=False)
        seq = ids
        for _ in range(5):  # no cache: the whole prompt with its images, every step
            logits = model(input_ids=seq, pixel_values=pixels, grid_thws=grids, use_cache=False).logits
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
    assert out.tolist() == seq.tolist()


def test_placeholder_and_image_counts_must_agree(model, inputs):
    ids, pixels, grids = inputs["input_ids"], inputs["pixel_values"], inputs["grid_thws"]
    short = ids[:, : int((ids[0] == MEDIA_PAD_ID).nonzero()[-1])]  # the last placeholder cut off
    with pytest.raises(K3VisionInputError, match=r"the prompt has \d+ image placeholder tokens .* but the images "
                                                 r"give \d+ tokens") as info:
        model(input_ids=short, pixel_values=pixels, grid_thws=grids)
    assert "\n" not in str(info.value)
    with pytest.raises(K3VisionInputError, match="needs its grid_thws"):
        model(input_ids=ids, pixel_values=pixels)
    with pytest.raises(K3VisionInputError, match="images need input_ids"):
        model(inputs_embeds=torch.zeros(1, 3, 64), pixel_values=pixels, grid_thws=grids)
