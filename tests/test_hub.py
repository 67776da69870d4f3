"""`k3export push` / `k3export.hub` against a loopback stand-in of the Hub HTTP API (tests/hub_server.py).

huggingface_hub reads HF_ENDPOINT once, at import time; the `hub` fixture therefore patches the derived module
constants (endpoint, URL template, trusted hosts), turns Xet off (the stand-in speaks the LFS protocol), and points
the cache and token file at temporary paths. Nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import importlib.util
import hashlib
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
import typer
from click.testing import CliRunner

from protobuf_wire import _field  # noqa: E402  hand-encoded protobuf for fake ONNX files
from k3export import hub as k3hub
from k3export.errors import K3ExportError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_server import HubStandIn, validate_card_content  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_standin_Secret_7f3a9c"
OTHER_TOKEN = "hf_standin_Other_1b2c3d"


def _cli_app():
    try:
        from k3export_cli.main import app
    except ModuleNotFoundError:  # editable install without the cli/ -> k3export_cli mapping
        spec = importlib.util.spec_from_file_location(
            "k3export_cli", ROOT / "cli" / "__init__.py", submodule_search_locations=[str(ROOT / "cli")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["k3export_cli"] = module
        spec.loader.exec_module(module)
        from k3export_cli.main import app
    return app


def run_cli(*args: str):
    # get_group: the `push` sub-command stays addressable by name even while it is the app's only command
    result = CliRunner().invoke(typer.main.get_group(_cli_app()), list(args))
    assert TOKEN not in result.output and OTHER_TOKEN not in result.output
    # rich wraps long lines at the terminal width: compare messages with whitespace collapsed
    result.text = " ".join(result.output.split())
    return result


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    with HubStandIn({TOKEN: "alice", OTHER_TOKEN: "bob"}) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_URL_HOSTS", frozenset(constants.HF_URL_HOSTS | {"127.0.0.1"}))
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"))
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent-harnesses.json"))
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
        yield server
        assert server.state.unknown == [], f"client called endpoints the stand-in lacks: {server.state.unknown}"


# ------------------------------------------------------------------------------------------------------------------
# Fixtures: artifact folders
# ------------------------------------------------------------------------------------------------------------------


def _validation(passed: bool = True) -> dict:
    """A validation.json as `k3export validate` writes it (`k3export.artifacts.ValidationReport`)."""
    from k3export.artifacts import ScenarioEntry, SummaryRow, ToleranceEntry, ValidationReport

    def row(scenario, tensor, max_abs, rms_rel, cosine, top1, greedy, ok):
        return SummaryRow("onnxruntime", scenario, tensor, tensor, None, max_abs, max_abs, rms_rel, cosine, top1, top1,
                          greedy, ok)

    return ValidationReport(
        passed=passed, created="2026-03-01T12:00:00Z", tool_version="0.1.0", reference="torch",
        runtimes=["onnxruntime"], skipped={}, runtime_descriptions={}, model={}, artifacts={},
        tolerances={"logits": ToleranceEntry(1e-3, 1e-2, 1e-6)}, tolerance_overrides={},
        scenarios=[ScenarioEntry("prefill-32", 1, 32, 0, None, [[1] * 32], []),
                   ScenarioEntry("decode-8", 1, 1, 8, None, [[1]], [])],
        summary=[row("prefill-32", "logits", 1.2e-5, 3.4e-6, 0.9999999, 1.0, None, True),
                 row("decode-8", "recurrent_state", 2.0e-6, 1.0e-6, 1.0, None, 1.0, passed)],
        steps=[], localisation=None).to_json()


def _conversion(folder: Path) -> dict:
    """A conversion.json as `k3export convert` writes it, for the shard in `folder`."""
    from k3export.artifacts import ConversionRecord, ConversionSource, FileDigest

    shard = folder / "model.safetensors"
    return ConversionRecord(
        tool="k3export", tool_version="0.1.0", created="2026-03-01T11:00:00Z",
        source=ConversionSource("Kimi-K3-src", "moonshotai/Kimi-K3", "0123456789abcdef0123456789abcdef01234567",
                                "released", [FileDigest("model-00001-of-00002.safetensors", 1234, "ab" * 32)]),
        options={"dtype": "bfloat16", "experts": "mxfp4->bf16"},
        outputs=[FileDigest("model.safetensors", shard.stat().st_size, "cd" * 32)],
        skipped={"mtp": 1}, plan_fingerprint="f00d").to_json()


def make_checkpoint(folder: Path, *, validation: dict | None = None, conversion: bool = True) -> Path:
    """A small but well-formed converted checkpoint folder (the real model is not needed to push)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "k3", "hidden_size": 8, "vocab_size": 16}))
    save_file({"model.embed_tokens.weight": torch.arange(128, dtype=torch.float32).reshape(16, 8)}, str(folder / "model.safetensors"))
    (folder / "configuration_k3.py").write_bytes((ROOT / "k3export" / "modeling" / "configuration_k3.py").read_bytes())
    (folder / "modeling_k3.py").write_bytes((ROOT / "k3export" / "modeling" / "modeling_k3.py").read_bytes())
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    (folder / "notes.txt").write_text("scratch notes, not part of the artifact\n")
    if conversion:
        (folder / "conversion.json").write_text(json.dumps(_conversion(folder)))
    if validation is not False:
        (folder / "validation.json").write_text(json.dumps(validation if validation is not None else _validation()))
    return folder


