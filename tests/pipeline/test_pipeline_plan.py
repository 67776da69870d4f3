"""Stage planning and the deployment plan: balanced by bytes from the contract, MXFP4-aware, bad plans refused in
one line (no ONNX, no Ray: fast)."""

from __future__ import annotations

import json
import os

import pytest

from k3export.modeling import K3Config, contract
from k3export.pipeline import (
    PipelineError, check_ranges, deploy_plan, layer_costs, plan_stages, read_stage_plan,
)
from k3export.pipeline.plan import MXFP4_BITS, min_devices

GB = 10**9


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


def test_costs_come_from_the_contract():
    c = K3Config.tiny()
    costs = layer_costs(c, "fp32")
    unread = contract.unread_param_names(c)
    assert unread and all(name.startswith("model.layers.0.") for name in unread)
    for i in range(c.num_hidden_layers):
        assert costs.weights[i] == 4 * sum(s.numel for s in contract.layer_param_specs(c, i) if s.name not in unread)
    head = contract.head_param_specs(c)
    assert costs.first == sum(4 * s.numel for s in head if s.kind == "embedding")
    assert costs.last == sum(4 * s.numel for s in head if s.kind != "embedding")
    # bf16: fp32-kept parameters stay 4 bytes
    bf16 = layer_costs(c, "bf16")
    kda = next(i for i, t in enumerate(c.attn_types) if t == "kda")
    specs = [s for s in contract.layer_param_specs(c, kda) if s.name not in unread]
    assert bf16.weights[kda] == sum(s.numel * (4 if s.fp32 else 2) for s in specs)


def test_mxfp4_experts_cost_4_25_bits():
    c = K3Config.k3()
    dense, packed = layer_costs(c, "bf16"), layer_costs(c, "bf16", mxfp4_experts=True)
    expert = sum(s.numel for s in contract.expert_param_specs(c, 1, 0)) * c.num_experts
    assert dense.weights[1] - packed.weights[1] == pytest.approx(expert * (2 - MXFP4_BITS / 8), abs=1)
    assert dense.weights[0] == packed.weights[0]  # layer 0 is dense: no routed experts
    assert sum(packed.weights) + packed.first + packed.last == pytest.approx(1.56e12, rel=0.01)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_plan_is_contiguous_and_balanced(n):
    c = K3Config.k3()
    plan = plan_stages(c, n, dtype="bf16", mxfp4_experts=True)
    check_ranges(plan.ranges, c.num_hidden_layers)
    costs = plan.costs
    worst = max(s.total_bytes(8192) for s in plan.stages)
    # never worse than cutting the layers evenly, and within one layer of the ideal share
    even = [range(round(k * 93 / n), round((k + 1) * 93 / n)) for k in range(n)]
    assert worst <= max(costs.stage(0, r.start, r.stop).total_bytes(8192) for r in even)
    total = sum(costs.weights) + costs.first + costs.last
    assert worst <= total / n + max(costs.weights) + costs.first


def test_stage_ends_own_embedding_and_head():
    plan = plan_stages(K3Config.tiny(), 3, dtype="fp32")
    first, last = plan.stages[0], plan.stages[-1]
    costs = plan.costs
    assert first.weight_bytes == costs.first + sum(costs.weights[first.layers.start:first.layers.stop])
    assert last.weight_bytes == costs.last + sum(costs.weights[last.layers.start:last.layers.stop])


def test_k3_on_16_h200_fits_and_reports_context():
    dp = deploy_plan(K3Config.k3(), 16, 141 * GB, mxfp4_experts=True, reserve=8 * GB)
    assert len(dp.plan) == 16 and not dp.problems()
    assert max(s.weight_bytes for s in dp.plan.stages) < 102 * 2**30
    assert dp.max_context > 1_000_000
    # the longest context it reports does fit, one more token does not
    ctx = dp.max_context
    tight = min(dp.plan.stages, key=lambda s: dp.stage_context(s) if dp.stage_context(s) is not None else 1 << 62)
    assert tight.total_bytes(ctx) + dp.reserve <= dp.device_bytes < tight.total_bytes(ctx + 1) + dp.reserve


