"""Every artifact file type: a write-then-read round trip is the identity, and every malformation is refused with
one line naming the file and the field."""

import copy
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from k3export.artifacts import (
    ArtifactError, ConversionRecord, ConversionSource, EngineNode, EngineProfile, EngineSidecar, FileDigest,
    ResumeRecord, RunEntry, RuntimeConfig, ScenarioEntry, ShardRecord, StagePlanFile, StateManifest, StepRow,
    SummaryRow, ToleranceEntry, ValidationReport,
)
from k3export.modeling import K3Config

SHA = "ab" * 32


def manifest() -> StateManifest:
    return StateManifest.from_config(K3Config.tiny(), "bf16", debug_outputs=True)


def runtime_config() -> RuntimeConfig:
    return RuntimeConfig(model_file="model.onnx", data_files=["model.onnx.data.00000"], weights_materialized=True,
                         weight_bytes=16, opset=27,
                         config=RuntimeConfig.config_json(K3Config.tiny()))


def report() -> ValidationReport:
    return ValidationReport(
        passed=False, created="2026-03-01T12:00:00+00:00", tool_version="0.1.0", reference="torch",
        runtimes=["ort"], skipped={"trt": "no TensorRT here"}, runtime_descriptions={"ort": "onnxruntime CPU"},
        model={"model_dir": "tiny", "seed": 0}, artifacts={"model.onnx": SHA},
        tolerances={"logits": ToleranceEntry(1e-3, 1e-2, 1e-6)}, tolerance_overrides={"logits": {"rms_rel": 1e-3}},
        scenarios=[ScenarioEntry("decode", 1, 2, 1, None, [[5, 6]],
                                 [RunEntry("ort", False, 1, 0.5, 1.0, None, "layer 3")])],
        summary=[SummaryRow("ort", "decode", "logits", "logits", None, float("inf"), 0.5, 0.1, 0.99, 1.0, 1.0, 1.0,
                            False)],
        steps=[StepRow("ort", "decode", 0, 1, "logits", "logits", None, 0.1, 0.2, 0.05, 0.999, 3.0, True, 1.0, 1.0,
                       0, True, "")],
        localisation="ort/decode: first divergence: layer 3 (kda) conv_state")


def record() -> ConversionRecord:
    return ConversionRecord(
        tool="k3export", tool_version="0.1.0", created="2026-03-01T11:00:00+00:00",
        source=ConversionSource("Kimi-K3-src", "moonshotai/Kimi-K3", "0123abcd", "released",
                                [FileDigest("model-00001-of-00002.safetensors", 1234, SHA)]),
        options={"dtype": "bf16", "keep_mxfp4": False, "workers": 1}, outputs=[FileDigest("model.safetensors", 4, SHA)],
        skipped={"mtp": 3}, plan_fingerprint="f00d")


def stage_plan() -> StagePlanFile:
    return StagePlanFile([(0, 3), (3, 6)])


def engine_sidecar() -> EngineSidecar:
    shapes = {"input_ids": ([1, 1], [1, 128], [1, 256])}
    return EngineSidecar(
        onnx="/exports/tiny/model.onnx", precision="bf16", dtype="bfloat16", tensorrt_flavour="tensorrt",
        tensorrt_version="10.13.0", gpu="NVIDIA H100", compute_capability=(9, 0), prefer_aot=True,
        profiles=[EngineProfile("prefill", {"max_batch": 1, "max_seq": 256, "max_context": 1024}, shapes)],
        k3_nodes=[EngineNode(4, "layer0/kda", "kda")], target_compute_capability=(12, 0),
        plugins=["k3::kda"], network_layers=412)


def resume_record() -> ResumeRecord:
    return ResumeRecord("f00d", "e1" * 16)


def shard_record() -> ShardRecord:
    return ShardRecord("f00d", 4096, SHA)


def _write_outputs(folder: Path, doc) -> None:
    if isinstance(doc, ConversionRecord):
        (folder / "model.safetensors").write_bytes(b"\0" * 4)
    if isinstance(doc, RuntimeConfig):
        (folder / "model.onnx").write_bytes(b"")
        (folder / "model.onnx.data.00000").write_bytes(b"\0" * 16)


DOCS = {"manifest": manifest, "runtime_config": runtime_config, "report": report, "record": record,
        "stage_plan": stage_plan, "engine_sidecar": engine_sidecar, "resume_record": resume_record,
        "shard_record": shard_record}
