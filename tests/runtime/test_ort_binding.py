"""ONNX Runtime's IO-bound decode (`OrtRunner(bind=True)`, `OrtSession.run_bound`): the same numbers as the tiny
model's float64 forward, a state the caller keeps is never written over, and a constant-size state alternates
between two buffers while a growing one is not kept."""

import numpy as np
import pytest

from k3export.runtime import to_numpy
from k3export.runtime.loop import Decoding
from k3export.runtime.ort_runner import OrtRunner
from k3export.runtime.ort_session import OutputBuffers


@pytest.fixture(scope="module")
def tiny64(tiny):
    import copy

    return copy.deepcopy(tiny).double()


def _reference(model, ids):
    """The tiny model in float64, prefill then one token at a time: logits of every call."""
    import torch

    from k3export.modeling import K3Cache

    cache = K3Cache(model.config)
    out = []
    with torch.no_grad():
        for chunk in (ids[:, :5], *(ids[:, i:i + 1] for i in range(5, ids.shape[1]))):
            out.append(model(torch.as_tensor(chunk), cache=cache).logits.numpy())
    return out


def test_bound_decode_matches_float64_and_keeps_held_states(export_dir, tiny64):
    ids = np.random.default_rng(3).integers(3, 500, (2, 9))
    ref = _reference(tiny64, ids)
    runner = OrtRunner(export_dir)
    assert runner.bind
    d = Decoding(runner)
    got = [d.feed(ids[:, :5])]
    held = {k: np.array(v) for k, v in got[0].state.items()}  # what the prefill returned, copied
    kept = got[0].state  # and the arrays themselves, kept by the caller as a rollback point would be
    for i in range(5, ids.shape[1]):
        got.append(d.feed(ids[:, i:i + 1]))
    for r, o in zip(ref, got):
        np.testing.assert_allclose(to_numpy(o.logits), r, rtol=0, atol=2e-4)
    for name, value in kept.items():  # four steps later, the kept state is what the prefill returned
        assert np.array_equal(value, held[name]), name
    again = Decoding(runner, kept).feed(ids[:, 5:6])  # and resuming from it gives the first step's logits
    np.testing.assert_array_equal(again.logits, got[1].logits)


def test_bound_and_unbound_runs_agree(export_dir):
    ids = np.random.default_rng(4).integers(3, 500, (1, 6))
    runs = []
    for bind in (True, False):
        runner = OrtRunner(export_dir, bind=bind)
        runner.logits_to_keep = 1
        d = Decoding(runner)
        outs = [d.feed(ids[:, :4]), d.feed(ids[:, 4:5]), d.feed(ids[:, 5:6])]
        runs.append(outs)
    for a, b in zip(*runs):
        assert a.logits.shape == b.logits.shape == (1, 1, b.logits.shape[-1])
        np.testing.assert_array_equal(a.logits, b.logits)
        for name in b.state:
            np.testing.assert_array_equal(a.state[name], b.state[name])


def test_output_buffers_reuse_only_free_buffers():
    pool = OutputBuffers()
    a = pool.take("s", (2, 3), np.float32)
    b = pool.take("s", (2, 3), np.float32)
    assert a is not b  # `a` is still held
    freed = id(a)
    del a
    c = pool.take("s", (2, 3), np.float32)
    assert id(c) == freed  # two steps back and let go of: written again
    view = c[1:]
    del c
    d = pool.take("s", (2, 3), np.float32)
    assert d is not b and d is not view.base  # a view keeps its base referenced
    grown = [pool.take("kv", (1, n, 4), np.float32) for n in range(1, 5)]
    assert [x.shape for x in pool._pool["kv"]] == [(1, 4, 4)]  # a growing state's older buffers are not kept
    assert grown[-1] is pool._pool["kv"][0]


def test_threads_spin_only_while_the_machine_has_cores_for_them(export_dir, monkeypatch):
    import os

    from k3export.artifacts import load_export
    from k3export.runtime.ort_session import SPIN_KEY, OrtSession, spinning_pays

    import k3export.runtime.ort_session as ort_session

    cpus = os.cpu_count() or 1
    monkeypatch.setattr(ort_session, "outside_cores", lambda: 0.0)
    assert spinning_pays(cpus) and not spinning_pays(cpus + 1)
    model = load_export(export_dir).model_path
    quiet = OrtSession(model, threads=1)
    monkeypatch.setattr(ort_session, "outside_cores", lambda: float(cpus))  # every core busy
    assert not spinning_pays(1)
    busy = OrtSession(model, threads=1)
    assert quiet.spinning and not busy.spinning
    assert busy.session.get_session_options().get_session_config_entry(SPIN_KEY) == "0"


def test_an_optional_input_fed_once_is_not_kept_bound(export_dir):
    """``logits_to_keep`` fed on one call and not on the next (speculation's verify after a decode step): the next
    call gets every position's logits, as the unbound path gives them."""
    import numpy as np

    from k3export.runtime import OrtRunner

    bound, plain = OrtRunner(export_dir), OrtRunner(export_dir, bind=False)
    ids = np.arange(3, 8)[None]
    for keep in (1, 0, 1, 0):
        bound.logits_to_keep = plain.logits_to_keep = keep
        a, b = bound.prefill(ids), plain.prefill(ids)
        assert a.logits.shape == b.logits.shape == (1, 1 if keep else 5, a.logits.shape[-1])
        np.testing.assert_array_equal(a.logits, b.logits)


def test_outside_cores_sees_another_process_and_not_this_one(monkeypatch):
    """`outside_cores` counts another process's busy core and leaves this process's own work out (the load average
    counted both)."""
    import subprocess
    import sys

    import k3export.runtime.ort_session as ort_session

    if ort_session.outside_cores() is None:
        pytest.skip("no /proc/stat here")
    monkeypatch.setattr(ort_session, "OUTSIDE_REUSE_S", 0.0)
    monkeypatch.setattr(ort_session, "OUTSIDE_WINDOW_S", 0.5)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.2)
        busy = ort_session.outside_cores()
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy >= 0.6, busy
    import threading

    stop = threading.Event()

    def spin() -> None:  # this process's own work: not outside
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        own = ort_session.outside_cores()
    finally:
        stop.set()
        worker.join()
    assert own is not None and own < busy - 0.5, (own, busy)
