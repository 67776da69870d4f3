"""``convert --experts nvfp4``: the MXFP4 release cast into NVIDIA's NVFP4 layout, nibble for nibble.

Every expectation is computed here from the source's bytes (safetensors library, numpy): k_max over an expert's w1
and w3 (w2 alone), the scale each block must get, which blocks are in range (k_max - k_j <= 17), and the E2M1
grid the out-of-range blocks round onto.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from k3export.converters.checkpoints import convert, make_plan
from k3export.errors import CheckpointError

from nvfp4_ref import e2m1 as _e2m1, e4m3 as _e4m3  # the float64 bit-field decoders

EXPERT = "language_model.model.layers.1.block_sparse_moe.experts"
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(f).items():
            out[name] = t.view(__import__("torch").uint8).numpy() if t.element_size() == 1 else t.double().numpy()
    return out


def _matrices(src: dict[str, np.ndarray]) -> dict[str, int]:
    """Each MXFP4 matrix (stored base name) -> the E8M0 byte of its scale_2 group's k_max."""
    out = {}
    for name in src:
        if name.endswith(".weight_packed"):
            base = name.removesuffix(".weight_packed")
            group = [base] + [base[:-2] + m for a, m in (("w1", "w3"), ("w3", "w1")) if base.endswith(a)]
            out[base] = max(int(src[g + ".weight_scale"].max()) for g in group)
    return out


def _check_cast(src_dir: Path, out_dir: Path, record: dict) -> tuple[int, int]:
    """Check the cast against the source; return (blocks, lossless blocks) counted here."""
    src, out = _tensors(src_dir), _tensors(out_dir)
    blocks = lossless = 0
    for base, kmax in _matrices(src).items():
        packed, e8 = src[base + ".weight_packed"], src[base + ".weight_scale"].astype(np.int64)
        weight, scale = out[base + ".weight"], out[base + ".weight_scale"]
        assert base + ".weight_packed" not in out and weight.shape == packed.shape
        scale_2 = float(out[base + ".weight_scale_2"])
        assert scale_2 == 2.0 ** (kmax - 127 - 8) and float(out[base + ".input_scale"]) == 1.0
        rows, groups = e8.shape
        in_range = (kmax - e8) <= 17
        blocks += 2 * e8.size
        lossless += 2 * int(in_range.sum())
        k = np.repeat(e8 - 127, 2, axis=1)                                    # per NVFP4 block of 16
        got_scale = _e4m3(scale)
        want_scale = np.where(np.repeat(in_range, 2, axis=1), np.exp2(k - (kmax - 127 - 8)), 2.0 ** -9)
        np.testing.assert_array_equal(got_scale, want_scale, err_msg=base)
        for r in range(rows):
            for j in range(groups):
                src_bytes, out_bytes = packed[r, 16 * j:16 * j + 16], weight[r, 16 * j:16 * j + 16]
                if in_range[r, j]:
                    assert bytes(out_bytes) == bytes(src_bytes), (base, r, j)  # byte for byte
                    continue
                exact = _e2m1(np.stack([src_bytes & 15, src_bytes >> 4], -1).reshape(-1)) * 2.0 ** (e8[r, j] - 127)
                step = 2.0 ** -9 * scale_2
                got = _e2m1(np.stack([out_bytes & 15, out_bytes >> 4], -1).reshape(-1)) * step
                nearest = np.abs(np.abs(exact)[:, None] - GRID[None, :] * step).min(-1)
                assert np.all(np.abs(got - exact) <= nearest + 1e-300), (base, r, j)
    assert record["nvfp4_cast"] == {"blocks": blocks, "lossless_blocks": lossless,
                                    "fallback_blocks": blocks - lossless}
    return blocks, lossless