#: a hand-written stage plan may leave out format and format_version
HEADER_OPTIONAL = (stage_plan,)


@pytest.mark.parametrize("make", DOCS.values(), ids=DOCS.keys())
def test_write_then_read_is_the_identity(make, tmp_path):
    doc = make()
    _write_outputs(tmp_path, doc)
    path = doc.write(tmp_path)
    assert path == tmp_path / doc.FILE
    back = type(doc).read(tmp_path)
    assert back == doc
    assert back.to_json() == json.loads(path.read_text())
    assert json.loads(path.read_text())["format_version"] == 1


def _refused(make, tmp_path, mutate, *words: str) -> str:
    doc = make()
    _write_outputs(tmp_path, doc)
    data = doc.to_json()
    mutate(data)
    (tmp_path / doc.FILE).write_text(json.dumps(data))
    with pytest.raises(ArtifactError) as info:
        type(doc).read(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path / doc.FILE) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


COMMON = [
    (lambda d: d.update(format_version=2), ("'format_version'", "version 1")),
    (lambda d: d.pop("format_version"), ("'format_version'", "missing")),
    (lambda d: d.update(format="k3export.something_else"), ("'format'",)),
    (lambda d: d.update(surprise=1), ("'surprise'", "unknown field")),
]


@pytest.mark.parametrize("make", DOCS.values(), ids=DOCS.keys())
@pytest.mark.parametrize("mutate, words", COMMON, ids=["version", "no-version", "format", "unknown-field"])
def test_header_and_unknown_fields_are_refused(make, mutate, words, tmp_path):
    if make in HEADER_OPTIONAL and "missing" in words:
        data = make().to_json()
        mutate(data)
        assert type(make()).from_json(data) == make()
        return
    _refused(make, tmp_path, mutate, *words)


@pytest.mark.parametrize("make", DOCS.values(), ids=DOCS.keys())
def test_every_missing_field_is_named(make, tmp_path):
    optional = {f.name for f in dataclasses.fields(make()) if f.default_factory is not dataclasses.MISSING
                or f.default is not dataclasses.MISSING}
    for key in list(make().to_json())[2:]:
        if key not in optional:
            _refused(make, tmp_path, lambda d, k=key: d.pop(k), f"'{key}'", "missing")


def test_runtime_config_session_options(tmp_path):
    """Optional (files written before it read as none) and checked: attribute names and scalar values."""
    data = runtime_config().to_json()
    data.pop("session_options")
    assert RuntimeConfig.from_json(data).session_options == {}
    for bad in ({"__class__": 1}, {"enable mem pattern": False}, {"enable_mem_pattern": [False]}):
        with pytest.raises(ArtifactError, match="session_options"):
            RuntimeConfig.from_json(dict(data, session_options=bad))