def _onnx_model(initializers: list[tuple[str, str, int, int]]) -> bytes:
    """A minimal ModelProto (hand-encoded protobuf) whose initializers live in external data files."""
    tensors = b""
    for name, location, offset, length in initializers:
        entries = b"".join(
            _field(13, _field(1, k.encode()) + _field(2, v.encode()))
            for k, v in (("location", location), ("offset", str(offset)), ("length", str(length)))
        )
        tensors += _field(5, _field(1, 4) + _field(2, 1) + _field(8, name.encode()) + entries + _field(14, 1))
    graph = _field(2, b"k3") + tensors
    return _field(1, 10) + _field(2, b"k3export") + _field(7, graph)


def make_onnx_export(folder: Path, *, validation: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(
        _onnx_model([("w0", "model.onnx.data", 0, 16), ("w1", "model.onnx.data", 16, 16), ("w2", "weights/extra.bin", 0, 16)])
    )
    (folder / "model.onnx.data").write_bytes(struct.pack("<8f", *range(8)))
    (folder / "weights").mkdir(exist_ok=True)
    (folder / "weights" / "extra.bin").write_bytes(struct.pack("<4f", 1, 2, 3, 4))
    (folder / "state_manifest.json").write_text(json.dumps({"states": ["recurrent_state", "conv_state"]}))
    (folder / "runtime_config.json").write_text(json.dumps({"opset": 23}))
    (folder / "export.log").write_text("log\n")
    if validation is None:  # a validation of exactly these files
        validation = _validation()
        validation["artifacts"] = {
            name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in ("model.onnx", "model.onnx.data", "weights/extra.bin", "state_manifest.json",
                         "runtime_config.json")}
    (folder / "validation.json").write_text(json.dumps(validation))
    return folder


# ------------------------------------------------------------------------------------------------------------------
# Detection, validation report, model card (offline)
# ------------------------------------------------------------------------------------------------------------------


def test_detect_checkpoint_lists_artifact_files_only(tmp_path):
    art = k3hub.detect_artifact(make_checkpoint(tmp_path / "ckpt"))
    assert art.kind == k3hub.CHECKPOINT
    assert [f.path_in_repo for f in art.files] == [
        "config.json", "configuration_k3.py", "conversion.json", "generation_config.json", "model.safetensors",
        "modeling_k3.py", "tokenizer_config.json", "validation.json",
    ]
    assert art.skipped == ["notes.txt"]
    assert all(f.size == (tmp_path / "ckpt" / f.path_in_repo).stat().st_size for f in art.files)


def test_detect_onnx_export_follows_external_data(tmp_path):
    art = k3hub.detect_artifact(make_onnx_export(tmp_path / "onnx"))
    assert art.kind == k3hub.ONNX
    assert sorted(f.path_in_repo for f in art.files) == [
        "model.onnx", "model.onnx.data", "runtime_config.json", "state_manifest.json", "validation.json",
        "weights/extra.bin",
    ]
    assert art.skipped == ["export.log"]


def test_onnx_export_with_missing_external_data_is_refused(tmp_path):
    folder = make_onnx_export(tmp_path / "onnx")
    (folder / "weights" / "extra.bin").unlink()
    with pytest.raises(k3hub.HubError, match=r"external data 'weights/extra.bin'"):
        k3hub.detect_artifact(folder)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: (d / "weights.bin").write_bytes(b"x"), "neither a converted K3 checkpoint"),
        (lambda d: (d / "config.json").write_text('{"model_type": "llama"}'), "model_type 'llama'"),
        (lambda d: (d / "config.json").write_text('{"model_type": "k3"}'), "no \\*.safetensors"),
        (lambda d: (d / "model.onnx").write_bytes(b""), "state_manifest.json and runtime_config.json is missing"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    ],
)
def test_other_folders_are_refused(tmp_path, setup, message):
    folder = tmp_path / "other"
    folder.mkdir()
    setup(folder)
    with pytest.raises(k3hub.HubError, match=message):
        k3hub.detect_artifact(folder)