def test_cast_keeps_every_nibble_of_the_release(released_random, tmp_path):
    import torch

    from k3export.modeling import K3ForCausalLM

    record = convert(released_random, tmp_path / "nvfp4", experts="nvfp4")
    blocks, lossless = _check_cast(released_random, tmp_path / "nvfp4", record)
    assert blocks == lossless > 0
    out = tmp_path / "nvfp4"
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "modelopt" and "quantization_config" not in cfg["text_config"]
    assert hf_quant["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert hf_quant["quantization"]["quantized_layers"][EXPERT] == {"quant_algo": "NVFP4", "group_size": 16}
    # every other tensor byte for byte, vision tower included
    src, got = _tensors(released_random), _tensors(out)
    for name, value in src.items():
        if ".experts." not in name:
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    # read back through the NVFP4 layout: the very model the release loads into
    a = dict(K3ForCausalLM.from_pretrained(released_random).named_parameters())
    b = dict(K3ForCausalLM.from_pretrained(out).named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_counts_with_planted_out_of_range_blocks(released_random, tmp_path):
    src = tmp_path / "planted"
    shutil.copytree(released_random, src)
    planted = {  # (matrix, row, group): k_max - k_j (17: still exact; beyond: the amax fallback)
        (f"{EXPERT}.0.w1", 0, 0): 18, (f"{EXPERT}.0.w1", 0, 1): 17, (f"{EXPERT}.0.w3", 3, 1): 30,
        (f"{EXPERT}.1.w2", 2, 0): 20, (f"{EXPERT}.1.w2", 5, 0): 40,
        (f"{EXPERT}.2.w3", 1, 0): -3,  # w3's k_max above w1's: w1 must take the shared scale_2
    }
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(f)
        for (base, r, j), drop in planted.items():
            name = base + ".weight_scale"
            if name in tensors:
                mates = [base[:-2] + m for a, m in (("w1", "w3"), ("w3", "w1")) if base.endswith(a)]
                assert all(m + ".weight_scale" in tensors for m in mates)  # the fixture keeps an expert in one shard
                kmax = max(int(tensors[n].max()) for n in [name, *(m + ".weight_scale" for m in mates)])
                tensors[name][r, j] = kmax - drop
        save_file(tensors, f)
    result = CliRunner().invoke(__import__("cli.main", fromlist=["app"]).app,
                                ["convert", str(src), str(tmp_path / "out"), "--experts", "nvfp4", "--no-progress"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "conversion.json").read_text())
    blocks, lossless = _check_cast(src, tmp_path / "out", record)
    assert blocks - lossless == 2 * 4  # four planted MXFP4 blocks beyond 17, two NVFP4 blocks each
    assert f"{lossless} of {blocks} cast bit-exactly" in " ".join(result.output.split())


def test_cast_refusals(released_random, tmp_path):
    with pytest.raises(CheckpointError, match="drop --text-only"):
        make_plan(released_random, experts="nvfp4", text_only=True)
    with pytest.raises(CheckpointError, match="unknown expert format 'fp8'"):
        make_plan(released_random, experts="fp8")
    plan = make_plan(released_random, experts="nvfp4")
    assert plan.summary()["by_kind"]["expert_mxfp4 -> nvfp4"]["tensors"] == 4 * 3 * 5 * 8


def test_counts_survive_a_resumed_cast(released_random, tmp_path):
    from k3export.converters.checkpoints import ConversionInterrupted

    fresh = convert(released_random, tmp_path / "fresh", experts="nvfp4", max_shard_bytes=100_000)
    n = len(fresh["outputs"])
    with pytest.raises(ConversionInterrupted):  # every unit but the last finished: their counts come from records
        convert(released_random, tmp_path / "out", experts="nvfp4", max_shard_bytes=100_000, stop_after_shards=n - 1)
    resumed = convert(released_random, tmp_path / "out", experts="nvfp4", max_shard_bytes=100_000)
    assert n > 2 and resumed["nvfp4_cast"] == fresh["nvfp4_cast"]
    assert [o["sha256"] for o in resumed["outputs"]] == [o["sha256"] for o in fresh["outputs"]]
