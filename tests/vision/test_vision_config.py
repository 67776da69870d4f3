"""`K3VisionConfig` / `K3VLConfig`: the published vision_config keys, every bad field refused naming it, and the
text-only `K3Config` reading of the same config.json unchanged."""

from __future__ import annotations

import pytest

from k3export.modeling import K3Config, K3ConfigError, K3VisionConfig, K3VLConfig

# the development checkpoint's vision_config (inference-optimization/Kimi-K3-0.40B-MXFP4), with the bookkeeping keys
# transformers writes beside it
DEV_VISION = {
    "activation_func": "gelu_pytorch_tanh", "attn_bias": False, "init_pos_emb_height": 64, "init_pos_emb_time": 4,
    "init_pos_emb_width": 64, "linear_bias": False, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "mlp_type": "mlp2", "mm_hidden_size": 256, "mm_projector_type": "patchmergerv2", "model_type": "",
    "norm_type": "rmsnorm", "patch_embed_proj_bias": False, "patch_size": 14, "pos_emb_interpolation_mode": "bilinear",
    "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
    "qkv_hidden_size": 1536, "text_hidden_size": 1024, "vt_hidden_size": 256, "vt_intermediate_size": 512,
    "vt_num_attention_heads": 4, "vt_num_hidden_layers": 2,
    "_name_or_path": "", "architectures": None, "dtype": None, "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "return_dict": True, "problem_type": None, "is_encoder_decoder": False,
}


def test_development_vision_config_reads():
    cfg = K3VisionConfig(**DEV_VISION)
    assert cfg.model_type == "kimi_k3_vision"
    assert cfg.head_dim == 384 and cfg.projector_in_size == 1024 and cfg.merge_area == 4


def test_released_defaults():
    cfg = K3VisionConfig()
    assert (cfg.vt_num_hidden_layers, cfg.vt_hidden_size, cfg.vt_num_attention_heads, cfg.head_dim) == (27, 1024, 12,
                                                                                                        128)
    assert cfg.text_hidden_size == K3Config.k3().hidden_size == 7168


@pytest.mark.parametrize("edit, phrase", [
    ({"pos_emb_type": "learned"}, "vision_config.pos_emb_type is 'learned'; k3export implements 'divided_fixed'"),
    ({"pos_emb_interpolation_mode": "bicubic"}, "vision_config.pos_emb_interpolation_mode"),
    ({"merge_type": "sd2"}, "vision_config.merge_type"),
    ({"attn_bias": True}, "vision_config.attn_bias is True; k3export implements False"),
    ({"norm_type": "layernorm"}, "vision_config.norm_type"),
    ({"vt_hidden_size": 0}, "vision_config.vt_hidden_size must be a positive integer"),
    ({"vt_num_hidden_layers": 1.5}, "vision_config.vt_num_hidden_layers must be a positive integer"),
    ({"qkv_hidden_size": 1002}, "qkv_hidden_size \\(1002\\) must be a multiple of vt_num_attention_heads \\(4\\)"),
    ({"qkv_hidden_size": 40}, "= 10 must be a multiple of 4"),
    ({"mm_hidden_size": 128}, "mm_hidden_size \\(128\\) must equal vt_hidden_size \\(256\\)"),
    ({"merge_kernel_size": [2]}, "vision_config.merge_kernel_size must be two positive integers"),
    ({"projector_ln_eps": float("nan")}, "vision_config.projector_ln_eps must be in \\(0, 1\\)"),
])
def test_bad_vision_fields_are_refused_naming_the_field(edit, phrase):
    with pytest.raises(K3ConfigError, match=phrase) as info:
        K3VisionConfig(**{**DEV_VISION, **edit})
    assert "\n" not in str(info.value)


def _dev_top(**edits):
    text = K3Config.tiny().to_dict()
    vision = dict(DEV_VISION, text_hidden_size=64)
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
            "vision_config": vision, "media_placeholder_token_id": 3, **edits}


def test_composite_config_round_trip():
    cfg = K3VLConfig.from_released_dict(_dev_top())
    assert cfg.vision_config.vt_hidden_size == 256 and cfg.text_config.num_hidden_layers == 6
    again = K3VLConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("edits, phrase", [
    ({"media_placeholder_token_id": 163605},
     "media_placeholder_token_id must be a token id .* = \\[0, 512\\), got 163605"),
    ({"vision_config": dict(DEV_VISION)}, "text_hidden_size \\(1024\\) must equal text_config.hidden_size \\(64\\)"),
    ({"vision_config": None}, "no vision_config object"),
    ({"model_type": "kimi_linear"}, "model_type 'kimi_linear'"),
])
def test_composite_mismatches_are_refused(edits, phrase):
    with pytest.raises(K3ConfigError, match=phrase):
        K3VLConfig.from_released_dict(_dev_top(**edits))


def test_text_only_reading_of_a_vision_config_json_is_unchanged():
    top = _dev_top()
    assert K3Config.from_released_dict(top).to_dict() == K3Config.tiny().to_dict()