CASES = {
    "manifest": [
        (lambda d: d["states"][0].update(layer="0"), "'states[0].layer'", "expected an integer"),
        (lambda d: d["states"][0].update(past_len=0), "'states[0].past_len'", "unknown field"),
        (lambda d: d["states"][0].pop("present"), "'states[0].present'", "missing"),
        (lambda d: d["states"][0].update(present="present.0.other"), "'states[0].present'"),
        (lambda d: d["states"][4].update(shape=["batch", 1, "past_len", 20]), "'states[4].shape[2]'", "past_len"),
        (lambda d: d["states"][0].update(shape=["batch", 10**12, 3]), "'states[0].shape[1]'", "outside"),
        (lambda d: d["states"][0].update(shape=["batch", 1e12, 3]), "'states[0].shape[1]'", "expected"),
        (lambda d: d["states"][0].update(dtype="bf16"), "'states[0].dtype'", "canonical"),
        (lambda d: d["states"][0].update(kind="latent"), "'states[0].kind'"),
        (lambda d: d.update(dtype="int8"), "'dtype'"),
        (lambda d: d["inputs"].append(dict(d["inputs"][0])), "'inputs[2].name'", "twice"),
        (lambda d: d.update(layers=[0]), "'layers'", "2 items"),
    ],
    "runtime_config": [
        (lambda d: d.update(model_file="/etc/passwd"), "'model_file'", "absolute"),
        (lambda d: d.update(model_file="../model.onnx"), "'model_file'", "leaves the folder"),
        (lambda d: d.update(data_files=["../../etc/passwd"]), "'data_files[0]'", "leaves the folder"),
        (lambda d: d.update(data_files=["model.onnx.data.00001"]), "'data_files[0]'", "missing"),
        (lambda d: d.update(weights_materialized="yes"), "'weights_materialized'", "boolean"),
        (lambda d: d.update(opset=27.0), "'opset'", "integer"),
        (lambda d: d.update(weight_bytes=-1), "'weight_bytes'", "negative"),
        (lambda d: d.update(config=[1]), "'config'", "object"),
    ],
    "report": [
        (lambda d: d.update(passed="yes"), "'passed'", "boolean"),
        (lambda d: d["summary"][0].update(max_abs="big"), "'summary[0].max_abs'"),
        (lambda d: d["steps"][0].pop("reason"), "'steps[0].reason'", "missing"),
        (lambda d: d["scenarios"][0]["results"][0].update(seconds=None), "'scenarios[0].results[0].seconds'"),
        (lambda d: d.update(artifacts={"/etc/passwd": SHA}), "'artifacts./etc/passwd'", "absolute"),
        (lambda d: d.update(artifacts={"../x": SHA}), "'artifacts.../x'", "leaves the folder"),
        (lambda d: d.update(artifacts={"model.onnx": "nothex"}), "'artifacts.model.onnx'", "sha256"),
        (lambda d: d.update(passed=True), "'passed'", "summary row failed"),
        (lambda d: d["model"].update(nested={"a": 1}), "'model.nested'"),
    ],
    "record": [
        (lambda d: d["outputs"][0].update(name="../model.safetensors"), "'outputs[0].name'", "leaves the folder"),
        (lambda d: d["outputs"][0].update(name="/abs/model.safetensors"), "'outputs[0].name'", "absolute"),
        (lambda d: d["outputs"].append(dict(d["outputs"][0], name="model-2.safetensors")), "'outputs[1].name'",
         "missing"),
        (lambda d: d["outputs"][0].update(bytes=5), "'outputs[0].bytes'", "the record says 5"),
        (lambda d: d["source"].update(path="/models/src"), "'source.path'", "unknown field"),
        (lambda d: d["source"]["files"][0].update(sha256="AB" * 32), "'source.files[0].sha256'"),
        (lambda d: d.update(skipped={"mtp": "3"}), "'skipped.mtp'", "integer"),
    ],
    "stage_plan": [
        (lambda d: d.update(stages=[[0, "3"]]), "'stages[0][1]'", "integer"),
        (lambda d: d.update(stages=[[0, 3, 6]]), "'stages[0]'", "2 items"),
        (lambda d: d.update(stages=[[-1, 3]]), "'stages[0]'", "negative"),
        (lambda d: d.update(stages={"0": [0, 6]}), "'stages'", "list"),
    ],
    "engine_sidecar": [
        (lambda d: d.update(tensorrt_flavour="onnxruntime"), "'tensorrt_flavour'", "'tensorrt_rtx'"),
        (lambda d: d.update(compute_capability=[9]), "'compute_capability'", "2 items"),
        (lambda d: d.update(compute_capability=[9, -1]), "'compute_capability'", "not a compute capability"),
        (lambda d: d.update(target_compute_capability="sm_120"), "'target_compute_capability'"),
        (lambda d: d["profiles"][0]["shapes"].update(input_ids=[[1, 1], [1, 128]]), "'profiles[0].shapes.input_ids'",
         "3 items"),
        (lambda d: d["profiles"][0]["limits"].update(max_seq="256"), "'profiles[0].limits.max_seq'", "integer"),
        (lambda d: d["k3_nodes"][0].pop("op"), "'k3_nodes[0].op'", "missing"),
        (lambda d: d.update(network_layers=-1), "'network_layers'", "negative"),
        (lambda d: d.update(plugins="k3::kda"), "'plugins'", "list"),
    ],
    "resume_record": [
        (lambda d: d.update(key=7), "'key'", "string"),
        (lambda d: d.update(export_id=[]), "'export_id'"),
    ],
    "shard_record": [
        (lambda d: d.update(bytes=-1), "'bytes'", "negative"),
        (lambda d: d.update(sha256="AB" * 32), "'sha256'", "sha256"),
        (lambda d: d.update(sha256=None), "'sha256'", "string"),
    ],
}