def test_sharded_checkpoint_needs_every_indexed_shard(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(k3hub.HubError, match="model-00002-of-00002.safetensors"):
        k3hub.detect_artifact(folder)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: [1, 2], "JSON object"),
        (lambda d: dict(d, passed="yes"), "field 'passed': expected a boolean"),
        (lambda d: dict(d, summary=[dict(d["summary"][0], max_abs="big")]), r"field 'summary\[0\].max_abs'"),
        (lambda d: dict(d, format_version=7), "field 'format_version': is 7"),
        (lambda d: {k: v for k, v in d.items() if k != "runtimes"}, "field 'runtimes': missing"),
        (lambda d: dict(d, surprise=1), "field 'surprise': unknown field"),
    ],
)
def test_malformed_validation_report_is_a_clear_error(tmp_path, mutate, message):
    (tmp_path / "validation.json").write_text(json.dumps(mutate(_validation())))
    with pytest.raises(K3ExportError, match=message):
        k3hub.load_validation(tmp_path)
    (tmp_path / "validation.json").write_text('{"passed": tru')
    with pytest.raises(K3ExportError, match="validation.json: is not valid JSON"):
        k3hub.load_validation(tmp_path)


def test_validation_report_as_k3export_validate_writes_it(tmp_path):
    report = _validation(passed=False)
    report["summary"][1].update(max_abs="inf", rms_rel="nan", cosine=None)
    report.update(skipped={"tensorrt": "no CUDA device"}, localisation="onnxruntime/decode-8: layer 3 latent, step 2",
                  tolerance_overrides={"logits": {"rms_rel": 0.01}})
    (tmp_path / "validation.json").write_text(json.dumps(report))
    parsed = k3hub.load_validation(tmp_path)
    assert parsed.summary[1].max_abs == float("inf") and parsed.skipped == {"tensorrt": "no CUDA device"}
    make_checkpoint(tmp_path / "ckpt", validation=report)
    card = k3hub.plan_push(tmp_path / "ckpt", "alice/x", force=True).card
    assert "| inf | nan | – |" in card and "Not run: tensorrt (no CUDA device)" in card
    assert "layer 3 latent, step 2" in card and "Tolerance override: logits rms_rel=0.01" in card


