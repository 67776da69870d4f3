"""Pipeline exports: stages chained in ONNX Runtime equal the single graph (logits and every state, fp32, 1e-6),
cuts inside Attention-Residual blocks included; the stage folders and pipeline.json; refusals in one line; the
k3 preset's 16 stage graphs within 2 minutes and 2 GiB."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from big_cfg import big_config
from k3export.modeling import K3ForCausalLM, randomize_weights
from k3export.pipeline import PipelineError, export_pipeline, load_pipeline
from k3export.pipeline.runner import PipelineRunner
from k3export.runtime import Decoding, OrtRunner, left_pad, next_tokens

TOL = 1e-6


def _run_both(single, pipe, prompts, steps, tol: float = TOL) -> int:
    """Prefill a left-padded batch, then `steps` greedy steps on both; compare logits and every state each call."""
    ids, mask = left_pad(prompts)
    a, b = Decoding(single), Decoding(pipe)
    assert sorted(pipe.manifest.names()) == sorted(single.manifest.names())
    fed = [ids]
    calls = 0
    for step in range(steps + 1):
        oa = a.feed(fed[-1], mask if step == 0 else None)
        ob = b.feed(fed[-1], mask if step == 0 else None)
        assert np.abs(oa.logits - ob.logits).max() <= tol, f"logits differ at call {step}"
        for name, value in oa.state.items():
            assert ob.state[name].shape == value.shape, name
            assert np.abs(np.asarray(ob.state[name], np.float64) - value).max() <= tol, f"{name} at call {step}"
        fed.append(next_tokens(oa)[:, None])
        calls += 1
    return calls


@pytest.mark.parametrize("n", [2, 3])
def test_tiny_stages_equal_the_single_graph(tiny_exports, n):
    single, pipe = OrtRunner(tiny_exports[1]), PipelineRunner(tiny_exports[n])
    assert _run_both(single, pipe, [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]], steps=3) == 4
    assert _run_both(single, pipe, [[1, 2, 3, 4]], steps=2) == 3


@pytest.mark.parametrize("n", [2, 3])
def test_stage_weight_bytes_are_the_plans(tiny, tiny_exports, n):
    """The plan prices each stage at exactly the weight bytes its export writes (contract.unread_param_names: layer
    0's first Attention-Residual query and key norm are in the model, not in any stage)."""
    from k3export.pipeline.plan import layer_costs

    costs = layer_costs(tiny.config, "fp32")
    pipe = load_pipeline(tiny_exports[n])
    assert [costs.stage(i, *e.layers).weight_bytes for i, e in enumerate(pipe.file.stages)] == \
        [e.runtime.weight_bytes for e in pipe.stages]


def test_stage_sessions_take_the_options_their_export_recommends(tiny_exports):
    pipe = PipelineRunner(tiny_exports[2])
    assert all(s.session.get_session_options().enable_mem_pattern is False for s in pipe.sessions)  # ORT: True


@pytest.mark.parametrize("n", [2, 3])
def test_stages_keep_the_last_logits_when_asked(tiny_exports, n):
    """``logits_to_keep`` reaches the last stage's graph: the last position's logits of the single graph's full
    logits, the same states."""
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]])
    single, pipe = OrtRunner(tiny_exports[1]), PipelineRunner(tiny_exports[n])
    full = single.forward(ids, single.initial_state(2), mask)
    pipe.logits_to_keep = 1
    kept = pipe.forward(ids, pipe.initial_state(2), mask)
    assert kept.logits.shape == (2, 1, full.logits.shape[-1])
    assert np.abs(kept.logits - full.logits[:, -1:]).max() <= TOL
    for name, value in full.state.items():
        assert np.abs(np.asarray(kept.state[name], np.float64) - value).max() <= TOL, name


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    config = big_config()
    model = K3ForCausalLM(config).eval()
    randomize_weights(model, seed=1)
    root = tmp_path_factory.mktemp("big")
    from k3export.converters.onnx import export_onnx

    export_onnx(model, root / "single")
    export_pipeline(model, root / "stages2", stages=2)  # planned
    export_pipeline(model, root / "stages3", stage_plan=[range(0, 3), range(3, 5), range(5, 8)])  # inside blocks
    return root


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_big_cfg_stages_equal_the_single_graph(big, n):
    single, pipe = OrtRunner(big / "single"), PipelineRunner(big / f"stages{n}")
    assert len(pipe.pipeline.stages) == n
    _run_both(single, pipe, [[11, 12, 13, 14, 15, 16], [7, 8, 9]], steps=2)


