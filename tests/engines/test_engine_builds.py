"""Real TensorRT-RTX engines of the tiny K3, built here with no GPU, with the k3 plugins (class-based IPluginV3):
the dense export, the MXFP4-expert export (released layout), a pipeline stage, and an op built from its standard-op
form. Each engine holds a prefill and a decode profile; each sidecar is checked against what the ONNX graph and the
installed TensorRT say, read independently here. Running an engine needs a GPU: that test skips, saying so."""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter
from pathlib import Path

import onnx
import pytest
from trt_builds import LIMITS, OPTIMIZATION_LEVEL, TARGET, build, export_fp32, in_child  # tests/engines on sys.path
from typer.testing import CliRunner

from k3export.artifacts import EngineSidecar
from k3export.errors import ExportError, K3ExportError

TARGET_CC = tuple(int(x) for x in TARGET.split("."))
#: the PTX entry of each op's kernel (Triton names the entry after the jit function)
ENTRIES = {"kda": {"kda_recurrent_kernel", "kda_chunk_kernel"}, "situ_glu": {"situ_glu_kernel"},
           "moe_route": {"moe_route_kernel"}, "moe_experts": {"moe_experts_kernel"},
           "moe_experts_mxfp4": {"moe_experts_mxfp4_kernel"}, "moe_experts_nvfp4": {"moe_experts_nvfp4_kernel"}}
#: the plugin an FP4 export's ``moe_experts`` node (by its input count) is built as
FP4_FORMS = {9: "moe_experts_mxfp4", 12: "moe_experts_nvfp4"}


def graph_k3_ops(onnx_dir: Path) -> Counter:
    """k3 plugin nodes of the export's graph by op, read from the file (FP4 experts: `FP4_FORMS`), in
    the branches TensorRT builds (`plugin_forms.one_branch`)."""
    from k3export.artifacts.graph_forms import inline_fused
    from k3export.converters.tensorrt.plugin_forms import one_branch

    # the library's fused ops have no plugin: TensorRT reads their bodies (onnx's inliner)
    model = inline_fused(onnx.load(str(onnx_dir / "model.onnx"), load_external_data=False))
    one_branch(model.graph)
    ops = Counter()
    for n in model.graph.node:
        if n.domain == "k3" and any(a.name == "plugin_namespace" for a in n.attribute):
            ops[FP4_FORMS.get(len(n.input), n.op_type) if n.op_type == "moe_experts" else n.op_type] += 1
    return ops


def embedded_kernels(engine: Path) -> list[dict]:
    """Every kernel record the engine's plugin fields carry: zlib streams in the engine bytes that decode to the
    plugins' JSON (tactic -> kernel)."""
    data = engine.read_bytes()
    found = []
    for m in re.finditer(rb"\x78\x9c", data):
        try:
            records = json.loads(zlib.decompressobj().decompress(data[m.start():m.start() + (4 << 20)]))
        except (zlib.error, ValueError, UnicodeDecodeError):
            continue
        if isinstance(records, dict) and all(isinstance(r, dict) and "ptx" in r for r in records.values()):
            found.extend(records.values())
    return found