def test_a_plan_that_does_not_fit_says_by_how_much():
    with pytest.raises(PipelineError) as exc:
        deploy_plan(K3Config.k3(), 16, 141 * GB, mxfp4_experts=False, reserve=8 * GB)
    msg = _one_line(exc)
    assert "does not fit" in msg and "over" in msg and "46 such devices would hold it" in msg
    assert min_devices(layer_costs(K3Config.k3(), "bf16"), 141 * GB, 8 * GB, 0, 1) == 46
    with pytest.raises(PipelineError) as exc:
        deploy_plan(K3Config.k3(), 16, 141 * GB, mxfp4_experts=True, reserve=8 * GB, context=10**9)
    assert "no number of such devices" in _one_line(exc)


@pytest.mark.parametrize("stages, expect", [
    ([[0, 2], [3, 6]], "layer 2 is in no stage"),
    ([[0, 3], [2, 6]], "layer 2 is in stage 0 and again in stage 1"),
    ([[0, 3], [3, 5]], "layer 5 is in no stage"),
    ([[0, 3], [3, 7]], "goes past the model's 6 layers"),
    ([[0, 3], [3, 3], [3, 6]], "holds no layer"),
    ([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6, 7]], "7 stages for a 6-layer model"),
    ([[0, "3"], [3, 6]], "field 'stages[0][1]': expected an integer"),
    ([[0, 3, 4], [3, 6]], "field 'stages[0]': expected a list of 2 items"),
    ([[-1, 3], [3, 6]], "field 'stages[0]': [-1, 3] names a negative layer"),
])
def test_bad_stage_plans_are_refused_in_one_line(tmp_path, stages, expect):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"stages": stages}))
    with pytest.raises(PipelineError) as exc:
        read_stage_plan(path, 6)
    assert expect in _one_line(exc)


def test_a_stage_plan_is_written_atomically_never_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "plan.json"
    link.symlink_to(victim)
    plan = plan_stages(K3Config.tiny(), 3)
    plan.write(link)
    assert victim.read_text() == "keep me" and not link.is_symlink()
    assert read_stage_plan(link, 6) == plan.ranges
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_stage_plan_file_format(tmp_path):
    path = tmp_path / "plan.json"
    plan = plan_stages(K3Config.tiny(), 3)
    plan.write(path)
    assert read_stage_plan(path, 6) == plan.ranges
    for bad, expect in (({"stages": [[0, 6]], "extra": 1}, "field 'extra': unknown field"),
                        ({"format": "other", "stages": [[0, 6]]}, "field 'format'"),
                        ({"format_version": 2, "stages": [[0, 6]]}, "this k3export reads version 1"),
                        ({}, "field 'stages': missing"), ([[0, 6]], "expected a JSON object")):
        path.write_text(json.dumps(bad))
        with pytest.raises(PipelineError) as exc:
            read_stage_plan(path, 6)
        assert expect in _one_line(exc)
    path.write_text("{not json")
    with pytest.raises(PipelineError) as exc:
        read_stage_plan(path, 6)
    assert f"{path}: is not valid JSON" in _one_line(exc)
    path.unlink()
    with pytest.raises(PipelineError) as exc:
        read_stage_plan(path, 6)
    assert "plan.json" in _one_line(exc) and "missing" in _one_line(exc)


def test_a_stage_plan_named_through_a_link_is_read_wherever_it_points(tmp_path):
    """The user names the file: a link to another folder is followed (no folder to stay inside), but it must
    still reach a regular file."""
    plan = plan_stages(K3Config.tiny(), 3)
    (tmp_path / "plans").mkdir()
    plan.write(tmp_path / "plans" / "v1.json")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "plan.json").symlink_to(tmp_path / "plans" / "v1.json")
    assert read_stage_plan(tmp_path / "work" / "plan.json", 6) == plan.ranges
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(PipelineError) as exc:
        read_stage_plan(tmp_path / "fifo.json", 6)
    assert "not a regular file" in _one_line(exc)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PipelineError) as exc:
        plan_stages(K3Config.tiny(), 7)
    assert "at most 6 stages" in _one_line(exc)