def test_stage_folders_and_pipeline_json(tiny_exports):
    p = load_pipeline(tiny_exports[3])
    assert p.ranges == [range(0, 1), range(1, 5), range(5, 6)]
    assert [e.root.name for e in p.stages] == ["stage-00", "stage-01", "stage-02"]
    first, middle, last = (e.manifest for e in p.stages)
    assert first.input_names == ["input_ids", "attention_mask"]
    assert first.output_names == ["stage_out.hidden", "stage_out.attn_res_blocks"]
    assert middle.input_names == ["stage_in.hidden", "stage_in.attn_res_blocks", "attention_mask"]
    assert last.output_names == ["logits"]
    # the block summaries crossing each cut: 1 block opened before layer 1, 3 before layer 5
    assert middle.inputs[1].shape[0] == 1 and middle.outputs[1].shape[0] == 3
    for e, r in zip(p.stages, p.ranges):
        assert {s.layer for s in e.manifest.states} == set(r)
        assert json.loads((e.root / "stage.json").read_text())["export_id"] == p.export_id


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _refused(path: Path) -> str:
    with pytest.raises(PipelineError) as exc:
        load_pipeline(path)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_stage_folders_of_another_export_are_refused(tiny, tiny_exports, tmp_path):
    mine = _copy(tiny_exports[2], tmp_path / "mine")
    other = export_pipeline(tiny, tmp_path / "other", stage_plan=[range(0, 3), range(3, 6)]).out_dir
    shutil.rmtree(mine / "stage-01")
    shutil.copytree(other / "stage-01", mine / "stage-01")
    assert "a stage folder of another export" in _refused(mine)


def test_broken_pipeline_folders_are_refused(tiny_exports, tmp_path):
    p = _copy(tiny_exports[2], tmp_path / "p")
    doc = json.loads((p / "pipeline.json").read_text())
    for edit, expect in ((lambda d: d["stages"][1].update(folder="../p"), "not a folder name inside the export"),
                         (lambda d: d["stages"][1].update(layers=[4, 6]), "layer 3 is in no stage"),
                         (lambda d: [st.update(folder=f) for st, f in zip(d["stages"], ["stage-01", "stage-00"])],
                          "is stage 1 of 2"),
                         (lambda d: d.update(format_version=2), "format_version")):
        bad = json.loads(json.dumps(doc))
        edit(bad)
        (p / "pipeline.json").write_text(json.dumps(bad))
        assert expect in _refused(p)
    (p / "pipeline.json").write_text(json.dumps(doc))
    (p / "stage-01" / "model.onnx").unlink()
    assert "model.onnx" in _refused(p)


def test_bad_stage_counts_are_refused(tiny, tmp_path):
    for kw, expect in (({"stages": 7}, "at most 6 stages"),
                       ({"stage_plan": [range(0, 2), range(3, 6)]}, "layer 2 is in no stage"),
                       ({"stage_plan": [range(0, 4), range(3, 6)]}, "in stage 0 and again in stage 1")):
        with pytest.raises(PipelineError) as exc:
            export_pipeline(tiny, tmp_path / "x", **kw)
        assert expect in str(exc.value) and "\n" not in str(exc.value)
        assert not (tmp_path / "x").exists()


def test_mxfp4_stages_stream_the_checkpoints_bytes_and_equal_the_dense_graph(released_random, tmp_path, monkeypatch):
    """A released checkpoint (MXFP4 experts) cut into stages: no model is built, each stage's external data holds
    its own layers' packed bytes and scales exactly as the checkpoint stores them, the stages are planned by the
    MXFP4 bytes they hold, and chained in ONNX Runtime they give the dequantised single graph's logits and states."""
    import hashlib

    import onnx
    from onnx import TensorProto

    from checkpoint_bytes import mxfp4_bytes
    from k3export.converters.onnx import export_onnx
    from k3export.pipeline import layer_costs

    single = export_onnx(released_random, tmp_path / "dense", experts="dense").out_dir
    monkeypatch.setattr(K3ForCausalLM, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("an MXFP4 pipeline export must not load the model")))
    seen: list[tuple[int, int]] = []
    res = export_pipeline(released_random, tmp_path / "stages", stage_plan=[range(0, 3), range(3, 6)],
                          bytes_progress=lambda done, total: seen.append((done, total)))
    p = load_pipeline(res.out_dir)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == sum(res.weight_bytes)
    assert {t for _, t in seen} == {sum(s.weight_bytes for s in res.plan.stages)}  # one bar over every stage

    raw = mxfp4_bytes(released_random)
    checked = 0
    for stage, layers in zip(p.stages, p.ranges):
        model = onnx.load(str(stage.model_path), load_external_data=False)
        for t in model.graph.initializer:
            if t.data_type not in (TensorProto.FLOAT4E2M1, TensorProto.FLOAT8E8M0):
                continue
            layer, w, kind = int(t.name.split(".")[2]), t.name.split(".")[-2], t.name.split(".")[-1]
            assert layer in layers, t.name
            ext = {e.key: e.value for e in t.external_data}
            with open(stage.root / ext["location"], "rb") as fh:
                fh.seek(int(ext["offset"]))
                got = fh.read(int(ext["length"]))
            want = b"".join(raw[f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.{kind}"]
                            for e in range(t.dims[0]))
            assert hashlib.sha256(got).digest() == hashlib.sha256(want).digest(), t.name
            checked += 1
    config = p.config
    assert checked == 6 * sum(kind == "moe" for kind in config.mlp_types)  # w1 / w3 / w2, packed + scale
    assert res.plan.costs == layer_costs(config, "fp32", mxfp4_experts=True)
    # planned by the bytes each stage holds (the graph drops layer 0's first Attention-Residual proj / norm: an
    # aggregation over the embedding alone is the embedding, 512 bytes here)
    for held, planned in zip(res.weight_bytes, (s.weight_bytes for s in res.plan.stages)):
        assert 0 <= planned - held <= 512

    # fp32 rounding apart: the library's MXFP4 kernel sums each 32-feature chunk's even features before its odd
    # ones, the dense kernel in order
    assert _run_both(OrtRunner(single), PipelineRunner(res.out_dir), [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]],
                     steps=3, tol=1e-4) == 4


