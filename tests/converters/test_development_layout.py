"""The public 0.40B development checkpoint's layout (``inference-optimization/Kimi-K3-0.40B-MXFP4``): a ``kimi_k3``
config whose ``text_config`` is ``kimi_linear`` without ``gate_lower_bound``, one shared expert, and KDA ``A_log``
stored padded to [max(H, head_dim)] where the config implies [1, 1, H, 1]. Built from the published config.json
(``tests/fixtures``, vocabulary cut down, random weights), it loads, converts, exports and validates; every reader
asks `layouts` which stored shapes a tensor may have (`check_stored_shape`, the one shape check).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from k3export import K3ForCausalLM
from k3export.converters.checkpoints.convert import convert
from k3export.converters.checkpoints.safetensors_io import INDEX_NAME, write_safetensors
from k3export.converters.checkpoints.synthetic_vision import write_vision_checkpoint
from k3export.converters.onnx import export_onnx
from k3export.errors import CheckpointError
from k3export.modeling.configuration_k3 import K3VLConfig

os.environ.setdefault("TRITON_INTERPRET", "1")

PUBLISHED = Path(__file__).parent.parent / "fixtures" / "kimi_k3_0.40b_config.json"
VOCAB = 1024


def _published() -> dict:
    cfg = json.loads(PUBLISHED.read_text())
    cfg["text_config"]["vocab_size"] = VOCAB  # 163840 rows of embeddings would be most of the 0.40B
    cfg["media_placeholder_token_id"] = VOCAB - 24
    return cfg


@pytest.fixture(scope="module")
def dev(tmp_path_factory) -> Path:
    """Random weights in the published layout: the writer's shards (MXFP4 experts, A_log padded), then the published
    config.json as it is, with the writer's quantization_config (the shards' MXFP4 needs one)."""
    cfg = _published()
    out = write_vision_checkpoint(tmp_path_factory.mktemp("dev") / "src", config=K3VLConfig.from_released_dict(cfg),
                                  style="dev", a_log="padded", expert_mode="random")
    cfg["quantization_config"] = json.loads((out / "config.json").read_text())["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _stored(folder: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    shard = json.loads((folder / INDEX_NAME).read_text())["weight_map"][name]
    with safe_open(str(folder / shard), framework="pt") as f:
        return f.get_tensor(name)


def test_published_layout_stores_a_log_padded(dev):
    text = json.loads(dev.joinpath("config.json").read_text())["text_config"]
    assert "gate_lower_bound" not in text["linear_attn_config"] and text["num_shared_experts"] == 1
    heads, head_dim = text["linear_attn_config"]["num_heads"], text["linear_attn_config"]["head_dim"]
    assert _stored(dev, "language_model.model.layers.0.self_attn.A_log").shape == (max(heads, head_dim),)


def test_loads_with_from_pretrained_reading_a_log_by_its_shape(dev):
    model = K3ForCausalLM.from_pretrained(dev)
    stored = _stored(dev, "language_model.model.layers.1.self_attn.A_log")
    a_log = model.model.layers[1].self_attn.A_log
    assert a_log.shape == (1, 1, 8, 1)
    assert torch.equal(a_log.reshape(-1), stored[:8].float())
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(12)[None]).logits).all()


def test_exports_and_validates_on_torch_and_ort(dev, tmp_path):
    from k3export.validate.api import run_validation

    export_onnx(dev, tmp_path / "onnx", dtype="fp32", vision=False)
    run = run_validation(dev, runtimes=["torch", "ort"], onnx_dir=tmp_path / "onnx", prompt_len=8, steps=3, batch=1)
    assert run.result.passed, run.result.localisation
    assert run.report.reference_dtype == "float32"


def test_converts_into_our_layout(dev, tmp_path):
    convert(dev, tmp_path / "ours", dtype="fp32", text_only=True)
    ours = K3ForCausalLM.from_pretrained(tmp_path / "ours")
    theirs = K3ForCausalLM.from_pretrained(dev, torch_dtype=torch.float32)
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=0, atol=0)


def test_a_shape_that_fits_no_layout_is_refused_naming_every_accepted_shape(dev, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(dev, bad)
    name = "language_model.model.layers.0.self_attn.A_log"
    shard = json.loads((bad / INDEX_NAME).read_text())["weight_map"][name]
    from safetensors import safe_open

    with safe_open(str(bad / shard), framework="pt") as f:
        tensors = [(n, f.get_tensor(n)[:7] if n == name else f.get_tensor(n)) for n in f.keys()]
    write_safetensors(bad / shard, tensors, {"format": "pt"})
    want = (rf"{shard}: tensor '{name}' has wrong shape \[7\]; config.json needs \[1, 1, 8, 1\] "
            r"\(or, in another checkpoint layout, \[32\]\)")
    with pytest.raises(CheckpointError, match=want):
        K3ForCausalLM.from_pretrained(bad)
    with pytest.raises(CheckpointError, match=want):
        export_onnx(bad, tmp_path / "onnx", vision=False)


def test_one_shape_check_for_stored_tensors():
    """Every reader of a text checkpoint reaches `layouts.check_stored_shape`; no other module words the refusal."""
    root = Path(__file__).parent.parent.parent / "k3export"
    wording = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if "has wrong shape" in p.read_text()]
    assert wording == ["converters/checkpoints/layouts.py"], wording