def test_conversion_record_is_read_strictly(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt")
    record = json.loads((folder / "conversion.json").read_text())
    record["source"]["path"] = "/models/Kimi-K3-src"  # an absolute local path has no place in the record
    (folder / "conversion.json").write_text(json.dumps(record))
    with pytest.raises(K3ExportError, match=r"conversion.json: field 'source.path': unknown field"):
        k3hub.plan_push(folder, "alice/x")
    (folder / "conversion.json").write_text(json.dumps(_conversion(folder)))
    (folder / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(K3ExportError, match=r"field 'outputs\[0\].bytes'"):
        k3hub.plan_push(folder, "alice/x")


def test_model_card_metadata_provenance_and_table(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# source card\n")
    plan = k3hub.plan_push(folder, "alice/k3-ckpt")
    meta = k3hub.check_model_card(plan.card)
    assert meta["library_name"] == "transformers"
    assert meta["license"] == "mit"
    assert meta["base_model"] == "moonshotai/Kimi-K3"
    assert meta["pipeline_tag"] == "text-generation"
    assert {"k3export", "kimi-k3", "safetensors"} <= set(meta["tags"])
    assert "0123456789abcdef0123456789abcdef01234567" in plan.card  # source revision
    assert "ab" * 32 in plan.card and "cd" * 32 in plan.card  # source + output sha256
    assert "| onnxruntime | prefill-32 | logits | 1.200e-05 | 3.400e-06 | 1 | 1 | – | pass |" in plan.card
    assert "| onnxruntime | decode-8 | recurrent_state |" in plan.card
    assert validate_card_content(plan.card) == []  # huggingface_hub's parser, as the stand-in's validate-yaml


def test_model_card_license_fallbacks(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt")
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# source card\n")
    assert k3hub.check_model_card(k3hub.plan_push(folder, "alice/x").card)["license"] == "apache-2.0"
    (folder / "README.md").unlink()
    meta = k3hub.check_model_card(k3hub.plan_push(folder, "alice/x").card)
    assert meta["license"] == "other" and meta["license_link"] == "https://huggingface.co/moonshotai/Kimi-K3"
    onnx_meta = k3hub.check_model_card(k3hub.plan_push(make_onnx_export(tmp_path / "onnx"), "alice/x").card)
    assert onnx_meta["library_name"] == "onnx" and "onnx" in onnx_meta["tags"]


def test_push_refuses_without_passing_validation(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", validation=False)
    with pytest.raises(k3hub.HubError, match="no validation.json"):
        k3hub.plan_push(folder, "alice/x")
    assert k3hub.plan_push(folder, "alice/x", force=True).warnings[0].startswith("no validation.json")
    (folder / "validation.json").write_text(json.dumps(_validation(passed=False)))
    with pytest.raises(k3hub.HubError, match="decode-8 / recurrent_state"):
        k3hub.plan_push(folder, "alice/x")
    assert "FAILED" in k3hub.plan_push(folder, "alice/x", force=True).card


def test_cli_refusals_are_one_line_exit_2(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", validation=_validation(passed=False))
    result = run_cli("push", str(folder), "alice/x", "--dry-run")
    assert result.exit_code == 2 and "validation failed" in result.text and "Traceback" not in result.output
    result = run_cli("push", str(tmp_path), "alice/x", "--dry-run")
    assert result.exit_code == 2 and "neither a converted K3 checkpoint" in result.text
    result = run_cli("push", str(folder), "not a/valid//id", "--dry-run")
    assert result.exit_code == 2 and "invalid repo id" in result.text


def test_dry_run_prints_files_sizes_card_and_needs_no_token(tmp_path, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    folder = make_onnx_export(tmp_path / "onnx")
    result = run_cli("push", str(folder), "alice/k3-onnx", "--dry-run")
    assert result.exit_code == 0, result.output
    plan = k3hub.plan_push(folder, "alice/k3-onnx")
    for name, size in plan.files:
        assert any(line.split()[:1] == [str(size)] and line.endswith(name) for line in result.output.splitlines()), name
    assert "not uploaded: export.log" in result.output
    assert plan.card.strip().splitlines()[-1] in result.output
    assert "base_model: moonshotai/Kimi-K3" in result.output
    assert hub.state.requests == []  # nothing reached the (stand-in) Hub


# ------------------------------------------------------------------------------------------------------------------
# Push through huggingface_hub to the stand-in
# ------------------------------------------------------------------------------------------------------------------


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


def test_push_onnx_export_to_a_branch(tmp_path, hub):
    folder = make_onnx_export(tmp_path / "onnx")
    result = run_cli("push", str(folder), "alice/k3-onnx", "--revision", "fp32")
    assert result.exit_code == 0, result.output
    remote = hub.files("alice/k3-onnx", "fp32")
    assert sorted(remote) == sorted([f.path_in_repo for f in k3hub.detect_artifact(folder).files] + ["README.md"])
    assert remote["weights/extra.bin"] == (folder / "weights" / "extra.bin").read_bytes()
    assert hub.files("alice/k3-onnx", "main") == {}  # main untouched
    assert hub.is_lfs("alice/k3-onnx", "model.onnx.data", "fp32")


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
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors", "lm_head.weight": "model-extra.safetensors"}}
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


# ------------------------------------------------------------------------------------------------------------------
# Loading back
# ------------------------------------------------------------------------------------------------------------------


def test_snapshot_local_paths_pass_through(tmp_path):
    assert k3hub.snapshot(tmp_path) == tmp_path.resolve()
    assert k3hub.snapshot(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(k3hub.HubError, match="no such folder"):
        k3hub.snapshot("./does/not/exist")
    with pytest.raises(k3hub.HubError, match="invalid repo id"):
        k3hub.snapshot("bad--id/x")


def test_snapshot_pins_revisions(tmp_path, hub):
    folder = make_onnx_export(tmp_path / "onnx")
    v1 = k3hub.push(folder, "alice/k3-onnx")
    old = (folder / "runtime_config.json").read_bytes()
    (folder / "runtime_config.json").write_text(json.dumps({"opset": 24}))
    with pytest.raises(k3hub.HubError, match="changed since"):  # edited after validation: not published as validated
        k3hub.push(folder, "alice/k3-onnx")
    # --force skips the digests, not the reader's checks: this stand-in's runtime_config.json is no export's
    with pytest.raises(K3ExportError, match="runtime_config.json: field 'format'"):
        k3hub.push(folder, "alice/k3-onnx", force=True)
    report = json.loads((folder / "validation.json").read_text())  # validated again after the edit
    report["artifacts"]["runtime_config.json"] = hashlib.sha256((folder / "runtime_config.json").read_bytes()).hexdigest()
    (folder / "validation.json").write_text(json.dumps(report))
    v2 = k3hub.push(folder, "alice/k3-onnx")
    assert v1.commit_oid != v2.commit_oid
    pinned = k3hub.snapshot("alice/k3-onnx", revision=v1.commit_oid)
    latest = k3hub.snapshot("alice/k3-onnx")
    assert pinned.name == v1.commit_oid and latest.name == v2.commit_oid
    assert (pinned / "runtime_config.json").read_bytes() == old
    assert json.loads((latest / "runtime_config.json").read_text()) == {"opset": 24}
    assert (latest / "weights" / "extra.bin").read_bytes() == (folder / "weights" / "extra.bin").read_bytes()
    with pytest.raises(k3hub.HubError, match="revision not found"):
        k3hub.snapshot("alice/k3-onnx", revision="no-such-branch")
    with pytest.raises(k3hub.HubError, match="repository not found"):
        k3hub.snapshot("alice/nothing-here")


def test_from_pretrained_round_trip_identical_logits(tmp_path, hub):
    modeling = pytest.importorskip("k3export.modeling")
    model = modeling.tiny_model(seed=3)
    folder = tmp_path / "k3-tiny"
    modeling.save_pretrained(model, folder, max_shard_size="200KB")  # several shards + index
    (folder / "validation.json").write_text(json.dumps(_validation()))
    art = k3hub.detect_artifact(folder)
    assert sum(f.path_in_repo.endswith(".safetensors") for f in art.files) > 1
    k3hub.push(folder, "alice/k3-tiny")

    ids = torch.tensor([[1, 5, 9, 77, 300, 2, 41, 8]])
    with torch.no_grad():
        expected = model(ids).logits
        from_hub = modeling.K3ForCausalLM.from_pretrained("alice/k3-tiny", cache_dir=str(tmp_path / "tf-cache")).eval()
        from_folder = modeling.K3ForCausalLM.from_pretrained(folder).eval()
        # through the Hub or straight from the folder: the very same model, bit for bit
        assert torch.equal(from_hub(ids).logits, from_folder(ids).logits)
        hub_state, state = from_hub.state_dict(), model.state_dict()
        assert hub_state.keys() == state.keys() and all(torch.equal(hub_state[k], state[k]) for k in state)
        # from_pretrained leaves weights in the safetensors mmap at 16-byte offsets, which sends CPU matmuls down
        # other kernels (~1e-5 on logits); in freshly allocated memory, as the original's, logits are identical
        for p in from_hub.parameters():
            p.data = p.data.clone()
        assert torch.equal(from_hub(ids).logits, expected)
        snap = k3hub.snapshot("alice/k3-tiny")
        assert sorted(p.name for p in snap.iterdir()) == sorted([f.path_in_repo for f in art.files] + ["README.md"])


def test_real_onnx_export_from_a_hub_checkpoint_round_trips(tmp_path, hub):
    """export_onnx("org/name") resolves through `snapshot`; the export pushes and loads back through the Hub."""
    modeling = pytest.importorskip("k3export.modeling")
    onnx = pytest.importorskip("onnx")
    export = pytest.importorskip("k3export.converters.onnx")
    ckpt = tmp_path / "k3-tiny"
    modeling.save_pretrained(modeling.tiny_model(seed=1), ckpt)
    (ckpt / "validation.json").write_text(json.dumps(_validation()))
    k3hub.push(ckpt, "alice/k3-tiny")

    out = tmp_path / "k3-tiny-onnx"
    export.export_onnx("alice/k3-tiny", out, max_shard_bytes=64 * 1024)
    from k3export.artifacts import load_export

    (out / "validation.json").write_text(json.dumps(dict(_validation(), artifacts=load_export(out).file_digests())))
    art = k3hub.detect_artifact(out)
    # the protobuf scan finds exactly the external data files onnx itself reports
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    by_onnx = {
        entry.value
        for t in proto.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }
    assert len(by_onnx) > 1 and by_onnx == {f.path_in_repo for f in art.files if ".data" in f.path_in_repo}
    k3hub.push(out, "alice/k3-tiny-onnx")
    loaded = export.load_export("alice/k3-tiny-onnx")
    assert loaded.manifest.to_json() == json.loads((out / "state_manifest.json").read_text())
    for f in art.files:
        assert (loaded.root / f.path_in_repo).read_bytes() == f.local_path.read_bytes(), f.path_in_repo


def test_a_file_above_the_hubs_limit_is_refused_before_any_upload(tmp_path):
    """A (sparse) data shard above the Hub's 50 GB per-file limit: refused by the plan, in one line naming it."""
    folder = make_onnx_export(tmp_path / "onnx")
    with open(folder / "model.onnx.data", "r+b") as fh:
        fh.truncate(k3hub.HUB_MAX_FILE_BYTES + 1)
    with pytest.raises(k3hub.HubError) as exc:
        k3hub.plan_push(folder, "alice/x", force=True)
    msg = str(exc.value)
    assert "\n" not in msg and "model.onnx.data" in msg and "above the Hub's 50 GB limit" in msg


def test_graph_only_onnx_export_is_publishable_with_a_note(tmp_path):
    folder = make_onnx_export(tmp_path / "onnx")
    (folder / "runtime_config.json").write_text(json.dumps({"weights_materialized": False, "data_files": ["model.onnx.data.00000"]}))
    (folder / "model.onnx.data").unlink()
    art = k3hub.detect_artifact(folder)
    assert "model.onnx.data" not in {f.path_in_repo for f in art.files}
    assert art.notes and "graph-only export" in art.notes[0]


def test_card_usage_snippet_loads_through_remote_code(tmp_path, hub, monkeypatch):
    """The card says AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True): check it does."""
    modeling = pytest.importorskip("k3export.modeling")
    import transformers.dynamic_module_utils as dmu
    from transformers import AutoModelForCausalLM

    modules = tmp_path / "hf-modules"
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(modules))
    monkeypatch.syspath_prepend(str(modules))
    model = modeling.tiny_model(seed=5)
    folder = tmp_path / "k3-remote"
    modeling.save_pretrained(model, folder)
    (folder / "validation.json").write_text(json.dumps(_validation()))
    k3hub.push(folder, "alice/k3-remote")
    assert 'AutoModelForCausalLM.from_pretrained("alice/k3-remote", trust_remote_code=True)' in hub.files("alice/k3-remote")["README.md"].decode()
    loaded = AutoModelForCausalLM.from_pretrained("alice/k3-remote", trust_remote_code=True, cache_dir=str(tmp_path / "c"))
    assert type(loaded).__module__.startswith("transformers_modules")  # the published modeling_k3.py, not k3export's
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    from k3export.ops import use_backend

    with torch.no_grad(), use_backend("torch"):  # k3export's PyTorch functions, as the published file runs them
        for p in loaded.parameters():
            p.data = p.data.clone()
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
