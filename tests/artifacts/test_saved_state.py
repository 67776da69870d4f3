"""The saved state (``.k3state``): a strict safetensors file that belongs to one export, dtype and batch layout."""

import numpy as np
import pytest

from k3export.artifacts import ArtifactError, State, load_export
from k3export.runtime import Target, make_runner, to_numpy


@pytest.fixture(scope="module")
def runner(export_dir):
    return make_runner("ort", Target(onnx_dir=export_dir))


@pytest.fixture(scope="module")
def saved(runner, tmp_path_factory):
    path = tmp_path_factory.mktemp("state") / "p.k3state"
    runner.prefill(np.arange(3, 12)[None]).save(path)
    return path


def test_round_trip_is_exact_and_plain_safetensors(runner, saved):
    from safetensors.numpy import load_file

    state = State.load(saved, runner)
    out = runner.prefill(np.arange(3, 12)[None])
    assert state.tokens.tolist() == [list(range(3, 12))] and state.mask.tolist() == [[1] * 9]
    for s in runner.manifest.states:
        assert np.array_equal(state.tensors[s.name], to_numpy(out.state[s.name], np.float32)), s.name
    assert np.array_equal(state.logits, to_numpy(out.logits[:, -1], np.float32))
    plain = load_file(str(saved))  # any safetensors reader reads it
    assert set(plain) == set(state.tensors) | {"k3state.tokens", "k3state.attention_mask", "k3state.logits"}
    assert state.export_sha256 == load_export(runner.export.root).identity()


def test_state_from_another_export_dtype_or_batch_is_refused(runner, saved, tiny_export_other, tmp_path):
    other_seed, other_dtype = tiny_export_other
    with pytest.raises(ArtifactError, match=r"p.k3state: field 'export_sha256': the state belongs to another export"):
        State.load(saved, other_seed)
    with pytest.raises(ArtifactError, match=r"field 'dtype': the state was saved in float32; .* runs float16"):
        State.load(saved, other_dtype)
    with pytest.raises(ArtifactError, match="holds batch 1, expected 2"):
        State.load(saved, runner, batch=2)
    from k3export.errors import K3ExportError

    with pytest.raises(K3ExportError, match=r"batch 2 does not match the carried state's batch 1"):
        runner.prefill(np.ones((2, 1), np.int64), State.load(saved, runner))


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:len(b) - 5], "truncated"),
    (lambda b: b[:6], "truncated"),
    (lambda b: b[:-4] + bytes(x ^ 1 for x in b[-4:]), "payload_sha256.*changed after it was saved"),
    (lambda b: b.replace(b'"past":"9"', b'"past":"8"'), "payload_sha256|metadata says"),
    (lambda b: b"\xff" * 8 + b[8:], "runs past the file"),
])
def test_truncated_or_tampered_file_is_refused(runner, saved, tmp_path, damage, message):
    bad = tmp_path / "bad.k3state"
    bad.write_bytes(damage(saved.read_bytes()))
    with pytest.raises(ArtifactError, match=message) as info:
        State.load(bad, runner)
    assert "\n" not in str(info.value)


def test_save_is_atomic_and_never_half_written(runner, saved, tmp_path, monkeypatch):
    target = tmp_path / "s.k3state"
    target.write_bytes(b"old")
    state = State.load(saved, runner)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("k3export.safety.os.fsync", boom)
    with pytest.raises(OSError):
        state.save(target)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["s.k3state"]