def check_engine(engine: Path, onnx_dir: Path, rtx, standard: tuple[str, ...] = ()) -> EngineSidecar:
    """The sidecar against the graph, the installed TensorRT and the build asked for; the PTX in the engine."""
    car = EngineSidecar.read_for(engine)
    ops = graph_k3_ops(onnx_dir)
    plugin_ops = {op: n for op, n in ops.items() if op not in standard}
    assert engine.stat().st_size > 1 << 20
    assert (car.tensorrt_flavour, car.tensorrt_version) == ("tensorrt_rtx", rtx.trt.__version__)
    assert car.target_compute_capability == TARGET_CC and car.compute_capability is None and car.gpu == "none"
    assert car.precision == "fp32" and car.optimization_level == OPTIMIZATION_LEVEL
    assert car.onnx == str(onnx_dir / "model.onnx")
    assert car.plugins == sorted(f"k3::{op}" for op in plugin_ops) and car.plugin_api == "IPluginV3"
    assert car.plugin_layers == sum(plugin_ops.values()) and car.network_layers > 10 * car.plugin_layers
    assert sorted(car.standard_ops) == sorted(standard)
    assert Counter(n.op for n in car.k3_nodes) == Counter(plugin_ops)
    prefill, decode = car.profiles
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert set(prefill.shapes) == set(decode.shapes) and prefill.limits == decode.limits == LIMITS
    seq, ctx = LIMITS["max_seq"], LIMITS["max_context"]
    differ = Counter()
    for name, (_, _, hi_p) in prefill.shapes.items():
        hi_d = decode.shapes[name][2]
        for a, b in zip(hi_p, hi_d):
            if a != b:  # new tokens (prefill <= max_seq, decode 1) or all tokens (past + new)
                assert (a, b) in {(seq, 1), (ctx + seq, ctx + 1)}, (name, hi_p, hi_d)
                differ[(a, b)] += 1
    assert differ[(seq, 1)] >= 1  # some input carries the new tokens
    kernels = embedded_kernels(engine)
    assert kernels and all(k["target"] == ["cuda", TARGET_CC[0] * 10 + TARGET_CC[1], 32] for k in kernels)
    assert all(f".target sm_{TARGET_CC[0]}{TARGET_CC[1]}" in k["ptx"] for k in kernels)
    per_op = Counter(k["op"] for k in kernels)
    for op, n in plugin_ops.items():  # each plugin layer carries its kernel in each of the two profiles
        assert per_op[op] >= 2 * n, (op, per_op)
        assert {k["entry"] for k in kernels if k["op"] == op} <= ENTRIES[op]
    assert not set(per_op) - set(plugin_ops)
    return car


def test_dense_export_builds_with_every_k3_plugin(dense_engine, dense_export, rtx):
    car = check_engine(dense_engine, dense_export, rtx)
    assert set(car.plugins) == {"k3::kda", "k3::situ_glu", "k3::moe_route", "k3::moe_experts"}


def test_mxfp4_export_builds_with_the_mxfp4_experts_plugin(mxfp4_engine, mxfp4_export, rtx):
    car = check_engine(mxfp4_engine, mxfp4_export, rtx)
    assert "k3::moe_experts_mxfp4" in car.plugins and "k3::moe_experts" not in car.plugins


@pytest.mark.parametrize("experts", ["dense", "mxfp4"])
@pytest.mark.parametrize("form", ["functions", "inlined"])
def test_tensorrt_builds_the_forms_it_is_said_to_read(form, experts, request, engine_of, rtx, tmp_path):
    """`forms.READERS` against real builds: a form it says TensorRT reads builds (its engine checked); a form it
    does not is refused before TensorRT in one line naming the form to export, and TensorRT-RTX, handed that graph
    anyway (the table made to claim every form), really fails to build it. If TensorRT-RTX starts to build it, or
    stops building a claimed form, this fails and the table is to be measured again."""
    from k3export.converters.onnx import forms

    folder = request.getfixturevalue(f"{experts}_{'inlined_' if form == 'inlined' else ''}export")
    assert json.loads((folder / "runtime_config.json").read_text())["graph_form"] == form
    if form in forms.readable("trt", experts):
        check_engine(engine_of(folder), folder, rtx)
        return
    engine = tmp_path / "model.engine"
    with pytest.raises(K3ExportError) as refused:
        build(folder, engine)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and message.startswith("trt cannot read "), message
    assert f"graph form {form!r}" in message and "--form functions" in message
    child = in_child(UNREAD_FORM_BUILD, folder, engine)  # a crash (a signal) also says it does not build
    assert child.returncode != 0, child.stdout + child.stderr
    if child.returncode == 3:  # refused in Python: by TensorRT, not by the table
        said = " ".join(line for line in child.stdout.splitlines() if line.startswith("k3: "))
        assert re.search("could not build the engine|parse|Parse|failed|error", said), child.stdout + child.stderr
        assert "cannot read" not in said
    else:
        assert child.returncode < 0, child.stdout + child.stderr  # a signal, not a Python traceback
    assert not engine.exists()


