"""`k3export push` of hostile folders, through the real CLI, against the local Hub stand-in (tests/hub_server.py).

The planted token is the only token the stand-in accepts, so a leak would show in the output or a file. A link
leaving the folder, a dangling link, a pipe, or an external-data location outside the folder is refused when it is
part of the artifact, and listed as not uploaded otherwise; what ``--dry-run`` lists is exactly what a push sends.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from protobuf_wire import _field  # noqa: E402
import pytest
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _harness import SECRET, base_env, check_no_secret, check_refusal, snapshot  # noqa: E402
from hub_server import HubStandIn  # noqa: E402



@pytest.fixture
def hub():
    with HubStandIn({SECRET: "alice"}) as server:
        yield server


def _env(tmp: Path, hub) -> dict[str, str]:
    return base_env(tmp, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1")


def _push(cli, tmp: Path, hub, folder: Path, *extra: str):
    return cli(["push", folder, "alice/k3", "--force", *extra], tmp, env=_env(tmp, hub), mode="exec")


def _secret(tmp: Path) -> Path:
    folder = tmp / "outside"
    folder.mkdir(exist_ok=True)
    path = folder / "id_ed25519"
    path.write_text(f"-----BEGIN OPENSSH PRIVATE KEY----- {SECRET} -----END-----\n")
    return path


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "k3", "hidden_size": 8, "vocab_size": 16}))
    save_file({"model.embed_tokens.weight": torch.arange(128, dtype=torch.float32).reshape(16, 8)},
              str(folder / "model.safetensors"))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    return folder


def _onnx(folder: Path, locations: list[str]) -> Path:
    """A minimal export folder: a hand-encoded ModelProto whose initializers live in external data."""
    folder.mkdir(parents=True)
    tensors = b""
    for i, loc in enumerate(locations):
        entries = b"".join(_field(13, _field(1, k.encode()) + _field(2, v.encode()))
                           for k, v in (("location", loc), ("offset", "0"), ("length", "16")))
        tensors += _field(5, _field(1, 4) + _field(2, 1) + _field(8, f"w{i}".encode()) + entries + _field(14, 1))
    (folder / "model.onnx").write_bytes(_field(1, 10) + _field(2, b"k3export") + _field(7, _field(2, b"k3") + tensors))
    (folder / "model.onnx.data").write_bytes(bytes(16))
    (folder / "state_manifest.json").write_text(json.dumps({"states": []}))
    (folder / "runtime_config.json").write_text(json.dumps({"opset": 27}))
    return folder


def _link(path: Path, target: Path) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    os.symlink(target, path)


def _uploaded(hub) -> dict[str, bytes]:
    return hub.files("alice/k3") if "alice/k3" in hub.state.repos else {}


def _refused(cli, tmp, hub, folder, expect):
    before = snapshot(folder)
    run = _push(cli, tmp, hub, folder)
    check_refusal(run, expect)
    assert hub.state.uploads == [] and "alice/k3" not in hub.state.repos, "something reached the Hub"
    assert snapshot(folder) == before
    check_no_secret(run, tmp, allowed=[tmp / "outside" / "id_ed25519"])
    return run


def test_artifact_file_linking_to_a_private_key_is_refused(cli, tmp_path, hub):
    folder = _checkpoint(tmp_path / "ckpt")
    _link(folder / "tokenizer.json", _secret(tmp_path))
    _refused(cli, tmp_path, hub, folder, ("tokenizer.json", "symlink leaving the folder"))


def test_config_linking_out_is_refused(cli, tmp_path, hub):
    folder = _checkpoint(tmp_path / "ckpt")
    outside = tmp_path / "outside" / "config.json"
    outside.parent.mkdir()
    outside.write_bytes((folder / "config.json").read_bytes())
    _link(folder / "config.json", outside)
    _refused(cli, tmp_path, hub, folder, ("config.json", "symlink leaving the folder"))


def test_dangling_weights_link_is_refused(cli, tmp_path, hub):
    folder = _checkpoint(tmp_path / "ckpt")
    _link(folder / "model-00002-of-00002.safetensors", tmp_path / "gone.safetensors")
    _refused(cli, tmp_path, hub, folder, ("model-00002-of-00002.safetensors", "dangling"))


def test_fifo_in_the_artifact_is_refused(cli, tmp_path, hub):
    folder = _onnx(tmp_path / "onnx", ["model.onnx.data"])
    (folder / "model.onnx.data").unlink()
    os.mkfifo(folder / "model.onnx.data")
    _refused(cli, tmp_path, hub, folder, ("model.onnx.data", "not a regular file"))


@pytest.mark.parametrize("location", ["../outside/id_ed25519", "/etc/passwd", "weights/../../outside/id_ed25519"])
def test_external_data_outside_the_folder_is_refused(cli, tmp_path, hub, location):
    _secret(tmp_path)
    folder = _onnx(tmp_path / "onnx", ["model.onnx.data", location])
    _refused(cli, tmp_path, hub, folder, (location,))


def test_external_data_linking_out_is_refused(cli, tmp_path, hub):
    folder = _onnx(tmp_path / "onnx", ["model.onnx.data"])
    _link(folder / "model.onnx.data", _secret(tmp_path))
    _refused(cli, tmp_path, hub, folder, ("model.onnx.data", "symlink leaving the folder"))


def test_external_data_in_a_subfolder_linking_out_is_refused(cli, tmp_path, hub):
    secret = _secret(tmp_path)
    (secret.parent / "extra.bin").write_bytes(bytes(16))
    folder = _onnx(tmp_path / "onnx", ["model.onnx.data", "weights/extra.bin"])
    os.symlink(secret.parent, folder / "weights")
    _refused(cli, tmp_path, hub, folder, ("weights/extra.bin", "symlink escapes"))


def test_validation_report_linking_out_is_refused(cli, tmp_path, hub):
    folder = _onnx(tmp_path / "onnx", ["model.onnx.data"])
    _link(folder / "validation.json", _secret(tmp_path))
    _refused(cli, tmp_path, hub, folder, ("validation.json", "symlink leaving the folder"))


def test_dry_run_lists_exactly_what_the_push_sends(cli, tmp_path, hub):
    """A link to a secret under a name that is not part of the artifact: listed as not uploaded, never sent."""
    folder = _checkpoint(tmp_path / "ckpt")
    secret = _secret(tmp_path)
    _link(folder / "notes.txt", secret)
    (folder / "real-notes.txt").write_text("scratch\n")
    before = snapshot(folder)
    dry = _push(cli, tmp_path, hub, folder, "--dry-run")
    assert dry.code == 0, str(dry)
    assert hub.state.requests == []
    assert "not uploaded: notes.txt (symlink leaving the folder" in dry.stdout
    listed = [line.split()[-1] for line in dry.stdout.splitlines()
              if line.split()[:1] and line.split()[0].isdigit() and not line.rstrip().endswith("files)")]
    run = _push(cli, tmp_path, hub, folder)
    assert run.code == 0, str(run)
    sent = _uploaded(hub)
    assert sorted(sent) == sorted(listed), (sorted(sent), sorted(listed))
    assert "notes.txt" not in sent
    assert all(secret.read_bytes() not in data and SECRET.encode() not in data for data in sent.values())
    for name, data in sent.items():
        if name != "README.md":
            assert data == (folder / name).read_bytes(), name
    assert snapshot(folder) == before
    check_no_secret(dry, tmp_path, allowed=[secret])
    check_no_secret(run, tmp_path, allowed=[secret])


def test_rejected_token_is_one_line_without_the_token(cli, tmp_path):
    folder = _checkpoint(tmp_path / "ckpt")
    with HubStandIn({"hf_someoneElsesToken123": "bob"}) as other:
        run = _push(cli, tmp_path, other, folder)
    check_refusal(run, ("alice/k3",))
    check_no_secret(run, tmp_path)


def test_export_changed_after_validation_is_not_published(cli, tmp_path, hub):
    from k3export.artifacts import ScenarioEntry, SummaryRow, ToleranceEntry, ValidationReport

    folder = _onnx(tmp_path / "onnx", ["model.onnx.data"])
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    row = SummaryRow("onnxruntime", "prefill-4", "logits", "logits", None, 1e-6, 1e-6, 1e-6, 1.0, 1.0, 1.0, None, True)
    report = ValidationReport(
        passed=True, created="2026-03-01T12:00:00Z", tool_version="0.1.0", reference="torch",
        runtimes=["onnxruntime"], skipped={}, runtime_descriptions={}, model={}, artifacts=digests,
        tolerances={"logits": ToleranceEntry(1e-3, 1e-2, 1e-6)}, tolerance_overrides={},
        scenarios=[ScenarioEntry("prefill-4", 1, 4, 0, None, [[1] * 4], [])], summary=[row], steps=[],
        localisation=None)
    (folder / "validation.json").write_text(json.dumps(report.to_json()))
    (folder / "model.onnx.data").write_bytes(b"\x01" * 16)  # edited after validation, same size
    run = cli(["push", folder, "alice/k3", "--dry-run"], tmp_path, env=_env(tmp_path, hub), mode="exec")
    check_refusal(run, ("model.onnx.data",))


@pytest.mark.parametrize("damage", ["data shard cut short", "marked partial"])
def test_force_never_publishes_an_export_no_runtime_would_open(cli, exported, tmp_path, hub, damage):
    """--force skips the validated digests, not the reader's checks: a data shard cut in half, or a folder
    k3export marked partial (a stopped run copied out of its work folder), is refused before any upload."""
    import shutil

    from k3export.safety import EXPORT, PARTIAL, write_marker

    folder = tmp_path / "k3-onnx"
    shutil.copytree(exported, folder)
    shard = folder / "model.onnx.data.00000"
    if damage == "data shard cut short":
        with open(shard, "r+b") as fh:
            fh.truncate(shard.stat().st_size // 2)
        expect = ("model.onnx", "past the end of model.onnx.data.00000")
    else:
        write_marker(folder, EXPORT, PARTIAL)
        expect = (str(folder), "marked partial")
    _refused(cli, tmp_path, hub, folder, expect)