@pytest.mark.parametrize("kind, case", [(k, c) for k, cases in CASES.items() for c in cases],
                         ids=[f"{k}-{i}" for k, cases in CASES.items() for i in range(len(cases))])
def test_malformed_fields_are_named(kind, case, tmp_path):
    mutate, *words = case
    _refused(DOCS[kind], tmp_path, mutate, *words)


@pytest.mark.parametrize("make", DOCS.values(), ids=DOCS.keys())
@pytest.mark.parametrize("content, word", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"format": NaN}', "NaN"),
    ('{"format": 1' + "0" * 5000 + "}", "not valid JSON"),
    ('{"format": tru', "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (b"\xff\xfe", "UTF-8"),
])
def test_broken_json_is_one_line(make, content, word, tmp_path):
    doc = make()
    path = tmp_path / doc.FILE
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ArtifactError, match=word) as info:
        type(doc).read(tmp_path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("make", DOCS.values(), ids=DOCS.keys())
def test_links_leaving_the_folder_and_special_files_are_refused(make, tmp_path):
    doc = make()
    outside = tmp_path / "outside"
    outside.mkdir()
    doc.write(outside)
    folder = tmp_path / "folder"
    folder.mkdir()
    _write_outputs(folder, doc)
    os.symlink(outside / doc.FILE, folder / doc.FILE)
    with pytest.raises(ArtifactError, match="symlink escapes the folder"):
        type(doc).read(folder)
    (folder / doc.FILE).unlink()
    os.mkfifo(folder / doc.FILE)
    with pytest.raises(ArtifactError, match="not a regular file"):
        type(doc).read(folder)
    (folder / doc.FILE).unlink()
    os.symlink("missing-target", folder / doc.FILE)
    with pytest.raises(ArtifactError, match="missing"):
        type(doc).read_if_present(folder)
    (folder / doc.FILE).unlink()
    assert type(doc).read_if_present(folder) is None


def test_a_link_inside_the_folder_is_followed(tmp_path):
    doc = report()
    doc.write(tmp_path, "real.json")
    os.symlink("real.json", tmp_path / doc.FILE)
    assert ValidationReport.read(tmp_path) == doc


def test_writes_never_go_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "export"
    folder.mkdir()
    os.symlink(victim, folder / ValidationReport.FILE)
    report().write(folder)
    assert victim.read_text() == "precious"
    assert not (folder / ValidationReport.FILE).is_symlink()
    assert ValidationReport.read(folder) == report()
    assert [p.name for p in folder.iterdir()] == [ValidationReport.FILE]  # no temporary left behind


def test_manifest_checked_against_the_config():
    config = K3Config.tiny()
    m = manifest()
    m.check_config(config)
    for mutate, field in [
        (lambda d: d["states"][0].update(shape=["batch", 193, 3], present_shape=["batch", 193, 3]),
         "states[0].shape"),
        (lambda d: d["states"].pop(), "states"),
        (lambda d: d["states"][1].update(dtype="bfloat16"), "states[1].dtype"),
        (lambda d: d["outputs"][0].update(shape=["batch", "sequence_length", 511]), "outputs[0].shape"),
        (lambda d: d.update(layers=[0, 7]), "layers"),
    ]:
        data = copy.deepcopy(m.to_json())
        mutate(data)
        bad = StateManifest.from_json(data, "m.json")
        with pytest.raises(ArtifactError, match=re.escape(f"m.json: field '{field}'")):
            bad.check_config(config, "m.json")
    other = K3Config.tiny(linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=3,
                                                  full_attn_layers=[3, 6], kda_layers=[1, 2, 4, 5]))
    with pytest.raises(ArtifactError, match="states\\[0\\].shape"):
        m.check_config(other)


def test_manifest_follows_the_contract_for_a_pipeline_stage():
    from k3export.modeling import contract

    config = K3Config.tiny()
    stage = StateManifest.from_config(config, "fp32", layers=range(2, 4))
    assert [s.name for s in stage.states] == [s.name for s in contract.state_specs(config, range(2, 4))]
    assert stage.input_names == [b.input for b in contract.boundary_specs(config, 2)] + ["attention_mask"]
    assert stage.output_names == [b.output for b in contract.boundary_specs(config, 4)]
    back = StateManifest.from_json(json.loads(stage.dumps()))
    back.check_config(config)
    assert back == stage


