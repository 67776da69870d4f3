"""MXFP4 decoding against compressed-tensors, and the validating safetensors reader/writer."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3export.converters.checkpoints.mxfp4 import check_mxfp4_pair, decode_mxfp4, pack_mxfp4, reference_decompress
from k3export.converters.checkpoints.safetensors_io import (
    SafetensorsFile,
    SafetensorsWriter,
    list_shards,
    open_checkpoint,
    write_safetensors,
)
from k3export.errors import CheckpointError


# ---------------------------------------------------------------------- MXFP4
def _every_byte_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """Every packed byte in every column position, against every E8M0 scale byte (0..255)."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)  # [256, 256] -> 512 features
    packed = torch.roll(packed, shifts=1, dims=1).roll(shifts=3, dims=0)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 16)
    return packed, scale


def test_decode_bit_identical_to_compressed_tensors_every_byte_and_scale():
    packed, scale = _every_byte_every_scale()
    ours = decode_mxfp4(packed, scale, torch.bfloat16)
    ref = reference_decompress(packed, scale)
    assert ref.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16))  # signed zeros, inf and NaN bits included
    ours32 = decode_mxfp4(packed, scale, torch.float32)
    assert torch.equal(ours32.view(torch.int32), ref.float().view(torch.int32))


def test_decode_matches_spec_formula():
    """Independent of both implementations: value = (-1)^s * E2M1[m] * 2^(scale-127), low nibble first."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(100, 140, (3, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    ours = decode_mxfp4(packed, scale, torch.float32)
    for r in range(3):
        for j in range(64):
            byte = int(packed[r, j // 2])
            nib = byte & 0xF if j % 2 == 0 else byte >> 4
            value = (-1.0 if nib & 8 else 1.0) * e2m1[nib & 7] * 2.0 ** (int(scale[r, j // 32]) - 127)
            assert float(ours[r, j]) == value


def test_pack_with_compressed_tensors_roundtrip_bound():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 96, generator=gen) * 0.3).to(torch.bfloat16)
    packed, scale = pack_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 48)
    assert scale.dtype == torch.uint8 and scale.shape == (64, 3)
    deq = decode_mxfp4(packed, scale, torch.float32)
    assert torch.equal(deq.to(torch.bfloat16).view(torch.int16), reference_decompress(packed, scale).view(torch.int16))
    # E2M1 steps are at most 2 (between 4 and 6) in scale units, so the error is at most one scale unit
    step = (2.0 ** (scale.float() - 127)).repeat_interleave(32, dim=1)
    assert bool(((deq - w.float()).abs() <= step + 1e-12).all())
    assert float((deq - w.float()).abs().mean()) < 0.05


def test_scales_not_matching_packed_are_named():
    with pytest.raises(CheckpointError, match=r"experts\.3\.w1\.weight_scale.*do not match packed"):
        check_mxfp4_pair("model.layers.1.block_sparse_moe.experts.3.w1", (8, 16), "U8", (8, 2), "U8", where="a.st")
    with pytest.raises(CheckpointError, match="wrong dtype BF16"):
        check_mxfp4_pair("x", (8, 16), "BF16", (8, 1), "U8")
    with pytest.raises(CheckpointError, match="do not match"):
        decode_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


# ---------------------------------------------------------------------- safetensors reading and writing
@pytest.fixture()
def shard(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {"a.weight": torch.randn(4, 8), "b.bias": torch.arange(6, dtype=torch.int32),
               "c": torch.randn(3, 5).to(torch.bfloat16)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def _rewrite_header(path, mutate):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_reader_matches_safetensors_library(shard):
    path, tensors = shard
    f = SafetensorsFile(path)
    assert set(f.tensors) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(f.read(name), t)
    f.close()


def test_writer_output_reads_back_with_safetensors_library(tmp_path):
    tensors = [("z.w", torch.randn(3, 4).to(torch.bfloat16)), ("a.q", torch.randint(0, 255, (5, 2)).to(torch.uint8)),
               ("m.s", torch.tensor(1.5)), ("e", torch.zeros(0, 3))]
    size, digest = write_safetensors(tmp_path / "x.safetensors", tensors)
    assert size == (tmp_path / "x.safetensors").stat().st_size
    import hashlib

    assert digest == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert list(f.keys()) == sorted(n for n, _ in tensors)
        for name, t in tensors:
            assert torch.equal(f.get_tensor(name), t)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_streaming_writer_checks_order_and_cleans_up(tmp_path):
    tensors = [("w", torch.randn(64, 32).to(torch.bfloat16)), ("q", torch.arange(100, dtype=torch.int32).to(torch.uint8))]
    size, digest = write_safetensors(tmp_path / "ref.safetensors", tensors)
    # kick_bytes=1: ask for writeback after every write; the bytes are those of write_safetensors
    w = SafetensorsWriter(tmp_path / "x.safetensors", [("w", "BF16", (64, 32)), ("q", "U8", (100,))], kick_bytes=1)
    for name, t in tensors:
        w.write(name, t)
    assert w.finish() == (size, digest)
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    # a tensor that does not match the announced header is refused; abort leaves nothing
    w = SafetensorsWriter(tmp_path / "y.safetensors", [("w", "BF16", (64, 32))])
    with pytest.raises(RuntimeError, match="does not match the header entry"):
        w.write("w", tensors[0][1].float())
    w.abort()
    # finishing with a tensor missing is refused too, and leaves no file
    w = SafetensorsWriter(tmp_path / "z.safetensors", [("w", "BF16", (64, 32)), ("q", "U8", (100,))])
    w.write("w", tensors[0][1])
    with pytest.raises(RuntimeError, match="'q' was never written"):
        w.finish()
    assert not (tmp_path / "y.safetensors").exists() and not (tmp_path / "z.safetensors").exists()
    assert not list(tmp_path.glob("*.tmp-*"))


def test_truncated_shard(shard):
    path, _ = shard
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|past).*'(a\.weight|b\.bias|c)'"):
        SafetensorsFile(path)
    path.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated shard"):
        SafetensorsFile(path)
    path.write_bytes(raw[:20])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated shard"):
        SafetensorsFile(path)


def test_corrupted_header(shard):
    path, _ = shard
    raw = bytearray(path.read_bytes())
    raw[10:14] = b"\xff\xfe{]"
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted header"):
        SafetensorsFile(path)
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(CheckpointError, match="corrupted header"):
        SafetensorsFile(path)


def test_offsets_past_end_and_wrong_sizes(shard):
    path, _ = shard
    _rewrite_header(path, lambda h: h["c"].update(data_offsets=[h["c"]["data_offsets"][0], 10**9]))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted header: tensor 'c'"):
        SafetensorsFile(path)
    path2 = path.with_name("m2.safetensors")
    save_file({"x": torch.zeros(4), "y": torch.zeros(4)}, str(path2))
    _rewrite_header(path2, lambda h: h["y"].update(shape=[8], data_offsets=[16, 48]))
    with pytest.raises(CheckpointError, match=r"m2\.safetensors: truncated shard or offsets past end: tensor 'y'"):
        SafetensorsFile(path2)
    _rewrite_header(path2, lambda h: h["y"].update(shape=[4], data_offsets=[8, 24]))
    with pytest.raises(CheckpointError, match="overlaps"):
        SafetensorsFile(path2)


def test_index_naming_missing_shard(tmp_path):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names shard 's2\.safetensors'.*tensor 'y'.*missing"):
        list_shards(tmp_path)


def test_index_and_headers_must_agree(tmp_path):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "s1.safetensors", "y": "s1.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"tensor 'y' is in s1\.safetensors.*missing tensor"):
        open_checkpoint(tmp_path)


def test_symlink_escaping_source_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"x": torch.zeros(2)}, str(outside / "evil.safetensors"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").symlink_to(outside / "evil.safetensors")
    with pytest.raises(CheckpointError, match=r"shard 'model\.safetensors' in .*/src resolves to .*/evil\.safetensors: "
                                                r"symlink escapes the source folder"):
        list_shards(src)


def test_hf_cache_snapshot_symlinks_into_blobs_are_allowed(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    save_file({"x": torch.ones(2)}, str(repo / "blobs" / "deadbeef"))
    (snap / "model.safetensors").symlink_to("../../blobs/deadbeef")
    files, _ = list_shards(snap)
    assert files == ["model.safetensors"]


def test_without_an_index_a_stray_shard_beside_model_safetensors_is_named(tmp_path, caplog):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    save_file({"x": torch.ones(2)}, str(tmp_path / "model-extra.safetensors"))
    with caplog.at_level("WARNING", logger="k3export.converters.checkpoints.safetensors_io"):
        files, weight_map = list_shards(tmp_path)
    assert files == ["model.safetensors"] and weight_map is None  # as transformers reads the folder
    assert "model-extra.safetensors not read" in caplog.text and "model.safetensors only" in caplog.text
    caplog.clear()
    (tmp_path / "model-extra.safetensors").unlink()
    list_shards(tmp_path)
    assert caplog.text == ""


def test_pickle_files_are_never_loaded(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pickle-based"):
        list_shards(tmp_path)


def test_writer_records_before_the_rename(tmp_path):
    """`finish(before_rename=...)` sees the final size and sha256 while the file is not yet in place; an error of
    its own keeps its own file name and leaves no shard behind."""
    t = torch.arange(100, dtype=torch.int32).to(torch.uint8)
    size, digest = write_safetensors(tmp_path / "ref.safetensors", [("q", t)])
    seen = []
    w = SafetensorsWriter(tmp_path / "a.safetensors", [("q", "U8", (100,))])
    w.write("q", t)
    assert w.finish(before_rename=lambda n, s: seen.append((n, s, (tmp_path / "a.safetensors").exists()))) == (
        size, digest)
    assert seen == [(size, digest, False)] and (tmp_path / "a.safetensors").is_file()
    record = tmp_path / "missing-dir" / "a.json"
    w = SafetensorsWriter(tmp_path / "b.safetensors", [("q", "U8", (100,))])
    w.write("q", t)
    with pytest.raises(FileNotFoundError) as exc:
        w.finish(before_rename=lambda n, s: record.write_text("{}"))
    assert exc.value.filename == str(record)
    assert not (tmp_path / "b.safetensors").exists() and not list(tmp_path.glob("*.tmp-*"))