def test_deploy_plan_cli(tmp_path, capsys):
    from k3export_cli.main import main

    with pytest.raises(SystemExit) as code:
        main(["deploy-plan", "--config", "k3", "--devices", "16", "--device-memory", "141GB", "--json",
              "--write-plan", str(tmp_path / "plan.json")])
    assert code.value.code == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["stages"]) == 16 and data["mxfp4_experts"] and data["max_context"] > 1_000_000
    assert len(read_stage_plan(tmp_path / "plan.json", 93)) == 16
    with pytest.raises(SystemExit) as code:
        main(["deploy-plan", "--config", "k3", "--devices", "16", "--device-memory", "141GB", "--experts", "dense"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and err.count("\n") == 1 and "does not fit" in err and "over" in err
    with pytest.raises(SystemExit) as code:
        main(["deploy-plan", "tiny", "--devices", "7", "--device-memory", "1GB", "--reserve", "0"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and err.count("\n") == 1 and "at most 6 stages" in err


@pytest.mark.parametrize("args, expect", [
    ([], "give MODEL (a model folder or a preset: k3, tiny, tiny-kimi-linear) or --config PRESET"),
    (["tiny", "--config", "k3"], "not both"),
    (["--config", "k3", "--dtype", "nonsense"], "choose one of fp32, bf16, fp16"),
])
def test_deploy_plan_argument_errors_say_what_is_wrong(capsys, args, expect):
    from k3export_cli.main import main

    with pytest.raises(SystemExit) as code:
        main(["deploy-plan", *args, "--devices", "16", "--device-memory", "141GB"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and err.count("\n") == 1 and expect in err, err


def test_deploy_plan_puts_the_vision_tower_on_stage_0(tmp_path, capsys):
    """The released K3 is image + text: its tower and projector (bf16) join stage 0, the other stages are the text
    plan's; ``--text-only`` plans the text model alone. The bytes are those of the modules PyTorch builds."""
    import torch

    from k3export.checkpoint_io import preset_model_config
    from k3export.modeling.modeling_k3_vision import K3PatchMergerMLPV2, K3VisionTower
    from k3export.units import format_bytes
    from k3export_cli.main import main

    vision = preset_model_config("k3").vision_config
    with torch.device("meta"):
        numel = sum(p.numel() for m in (K3VisionTower(vision), K3PatchMergerMLPV2(vision)) for p in m.parameters())
    assert 400e6 < numel < 500e6  # MoonViT-V2: 27 blocks of width 1024, and the projector into 7168

    def plan(*extra):
        with pytest.raises(SystemExit) as code:
            main(["deploy-plan", "--config", "k3", "--devices", "16", "--device-memory", "141GB", "--json", *extra])
        assert code.value.code == 0
        return json.loads(capsys.readouterr().out)

    whole = plan("--write-plan", str(tmp_path / "plan.json"))
    text = plan("--text-only", "--stage-plan", str(tmp_path / "plan.json"))
    assert whole["vision_bytes"] == 2 * numel and text["vision_bytes"] == 0
    assert whole["stages"][0]["weight_bytes"] - text["stages"][0]["weight_bytes"] == 2 * numel
    assert [s["weight_bytes"] for s in whole["stages"][1:]] == [s["weight_bytes"] for s in text["stages"][1:]]
    with pytest.raises(SystemExit):
        main(["deploy-plan", "--config", "k3", "--devices", "16", "--device-memory", "141GB"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"(the vision tower + projector, {format_bytes(2 * numel)}, on stage 0)" in out
