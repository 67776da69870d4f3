"""config.json's ``dtype`` / ``torch_dtype`` and token ids are checked where the config is built: a bad value is one
`K3ConfigError` naming the field and what it accepts, and ``k3export export`` reports it as one line naming the
file (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from k3export.modeling import K3Config
from k3export.modeling.configuration_k3 import K3ConfigError


def _ours(**changes) -> dict:
    """The tiny preset as save_pretrained writes config.json, with `changes`."""
    return {**json.loads(K3Config.tiny().to_json_string()), **changes}


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("value", ["float32", "bfloat16", "float16", "torch.bfloat16", None])
def test_loadable_dtypes_pass(key, value):
    config = K3Config.from_released_dict(_ours(**{key: value}))
    assert config.vocab_size == 512
    # the transformers path (AutoConfig -> from_dict -> __init__) turns the name into the torch dtype
    dtype = K3Config.from_dict(_ours(**{key: value})).dtype
    assert dtype == (None if value is None else getattr(torch, value.removeprefix("torch.")))


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("value", ["nonsense", "int8", "float64", "auto", 16, ["bfloat16"]])
def test_other_dtypes_are_refused_naming_the_field(key, value):
    pattern = f"{key} must be one of float32, bfloat16, float16, got {value!r}"
    with pytest.raises(K3ConfigError, match=pattern.replace("[", r"\[").replace("]", r"\]")):
        K3Config.from_released_dict(_ours(**{key: value}))
    with pytest.raises(K3ConfigError, match=key):  # before transformers' getattr(torch, value)
        K3Config.from_dict(_ours(**{key: value}))


def test_released_text_config_dtype_is_checked():
    from k3export.converters.checkpoints.synthetic import released_tiny_config, text_config_dict

    text = text_config_dict(released_tiny_config())
    released = {"model_type": "kimi_k3", "text_config": {**text, "torch_dtype": "bf17"}}
    with pytest.raises(K3ConfigError, match="text_config.torch_dtype must be one of"):
        K3Config.from_released_dict(released)


@pytest.mark.parametrize("field,value,shown", [
    ("eos_token_id", -5, "eos_token_id"),
    ("bos_token_id", 100000, "bos_token_id"),
    ("pad_token_id", 512, "pad_token_id"),  # vocab_size itself is one past the last id
    ("eos_token_id", [2, 512], "eos_token_id[1]"),
    ("eos_token_id", [2, None], "eos_token_id[1]"),
    ("bos_token_id", True, "bos_token_id"),
    ("pad_token_id", 1.0, "pad_token_id"),
    ("bos_token_id", [1], "bos_token_id"),  # only eos may be a list
])
def test_token_ids_outside_the_vocabulary_are_refused(field, value, shown):
    with pytest.raises(K3ConfigError, match=rf"{shown.replace('[', '.')} must be a token id in \[0, vocab_size\) = "
                                            rf"\[0, 512\)"):
        K3Config.from_released_dict(_ours(**{field: value}))
    with pytest.raises(K3ConfigError, match=field):
        K3Config.tiny(**{field: value})


@pytest.mark.parametrize("ids", [dict(bos_token_id=0, eos_token_id=511, pad_token_id=None),
                                 dict(eos_token_id=[2, 511]), dict(bos_token_id=None, eos_token_id=None)])
def test_token_ids_inside_the_vocabulary_pass(ids):
    config = K3Config.from_released_dict(_ours(**ids))
    for key, value in ids.items():
        assert getattr(config, key) == value


@pytest.mark.parametrize("changes,expected", [
    ({"dtype": "nonsense"}, "dtype must be one of float32, bfloat16, float16, got 'nonsense'"),
    ({"eos_token_id": -5}, "eos_token_id must be a token id in [0, vocab_size) = [0, 512), got -5"),
    ({"bos_token_id": 100000}, "bos_token_id must be a token id in [0, vocab_size) = [0, 512), got 100000"),
])
def test_export_refuses_in_one_line_naming_the_file(tiny_k3, tmp_path, changes, expected):
    from k3export.modeling import save_pretrained
    from k3export_cli.main import app

    ckpt = tmp_path / "ckpt"
    save_pretrained(tiny_k3, ckpt)
    data = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**data, **changes}))
    res = CliRunner().invoke(app, ["export", str(ckpt), str(tmp_path / "out")])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith("error: ") and f"{ckpt / 'config.json'}: " in lines[0] and expected in lines[0], lines
    assert not (tmp_path / "out").exists()
