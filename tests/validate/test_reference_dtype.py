"""The PyTorch reference computes in fp32 (or fp64) whatever the checkpoint stores, and each runtime is judged with the
tolerances of its own dtype against it.

A bf16 reference rounds every product to 8 bits of mantissa: on the released bf16 layout it disagreed with itself
across chunk boundaries (rms_rel 0.22) and could not tell an exact fp32 export from a broken one. Upcast, it agrees
with the fp32 export to fp32 round-off, and a one-bit error in one weight of the export is caught and localised.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from k3export.artifacts import ValidationReport
from k3export.converters.checkpoints.synthetic_vision import write_vision_checkpoint
from k3export.converters.onnx import export_onnx
from k3export.converters.onnx.lowp import emulate_low_precision
from k3export.runtime import OrtRunner, TorchRunner
from k3export.runtime.torch_runner import cast_model
from k3export.validate import make_scenarios, validate
from k3export.validate import mutations as mu
from k3export.validate.api import reference_model, run_validation

from export_names import KDA_IN_PROJ  # tests/ is on sys.path

SHORT = dict(prompt_len=8, steps=3, batch=1)


@pytest.fixture(scope="module")
def bf16_released(tmp_path_factory):
    """A tiny checkpoint in the released layout as people have it: bf16 tensors, MXFP4 experts, a vision tower."""
    return write_vision_checkpoint(tmp_path_factory.mktemp("bf16") / "src", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_export(bf16_released, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "fp32-export"
    export_onnx(bf16_released, out, dtype="fp32", vision=False, experts="dense")
    return out


def test_reference_of_a_bf16_checkpoint_is_fp32(bf16_released):
    ref = reference_model(bf16_released)
    assert ref.get_input_embeddings().weight.dtype == torch.float32
    stored = reference_model(bf16_released, "checkpoint")
    assert stored.get_input_embeddings().weight.dtype == torch.bfloat16
    # the upcast holds exactly the stored values
    assert torch.equal(ref.get_input_embeddings().weight, stored.get_input_embeddings().weight.float())
    assert reference_model(bf16_released, "fp64").get_input_embeddings().weight.dtype == torch.float64


def test_bf16_checkpoint_validates_against_its_fp32_export(bf16_released, fp32_export, tmp_path):
    run = run_validation(bf16_released, runtimes=["torch", "ort"], onnx_dir=fp32_export, **SHORT,
                         report_path=tmp_path / "r.json")
    worst = {(r.runtime, r.scenario, r.tensor): r.rms_rel for r in run.report.summary}
    assert run.result.passed, run.result.localisation
    # torch's chunked prefill agrees with its one-shot prefill, and the export with the reference, to fp32 round-off
    assert worst[("torch", "chunked_prefill", "logits")] < 1e-4
    assert worst[("ort", "decode", "logits")] < 1e-4
    report = ValidationReport.read_file(tmp_path / "r.json")
    assert report.reference_dtype == "float32"
    assert report.runtime_dtypes == {"torch": "float32", "ort": "float32"}
    assert report.tolerances_of("ort")["logits"].rms_rel == 1e-3


def _flip_exponent_bit(value: np.ndarray) -> np.ndarray:
    """The largest weight's lowest exponent bit flipped: that one value halves or doubles."""
    bits = value.reshape(-1).view(np.uint32)
    bits[np.argmax(np.abs(value.reshape(-1)))] ^= np.uint32(1 << 23)
    return value


def test_a_one_bit_error_in_the_export_is_caught_and_localised(bf16_released, fp32_export, tmp_path):
    model = onnx.load(str(fp32_export / "model.onnx"), load_external_data=False)
    name = KDA_IN_PROJ
    assert name in {t.name for t in model.graph.initializer}
    bad = mu.mutate_onnx_initializer(fp32_export, tmp_path / "bad", name, _flip_exponent_bit)
    run = run_validation(bf16_released, runtimes=["ort"], onnx_dir=bad, **SHORT)
    assert not run.result.passed
    assert "layer 3 (kda)" in run.result.localisation, run.result.localisation


