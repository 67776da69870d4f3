"""`k3export.hub.push` / ``k3export push`` through huggingface_hub to the loopback stand-in of the Hub: the exact
files in one commit, resumed uploads, tokens and network failures."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hub_folders import OTHER_TOKEN, TOKEN, make_checkpoint, make_onnx_export, run_cli
from k3export import hub as k3hub
from k3export.errors import K3ExportError


def test_push_checkpoint_exact_files_message_and_card(tmp_path, hub):
    folder = make_checkpoint(tmp_path / "ckpt")
    result = run_cli("push", str(folder), "alice/k3-ckpt", "--commit-message", "K3 tiny, bf16", "--private")
    assert result.exit_code == 0, result.output
    remote = hub.files("alice/k3-ckpt")
    art = k3hub.detect_artifact(folder)
    expected = {f.path_in_repo: f.local_path.read_bytes() for f in art.files}
    card = remote.pop("README.md").decode()
    assert remote == expected  # exact set of files, byte for byte; notes.txt stayed home
    assert card == k3hub.plan_push(folder, "alice/k3-ckpt").card
    assert hub.is_lfs("alice/k3-ckpt", "model.safetensors") and not hub.is_lfs("alice/k3-ckpt", "config.json")
    assert [c.message for c in hub.state.commit_log] == ["K3 tiny, bf16"]  # one commit
    assert hub.state.repos["alice/k3-ckpt"].private
    # the library validated the card's metadata through /api/validate-yaml before uploading
    assert [c["errors"] for c in hub.state.yaml_checks] == [[]]
    # and RepoCard.validate (network-bound) accepts it against the stand-in too
    from huggingface_hub import ModelCard

    ModelCard(card).validate()
    assert not (folder / "README.md").exists()  # the card is never written into the local folder


def test_second_push_of_unchanged_files_uploads_nothing(tmp_path, hub):
    folder = make_checkpoint(tmp_path / "ckpt")
    first = k3hub.push(folder, "alice/k3-ckpt")
    uploads, commits = len(hub.state.uploads), len(hub.state.commit_log)
    assert uploads == len(k3hub.detect_artifact(folder).files) + 1  # every file once, README included
    second = k3hub.push(folder, "alice/k3-ckpt")
    assert len(hub.state.uploads) == uploads and len(hub.state.commit_log) == commits
    assert second.commit_oid == first.commit_oid
    # one changed file -> only that file travels
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 3}))
    k3hub.push(folder, "alice/k3-ckpt", commit_message="new eos")
    new = hub.state.uploads[uploads:]
    assert [(u.kind, u.path) for u in new] == [("regular", "generation_config.json")]
    assert hub.state.commit_log[-1].message == "new eos"


def test_push_onnx_export_to_a_branch(tiny_export, tmp_path, hub):
    folder = make_onnx_export(tiny_export, tmp_path / "onnx", data_in="weights/model.onnx.data.00000")
    result = run_cli("push", str(folder), "alice/k3-onnx", "--revision", "fp32")
    assert result.exit_code == 0, result.output
    remote = hub.files("alice/k3-onnx", "fp32")
    assert sorted(remote) == sorted([f.path_in_repo for f in k3hub.detect_artifact(folder).files] + ["README.md"])
    shard = "weights/model.onnx.data.00000"  # external data in a subfolder keeps its path
    assert remote[shard] == (folder / shard).read_bytes()
    assert hub.files("alice/k3-onnx", "main") == {}  # main untouched
    assert hub.is_lfs("alice/k3-onnx", shard, "fp32")


def test_missing_and_rejected_tokens(tmp_path, hub, monkeypatch):
    folder = make_checkpoint(tmp_path / "ckpt")
    monkeypatch.delenv("HF_TOKEN")
    result = run_cli("push", str(folder), "alice/k3-ckpt")
    assert result.exit_code == 2 and "no Hugging Face token" in result.text and "HF_TOKEN" in result.text
    assert hub.state.requests == []
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_known_token")
    result = run_cli("push", str(folder), "alice/k3-ckpt")
    assert result.exit_code == 2 and "refused the token" in result.text
    assert "hf_not_a_known_token" not in result.output
    monkeypatch.setenv("HF_TOKEN", OTHER_TOKEN)  # bob cannot create repos under alice
    result = run_cli("push", str(folder), "alice/k3-ckpt")
    assert result.exit_code == 2 and "HTTP 403" in result.text


def test_repo_id_without_namespace_goes_to_the_token_owner(tmp_path, hub):
    result = k3hub.push(make_checkpoint(tmp_path / "ckpt"), "k3-mine")
    assert result.repo_id == "alice/k3-mine" and "README.md" in hub.files("alice/k3-mine")


def test_network_failure_mid_upload_then_retry_resumes(tmp_path, hub):
    folder = make_checkpoint(tmp_path / "ckpt")
    (folder / "model-extra.safetensors").write_bytes(b"")  # placeholder replaced below by a real shard
    save_file({"lm_head.weight": torch.ones(16, 8)}, str(folder / "model-extra.safetensors"))
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, str(folder / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors",
                                        "lm_head.weight": "model-extra.safetensors"}}
    ))
    hub.state.drop_once = {"commit"}  # both LFS blobs arrive, then the connection dies on the commit
    result = run_cli("push", str(folder), "alice/k3-ckpt")
    assert result.exit_code == 2, result.output
    assert "network failure" in result.text and "run the same command again to resume" in result.text
    assert result.output.count("error:") == 1 and "Traceback" not in result.output
    assert hub.state.dropped == ["commit"] and hub.files("alice/k3-ckpt") == {}
    lfs_before = [u.oid for u in hub.state.uploads if u.kind == "lfs"]
    assert len(lfs_before) == 2
    result = run_cli("push", str(folder), "alice/k3-ckpt")
    assert result.exit_code == 0, result.output
    assert [u.oid for u in hub.state.uploads if u.kind == "lfs"] == lfs_before  # blobs not sent again
    expected = {f.path_in_repo: f.local_path.read_bytes() for f in k3hub.detect_artifact(folder).files}
    remote = hub.files("alice/k3-ckpt")
    remote.pop("README.md")
    assert remote == expected


def test_dropped_lfs_upload_is_retried_by_the_library(tmp_path, hub):
    folder = make_checkpoint(tmp_path / "ckpt")
    hub.state.drop_once = {"lfs-put"}
    k3hub.push(folder, "alice/k3-ckpt")
    assert hub.state.dropped == ["lfs-put"]
    assert hub.files("alice/k3-ckpt")["model.safetensors"] == (folder / "model.safetensors").read_bytes()


def test_unreachable_hub_is_a_clear_error(tmp_path, hub, monkeypatch):
    from huggingface_hub import constants

    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    with pytest.raises(k3hub.HubError, match="network failure") as info:
        k3hub.push(make_checkpoint(tmp_path / "ckpt"), "alice/k3-ckpt")
    assert isinstance(info.value, K3ExportError) and TOKEN not in str(info.value)