def test_mxfp4_stages_are_refused_from_dense_experts(tiny, tmp_path):
    from k3export.errors import ExportError

    with pytest.raises(ExportError, match="needs a checkpoint whose routed experts are MXFP4"):
        export_pipeline(tiny, tmp_path / "x", stages=2, experts="mxfp4")
    assert not (tmp_path / "x").exists()


def test_cli_export_stages_passes_the_expert_format(released_random, tmp_path):
    """``k3export export SRC OUT --stages 2``: MXFP4 stages by default from a released checkpoint, dense with
    ``--experts dense``; ``--experts mxfp4`` from a dense source is one error line, exit 2, no folder left."""
    import onnx
    from onnx import TensorProto
    from typer.testing import CliRunner

    from k3export_cli.main import app

    def fp4_initializers(folder: Path) -> int:
        return sum(t.data_type == TensorProto.FLOAT4E2M1 for stage in sorted(folder.glob("stage-*"))
                   for t in onnx.load(str(stage / "model.onnx"), load_external_data=False).graph.initializer)

    runner = CliRunner()
    for extra, fp4 in (([], 3 * 5), (["--experts", "dense"], 0)):
        out = tmp_path / f"stages{len(extra)}"
        res = runner.invoke(app, ["export", str(released_random), str(out), "--stages", "2", *extra])
        assert res.exit_code == 0, res.output
        assert fp4_initializers(out) == fp4
    dense_src = tmp_path / "dense_src"
    K3ForCausalLM(load_pipeline(tmp_path / "stages0").config).save_pretrained(dense_src)
    res = runner.invoke(app, ["export", str(dense_src), str(tmp_path / "bad"), "--stages", "2", "--experts", "mxfp4"])
    assert res.exit_code == 2 and "needs a checkpoint whose routed experts are MXFP4" in res.output
    res = runner.invoke(app, ["export", str(released_random), str(tmp_path / "bad"), "--stages", "2", "--genai"])
    assert res.exit_code == 2 and "runs whole decoders, not pipeline stages" in res.output
    assert not (tmp_path / "bad").exists()


_K3_SCRIPT = """
import sys, time
t0 = time.perf_counter()
from k3export.modeling import K3Config
from k3export.pipeline import export_pipeline, load_pipeline
r = export_pipeline(K3Config.k3(), sys.argv[1], stages=16, weights=False, dtype="bf16", experts="mxfp4")
seconds = time.perf_counter() - t0
p = load_pipeline(sys.argv[1])
# VmHWM is this process image's own peak; ru_maxrss carries pytest's RSS across the vfork + exec that started it
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(seconds, hwm, len(p.stages), sum(r.num_nodes),
      sum(r.weight_bytes), max(r.weight_bytes))
"""


@pytest.mark.slow
def test_k3_preset_16_mxfp4_stage_graphs_build_within_2_minutes_and_2_gib(tmp_path):
    """The deployment form (bf16, MXFP4 experts): 16 stage graphs declaring at most 1.6 TB in all, none more than
    an H200 holds."""
    out = tmp_path / "k3"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_K3_SCRIPT), str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seconds, rss, stages, nodes, total, largest = proc.stdout.split()
    print(f"k3 preset, 16 MXFP4 stages, no weights: {float(seconds):.1f} s, peak RSS {int(rss) / 2**30:.2f} GiB, "
          f"{nodes} nodes, {int(total) / 1e12:.3f} TB declared, largest stage {int(largest) / 2**30:.1f} GiB")
    assert int(stages) == 16
    assert int(total) <= 1.6e12 and int(largest) <= 100 * 2**30
    assert float(seconds) < 120 and int(rss) < 2 * 2**30
    assert len(list(out.glob("stage-*/model.onnx"))) == 16 and not list(out.glob("stage-*/model.onnx.data*"))