# ------------------------------------------------------------------ a reduced-precision runtime, bf16 tolerances
@pytest.fixture(scope="module")
def selection_free():
    """Top-k routing over every expert: a bf16 perturbation cannot flip a near-tie expert choice (a discrete event
    that says nothing about the arithmetic), so bf16 error stays bf16-sized."""
    from k3export.modeling import tiny_model

    return tiny_model(0, num_experts_per_token=8)


@pytest.fixture(scope="module")
def emulated_bf16(selection_free, tmp_path_factory):
    """A bf16 export on ONNX Runtime's CPU provider, its bf16 rounding emulated (`lowp`)."""
    out = tmp_path_factory.mktemp("lowp") / "bf16"
    export_onnx(selection_free, out, dtype="bf16")
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    onnx.save(emulate_low_precision(proto), str(out / "emulated.onnx"))
    return out


def _scenarios(model):
    return make_scenarios(model.config.vocab_size, prompt_len=8, steps=3, batch=1, which=("decode",))


def test_bf16_runtimes_pass_against_the_fp32_reference_with_bf16_tolerances(selection_free, emulated_bf16):
    reference = TorchRunner(selection_free)
    ort = OrtRunner(emulated_bf16, model_path=emulated_bf16 / "emulated.onnx", name="ort-bf16")
    torch_bf16 = TorchRunner(cast_model(selection_free, "bf16"), name="torch-bf16")
    result = validate(reference, [ort, torch_bf16], _scenarios(selection_free))
    assert result.passed, result.localisation
    assert result.reference_dtype == "float32"
    assert {n: t.dtype for n, t in result.runtime_tolerances.items()} == {"ort-bf16": "bfloat16",
                                                                        "torch-bf16": "bfloat16"}
    assert set(result.yardsticks) == {"ort-bf16", "torch-bf16"}  # the reference model in bf16 widened them
    # it is bf16 error, not fp32 round-off: the fp32 tolerances would fail it
    logits = [r.metrics.rms_rel for r in result.runs[0].records if r.tensor == "logits"]
    assert max(logits) > 1e-3


def test_a_planted_bug_in_a_bf16_runtime_still_fails(selection_free, emulated_bf16):
    reference = TorchRunner(selection_free)
    ort = OrtRunner(emulated_bf16, model_path=emulated_bf16 / "emulated.onnx", name="ort-bf16")
    bad = mu.TransposedStateRunner(ort, layers=[3], name="mutant")
    result = validate(reference, [bad], _scenarios(selection_free))
    assert not result.passed
    assert "layer 3" in result.localisation and "recurrent_state" in result.localisation


def test_cast_model_keeps_the_fp32_set_and_never_changes_the_callers_model(selection_free):
    low = cast_model(selection_free, "bf16")
    assert low is not selection_free and selection_free.get_input_embeddings().weight.dtype == torch.float32
    kinds = {n.rsplit(".", 1)[-1]: p.dtype for n, p in low.named_parameters()}
    assert kinds["A_log"] == torch.float32 and kinds["dt_bias"] == torch.float32
    assert low.get_input_embeddings().weight.dtype == torch.bfloat16
    assert cast_model(selection_free, "fp32") is selection_free


def test_a_report_written_before_reference_dtypes_still_reads(bf16_released, fp32_export, tmp_path):
    run = run_validation(bf16_released, runtimes=["ort"], onnx_dir=fp32_export, prompt_len=4, steps=1, batch=1,
                         report_path=tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    for key in ("reference_dtype", "runtime_dtypes", "runtime_tolerances", "yardsticks"):
        data.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = ValidationReport.read_file(tmp_path / "old.json")
    assert old.reference_dtype is None and old.runtime_dtypes == {}
    assert old.tolerances_of("ort") == old.tolerances
    assert run.report.passed == old.passed


def test_model_card_names_the_reference_dtype(bf16_released, fp32_export):
    from k3export import hub

    run_validation(bf16_released, runtimes=["ort"], onnx_dir=fp32_export, prompt_len=4, steps=1, batch=1)
    card = hub.plan_push(fp32_export, "alice/k3-onnx").card
    assert "reference: torch computing in float32; runtimes: ort in float32, each judged with the tolerances of " \
           "its own dtype" in card, card