#: `build` of ONNX_DIR into ENGINE with the readers table made to claim every form (the child of the test above):
#: exit 3 printing the ExportError's line after "k3: " (TensorRT logs to stdout too), 0 when an engine was built
UNREAD_FORM_BUILD = """
import sys
from pathlib import Path
import k3export.plugins.flavour  # before tensorrt_rtx (docs/tensorrt.md)
from k3export.converters.onnx import forms
from k3export.errors import ExportError
from trt_builds import build
forms.READERS["trt"] = (tuple(forms.FORMS),) * len(forms.EXPERT_FORMATS)
try:
    build(Path(sys.argv[1]), Path(sys.argv[2]), allow_no_plugins=True)
except ExportError as exc:
    print("\\nk3:", exc)
    sys.exit(3)
"""


def test_a_pipeline_builds_an_engine_per_stage_and_keeps_those_built_the_same_way(pipeline_export, rtx, tmp_path):
    """``k3export build PIPELINE_DIR ENGINE_DIR --target-cc``: a real engine per stage, each checked against its
    stage's graph; run again, every stage is kept; a stage whose record names another build is built again."""
    import dataclasses

    from k3export_cli.main import app

    stages = sorted(p for p in pipeline_export.iterdir() if p.name.startswith("stage-"))
    assert len(stages) == 2
    args = ["build", str(pipeline_export), str(tmp_path / "engines"), "--precision", "fp32", "--target-cc", TARGET,
            "--opt-level", str(OPTIMIZATION_LEVEL), *(f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items())]

    def run() -> str:
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        return r.output

    out = run()
    engines = [tmp_path / "engines" / s.name / "model.engine" for s in stages]
    assert out.count("TensorRT-RTX") >= 2 and "kept" not in out
    whole = sum((graph_k3_ops(s) for s in stages), Counter())
    cars = [check_engine(e, s, rtx) for e, s in zip(engines, stages)]
    assert all(0 < car.plugin_layers < sum(whole.values()) for car in cars)  # each stage's layers only
    assert sum(car.plugin_layers for car in cars) == sum(whole.values())
    assert not list(pipeline_export.glob("*/model.engine"))  # written to ENGINE_DIR, the export untouched
    assert run().count("kept (built the same way)") == 2
    car = EngineSidecar.read_for(engines[1])
    dataclasses.replace(car, optimization_level=3).write_for(engines[1])
    out = "".join(run().split())  # the console wraps long paths
    assert "stage1/2(stage-00):" in out and "kept(builtthesameway)" in out.split("stage2/2")[0], out
    assert f"stage2/2(stage-01):building{engines[1]}" in out, out
    assert EngineSidecar.read_for(engines[1]).optimization_level == OPTIMIZATION_LEVEL


def test_an_op_without_a_kernel_for_the_target_is_built_from_its_standard_ops(dense_export, rtx, tmp_path,
                                                                             monkeypatch):
    """KDA's kernel made to fail for the target: the build names the op and why, builds it from its standard-op
    body (no KDA plugin layer left), and the sidecar records it."""
    from k3export.ops import aot
    from k3export.plugins import kda

    def no_kernel(*args, **kwargs):
        raise aot.KernelError("no kda kernel for this target (test)")

    monkeypatch.setattr(kda, "kernel", no_kernel)
    lines = []
    from k3export.converters.tensorrt import build_engine

    engine = build_engine(dense_export, tmp_path / "fallback.engine", precision="fp32", target_cc=TARGET,
                          optimization_level=OPTIMIZATION_LEVEL, progress=lines.append, **LIMITS)
    said = [m for m in lines if "k3::kda cannot be built as a plugin" in m]
    assert len(said) == 1 and "no kda kernel for this target (test)" in said[0] and "standard-op form" in said[0]
    check_engine(engine, dense_export, rtx, standard=("kda",))


