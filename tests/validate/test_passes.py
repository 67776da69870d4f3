"""A correct export passes: torch vs ONNX Runtime and torch vs the Triton kernels on the tiny model."""

import pytest

from k3export.runtime import OrtRunner, RuntimeUnavailable, TorchRunner, TritonRunner, triton_status
from k3export.validate import Tolerances, make_scenarios, validate


def test_torch_vs_ort_prefill16_decode32_chunked_batch2(tiny, onnx_dir, reference):
    scenarios = make_scenarios(tiny.config.vocab_size, prompt_len=16, steps=32, batch=2, seed=0)
    assert [s.name for s in scenarios] == ["decode", "chunked_prefill", "batch"]
    ort = OrtRunner(onnx_dir)
    result = validate(reference, [ort], scenarios)
    assert result.passed, result.localisation
    assert result.localisation is None
    by = {(r.runtime, r.scenario): r for r in result.runs}
    assert by[("ort", "decode")].steps_run == 32 and by[("ort", "batch")].steps_run == 32
    assert all(all(r.greedy) for r in result.runs)
    worst = max(rec.metrics.rms_rel for r in result.runs for rec in r.records)
    assert worst < Tolerances().for_kind("logits").rms_rel / 10  # well inside the fp32 tolerance


def test_torch_chunked_prefill_equals_one_shot(tiny, reference):
    scenarios = make_scenarios(tiny.config.vocab_size, prompt_len=16, steps=4, seed=5, which=("chunked_prefill",))
    result = validate(reference, [TorchRunner(tiny)], scenarios)
    assert result.passed, result.localisation
    assert result.runs[0].records[0].metrics.rms_rel > 0  # really chunked (a different summation order)


@pytest.mark.skipif(triton_status("cpu") is not None, reason=f"triton runner unavailable: {triton_status('cpu')}")
def test_torch_vs_triton_small(tiny, reference):
    """Under TRITON_INTERPRET=1 a 16-token prefill costs ~10 s on 2 cores, so this scenario is small:
    prefill 8 + 3 decode steps, the same 8 tokens in chunks, batch 2 with 2 decode steps."""
    triton = TritonRunner(tiny, max_steps=3)
    scenarios = make_scenarios(tiny.config.vocab_size, prompt_len=8, steps=3, batch=2, seed=1, chunked_steps=1)
    scenarios[-1].steps = 2
    result = validate(reference, [triton], scenarios)
    assert result.passed, result.localisation
    assert [r.steps_run for r in result.runs] == [3, 1, 2]


def test_triton_runner_unavailable_is_clear(tiny, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if triton_status("cpu") is None:
        pytest.skip("TRITON_INTERPRET is read at import: cannot switch it off here")
    with pytest.raises(RuntimeUnavailable, match="triton runner: .*TRITON_INTERPRET|triton runner: .*triton"):
        TritonRunner(tiny)
