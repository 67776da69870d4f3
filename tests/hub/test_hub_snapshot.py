"""Loading back what was pushed: `k3export.artifacts.snapshot` (re-exported as `k3export.hub.snapshot`) pins a
revision, and a pushed checkpoint or export loads from its Hub id as it does from its folder."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch

from hub_folders import validation_report
from k3export import hub as k3hub
from k3export.errors import K3ExportError


def test_snapshot_local_paths_pass_through(tmp_path):
    assert k3hub.snapshot(tmp_path) == tmp_path.resolve()
    assert k3hub.snapshot(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(k3hub.HubError, match="no such folder"):
        k3hub.snapshot("./does/not/exist")
    with pytest.raises(k3hub.HubError, match="invalid repo id"):
        k3hub.snapshot("bad--id/x")


def test_snapshot_pins_revisions(onnx_export, hub):
    folder = onnx_export
    v1 = k3hub.push(folder, "alice/k3-onnx")
    old = (folder / "runtime_config.json").read_bytes()
    edited = dict(json.loads(old), session_options={"enable_mem_pattern": True})
    (folder / "runtime_config.json").write_text(json.dumps(edited))
    with pytest.raises(k3hub.HubError, match="changed since"):  # edited after validation: not published as validated
        k3hub.push(folder, "alice/k3-onnx")
    # --force skips the digests, not the reader's checks: a runtime_config.json that is no export's is refused
    (folder / "runtime_config.json").write_text(json.dumps({"opset": 24}))
    with pytest.raises(K3ExportError, match="runtime_config.json: field 'format'"):
        k3hub.push(folder, "alice/k3-onnx", force=True)
    (folder / "runtime_config.json").write_text(json.dumps(edited))
    report = json.loads((folder / "validation.json").read_text())  # validated again after the edit
    digest = hashlib.sha256((folder / "runtime_config.json").read_bytes()).hexdigest()
    report["artifacts"]["runtime_config.json"] = digest
    (folder / "validation.json").write_text(json.dumps(report))
    v2 = k3hub.push(folder, "alice/k3-onnx")
    assert v1.commit_oid != v2.commit_oid
    pinned = k3hub.snapshot("alice/k3-onnx", revision=v1.commit_oid)
    latest = k3hub.snapshot("alice/k3-onnx")
    assert pinned.name == v1.commit_oid and latest.name == v2.commit_oid
    assert (pinned / "runtime_config.json").read_bytes() == old
    assert json.loads((latest / "runtime_config.json").read_text()) == edited
    shard = "model.onnx.data.00000"
    assert (latest / shard).read_bytes() == (folder / shard).read_bytes()
    with pytest.raises(k3hub.HubError, match="revision not found"):
        k3hub.snapshot("alice/k3-onnx", revision="no-such-branch")
    with pytest.raises(k3hub.HubError, match="repository not found"):
        k3hub.snapshot("alice/nothing-here")


def test_from_pretrained_round_trip_identical_logits(tmp_path, hub):
    modeling = pytest.importorskip("k3export.modeling")
    model = modeling.tiny_model(seed=3)
    folder = tmp_path / "k3-tiny"
    modeling.save_pretrained(model, folder, max_shard_size="200KB")  # several shards + index
    (folder / "validation.json").write_text(json.dumps(validation_report()))
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
    (ckpt / "validation.json").write_text(json.dumps(validation_report()))
    k3hub.push(ckpt, "alice/k3-tiny")

    out = tmp_path / "k3-tiny-onnx"
    export.export_onnx("alice/k3-tiny", out, max_shard_bytes=64 * 1024)
    from k3export.artifacts import load_export

    report = dict(validation_report(), artifacts=load_export(out).file_digests())
    (out / "validation.json").write_text(json.dumps(report))
    art = k3hub.detect_artifact(out)
    # the files published as external data are exactly those onnx itself reports
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


def test_card_usage_snippet_loads_through_remote_code(tmp_path, hub, monkeypatch, request):
    """The card says AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True): check it does."""
    modeling = pytest.importorskip("k3export.modeling")
    import transformers.dynamic_module_utils as dmu
    from transformers import AutoModelForCausalLM

    modules = tmp_path / "hf-modules"
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(modules))
    monkeypatch.syspath_prepend(str(modules))
    # the `transformers_modules` package imported from here must not outlive the test: later remote-code loads
    # would look for their modules under this folder instead of transformers' own cache
    for name in [n for n in sys.modules if n.split(".")[0] == "transformers_modules"]:
        monkeypatch.delitem(sys.modules, name)
    request.addfinalizer(lambda: [sys.modules.pop(n) for n in list(sys.modules)
                                  if n.split(".")[0] == "transformers_modules"])
    model = modeling.tiny_model(seed=5)
    folder = tmp_path / "k3-remote"
    modeling.save_pretrained(model, folder)
    (folder / "validation.json").write_text(json.dumps(validation_report()))
    k3hub.push(folder, "alice/k3-remote")
    card = hub.files("alice/k3-remote")["README.md"].decode()
    assert 'AutoModelForCausalLM.from_pretrained("alice/k3-remote", trust_remote_code=True)' in card
    loaded = AutoModelForCausalLM.from_pretrained("alice/k3-remote", trust_remote_code=True,
                                                  cache_dir=str(tmp_path / "c"))
    assert type(loaded).__module__.startswith("transformers_modules")  # the published modeling_k3.py, not k3export's
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    from k3export.ops import use_backend

    with torch.no_grad(), use_backend("torch"):  # k3export's PyTorch functions, as the published file runs them
        for p in loaded.parameters():
            p.data = p.data.clone()
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
