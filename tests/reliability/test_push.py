"""`k3export push` of hostile folders, through the real CLI, against the local Hub stand-in (tests/hub_server.py).

The planted token is the only token the stand-in accepts, so a leak would show in the output or a file. A link
leaving the folder, a dangling link, a pipe, or an external-data location outside the folder is refused when it is
part of the artifact, and listed as not uploaded otherwise; what ``--dry-run`` lists is exactly what a push sends.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _harness import SECRET, base_env, check_no_secret, check_refusal, snapshot  # noqa: E402
from hub_server import HubStandIn  # noqa: E402

sys.path.insert(0, str(HERE.parent / "hub"))
from hub_folders import relocate_data  # noqa: E402


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


SHARD = "model.onnx.data.00000"  # the one data shard of the `exported` fixture


def _onnx(exported: Path, folder: Path) -> Path:
    """A copy of a real export (the `exported` fixture), to be made hostile."""
    shutil.copytree(exported, folder)
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


def test_fifo_in_the_artifact_is_refused(cli, exported, tmp_path, hub):
    folder = _onnx(exported, tmp_path / "onnx")
    (folder / SHARD).unlink()
    os.mkfifo(folder / SHARD)
    _refused(cli, tmp_path, hub, folder, (SHARD, "not a regular file"))


@pytest.mark.parametrize("location", ["../outside/id_ed25519", "/etc/passwd", "weights/../../outside/id_ed25519"])
def test_external_data_outside_the_folder_is_refused(cli, exported, tmp_path, hub, location):
    _secret(tmp_path)
    folder = _onnx(exported, tmp_path / "onnx")
    relocate_data(folder, location, move=False)  # one tensor of model.onnx reads the secret
    _refused(cli, tmp_path, hub, folder, (location,))


def test_external_data_linking_out_is_refused(cli, exported, tmp_path, hub):
    folder = _onnx(exported, tmp_path / "onnx")
    _link(folder / SHARD, _secret(tmp_path))
    _refused(cli, tmp_path, hub, folder, (SHARD, "symlink leaving the folder"))


def test_external_data_in_a_subfolder_linking_out_is_refused(cli, exported, tmp_path, hub):
    secret = _secret(tmp_path)
    folder = _onnx(exported, tmp_path / "onnx")
    relocate_data(folder, "weights/extra.bin")  # the data shard in a subfolder, then that folder linked out
    shutil.move(folder / "weights" / "extra.bin", secret.parent / "extra.bin")
    (folder / "weights").rmdir()
    os.symlink(secret.parent, folder / "weights")
    _refused(cli, tmp_path, hub, folder, ("weights/extra.bin", "symlink escapes"))


def test_validation_report_linking_out_is_refused(cli, exported, tmp_path, hub):
    folder = _onnx(exported, tmp_path / "onnx")
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


def test_export_changed_after_validation_is_not_published(cli, exported, tmp_path, hub):
    from k3export.artifacts import ScenarioEntry, SummaryRow, ToleranceEntry, ValidationReport, load_export

    folder = _onnx(exported, tmp_path / "onnx")
    digests = load_export(folder).file_digests()
    row = SummaryRow("onnxruntime", "prefill-4", "logits", "logits", None, 1e-6, 1e-6, 1e-6, 1.0, 1.0, 1.0, None, True)
    report = ValidationReport(
        passed=True, created="2026-03-01T12:00:00Z", tool_version="0.1.0", reference="torch",
        runtimes=["onnxruntime"], skipped={}, runtime_descriptions={}, model={}, artifacts=digests,
        tolerances={"logits": ToleranceEntry(1e-3, 1e-2, 1e-6)}, tolerance_overrides={},
        scenarios=[ScenarioEntry("prefill-4", 1, 4, 0, None, [[1] * 4], [])], summary=[row], steps=[],
        localisation=None)
    (folder / "validation.json").write_text(json.dumps(report.to_json()))
    with open(folder / SHARD, "r+b") as fh:  # edited after validation, same size
        fh.write(b"\x01" * 16)
    run = cli(["push", folder, "alice/k3", "--dry-run"], tmp_path, env=_env(tmp_path, hub), mode="exec")
    check_refusal(run, (SHARD, "changed since"))


@pytest.mark.parametrize("damage", ["data shard cut short", "marked partial"])
def test_force_never_publishes_an_export_no_runtime_would_open(cli, exported, tmp_path, hub, damage):
    """--force skips the validated digests, not the reader's checks: a data shard cut in half, or a folder
    k3export marked partial (a stopped run copied out of its work folder), is refused before any upload."""
    from k3export.safety import EXPORT, PARTIAL, write_marker

    folder = _onnx(exported, tmp_path / "k3-onnx")
    shard = folder / SHARD
    if damage == "data shard cut short":
        with open(shard, "r+b") as fh:
            fh.truncate(shard.stat().st_size // 2)
        expect = ("model.onnx", "past the end of model.onnx.data.00000")
    else:
        write_marker(folder, EXPORT, PARTIAL)
        expect = (str(folder), "marked partial")
    _refused(cli, tmp_path, hub, folder, expect)