def test_manifest_records_a_state_kept_in_another_order():
    """``axes`` on a recurrent state (the ort form's V-major [B, H, V, K]): written, read back, checked against the
    config, refused on another kind of state or when it moves the batch; absent where the order is the contract's,
    so a manifest written before it existed hashes as it did. `to_contract` reads a kept state (numpy or torch,
    a window's slot axis first) in the contract's order, as numpy's own transpose does."""
    import numpy as np
    import torch

    config = K3Config.tiny()
    plain = StateManifest.from_config(config, "fp32")
    assert all("axes" not in s for s in plain.to_json()["states"])
    kept = StateManifest.from_config(config, "fp32", recurrent_axes=(0, 1, 3, 2))
    data = kept.to_json()
    assert [s.get("axes") for s in data["states"]] == [[0, 1, 3, 2] if s["kind"] == "recurrent_state" else None
                                                      for s in data["states"]]
    back = StateManifest.from_json(json.loads(kept.dumps()), "m.json")
    back.check_config(config, "m.json")
    assert back == kept
    for n, bad_axes in ((0, [0, 2, 1]), (1, [1, 0, 2, 3]), (1, [0, 1, 2, 2])):
        bad = copy.deepcopy(data)
        bad["states"][n]["axes"] = bad_axes
        with pytest.raises(ArtifactError, match=re.escape(f"m.json: field 'states[{n}].axes'")):
            StateManifest.from_json(bad, "m.json")
    entry = next(s for s in kept.states if s.kind == "recurrent_state")
    x = np.random.default_rng(0).standard_normal((3, 2, 4, 5, 6))  # [W, B, H, V, K]: a window of kept states
    want = np.transpose(x, (0, 1, 2, 4, 3))
    np.testing.assert_array_equal(entry.to_contract(x), want)
    np.testing.assert_array_equal(entry.to_contract(torch.from_numpy(x)).numpy(), want)
    np.testing.assert_array_equal(entry.from_contract(entry.to_contract(x)), x)


def test_runtime_config_bounds_the_config_before_building_it():
    rc = runtime_config()
    assert rc.k3_config().num_hidden_layers == K3Config.tiny().num_hidden_layers
    for key, value in [("num_hidden_layers", 10**12), ("num_hidden_layers", 10**5), ("hidden_size", 10**12),
                       ("num_hidden_layers", True)]:
        bad = copy.deepcopy(rc)
        bad.config[key] = value
        with pytest.raises(ArtifactError, match=f"'config.{key}'"):
            bad.k3_config("rc.json")
    bad = copy.deepcopy(rc)
    bad.config["hidden_act"] = 7
    with pytest.raises(ArtifactError, match="rc.json: field 'config'"):
        bad.k3_config("rc.json")


def test_engine_sidecar_lives_beside_its_engine_and_tells_a_build_asked_the_same(tmp_path):
    """Written as ``<engine>.json``; two records equal in every field but the build's outcomes (plugins, layers)
    mean an engine built the same way; any other field differing means another build."""
    doc = engine_sidecar()
    engine = tmp_path / "stage.engine"
    assert doc.write_for(engine) == tmp_path / "stage.engine.json"
    back = EngineSidecar.read_for(engine)
    assert back == doc and back.same_build(doc)
    assert doc.same_build(dataclasses.replace(doc, plugins=None, network_layers=None))
    for change in ({"tensorrt_version": "10.14.0"}, {"tensorrt_flavour": "tensorrt_rtx"},
                   {"target_compute_capability": None}, {"compute_capability": (8, 9)}, {"prefer_aot": False},
                   {"k3_nodes": []}):
        assert not doc.same_build(dataclasses.replace(doc, **change)), change
    with pytest.raises(ArtifactError, match="missing"):
        EngineSidecar.read_for(tmp_path / "other.engine")


def test_optional_fields_may_be_absent():
    """Fields written as null when unknown may also be left out (the engine record's outcomes, a resume record's
    export id)."""
    data = engine_sidecar().to_json()
    for key in ("target_compute_capability", "plugins", "network_layers"):
        data.pop(key)
    assert EngineSidecar.from_json(data) == dataclasses.replace(engine_sidecar(), target_compute_capability=None,
                                                                plugins=None, network_layers=None)
    data = resume_record().to_json()
    data.pop("export_id")
    assert ResumeRecord.from_json(data) == ResumeRecord("f00d")