def test_mxfp4_experts_have_no_standard_op_form_for_tensorrt(mxfp4_export):
    from k3export.converters.tensorrt import prepare_build

    with pytest.raises(ExportError, match=r"k3::moe_experts_mxfp4 has no standard-op form TensorRT reads.*"
                                          r"--experts dense"):
        prepare_build(mxfp4_export, "fp32", standard_ops=["moe_experts_mxfp4"])


def test_targets_tensorrt_rtx_cannot_build_are_refused_in_one_line(dense_export, rtx, tmp_path):
    from k3export_cli.main import app

    listed = ", ".join(f"{a}.{b}" for a, b in rtx.targets)
    r = CliRunner().invoke(app, ["build", str(dense_export), str(tmp_path / "x.engine"), "--precision", "fp32",
                                 "--target-cc", "9.0"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"cannot build for compute capability 9.0; it builds for {listed}" in " ".join(r.output.split())
    assert (7, 5) in rtx.targets and (9, 0) not in rtx.targets and not (tmp_path / "x.engine").exists()


def test_bf16_on_a_target_without_bf16_is_refused_naming_the_alternatives(rtx):
    from k3export.converters.tensorrt.build import resolve_target

    with pytest.raises(ExportError, match=r"precision bf16 needs .* >= 8.0; target 7.5 is sm_75. Export and build in "
                                          r"fp16 instead, or build for a target >= 8.0"):
        resolve_target(rtx, "7.5", "bf16", "bfloat16")
    assert resolve_target(rtx, "7.5", "fp16", "float16")[0] == (7, 5)


def test_info_prints_what_the_sidecar_records(dense_engine, rtx):
    from k3export_cli.main import app

    r = CliRunner().invoke(app, ["info", str(dense_engine)])
    out = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 0, r.output
    car = EngineSidecar.read_for(dense_engine)
    assert f"built with TensorRT-RTX {rtx.trt.__version__}" in out and f"target compute capability {TARGET}" in out
    assert "built on no GPU" in out and f"network layers {car.network_layers}" in out
    assert f"plugin layers {car.plugin_layers}" in out and "k3::kda, k3::moe_experts, k3::moe_route, k3::situ_glu" in out
    assert "running needs Python" in out


def test_running_an_engine_needs_a_gpu(dense_engine, dense_export, tiny_k3):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("running a TensorRT engine needs an NVIDIA GPU; none is visible (the engines here are built, "
                    "not run)")
    cc = torch.cuda.get_device_capability()
    if cc != TARGET_CC:
        pytest.skip(f"the engine is built for compute capability {TARGET}; this GPU is {cc[0]}.{cc[1]}")
    from k3export.validate.api import run_validation

    run = run_validation(tiny_k3, runtimes=["trt"], onnx_dir=dense_export, engine=dense_engine, prompt_len=6,
                         steps=4, batch=2, device="cuda", strict=True)
    assert run.result.passed, run.result.localisation


def test_a_state_window_export_builds_with_the_same_plugins(tiny_k3, rtx, tmp_path_factory, tmp_path):
    """The window is W + 1 calls of the kda plugin per KDA layer (`K3GraphBuilder.kda_window`): no new plugin."""
    onnx_dir = export_fp32(tiny_k3, tmp_path_factory, "window", state_window=2)
    car = check_engine(build(onnx_dir, tmp_path / "w.engine"), onnx_dir, rtx)
    kda_layers = tiny_k3.config.attn_types.count("kda")
    assert Counter(n.op for n in car.k3_nodes)["kda"] == 3 * kda_layers
