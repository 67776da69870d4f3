"""OpenVINO's stateful form (the carried state kept in the compiled model's variables, `openvino_runner`): step by
step equal to the stateless form and to the PyTorch model (logits, every state tensor, every layer's hidden state),
an earlier output never changed by a later step, saved / forked / rolled-back states resuming as PyTorch
recomputes the whole sequence, and two planted bugs (a forked state not written into the variables, a handed-out
state not copied before the request moves on) caught by the same checks."""

import logging
import unittest.mock

import numpy as np
import pytest

from k3export.artifacts import State
from k3export.runtime import Decoding, Target, TorchRunner, left_pad, make_runner, to_numpy
from k3export.runtime.speculate import verify
from k3export.validate import Tolerances
from k3export.validate.compare import compare

ov = pytest.importorskip("openvino")

from k3export.runtime import openvino_session  # noqa: E402 - after the skip: it needs openvino to be useful
from k3export.runtime.openvino_session import OpenVinoSession  # noqa: E402

TOL = Tolerances().for_kind("logits")  # the fp32 tolerance validate judges every tensor kind of an export with
#: stateful against stateless: one compiled graph, the state kept inside or fed: equal to fp32 rounding
CLOSE = 1e-5
PREFIX = np.array([[5, 9, 17, 33, 65, 129, 257]])
A, B = np.array([[7, 8, 9]]), np.array([[300, 301]])
OTHER = np.array([[11, 400, 3, 250, 60, 99, 128]])  # as long as PREFIX
DECODE_STEPS = 10


def _runners(inlined_dir):
    stateful = make_runner("openvino", Target(onnx_dir=inlined_dir))
    stateless = make_runner("openvino-stateless", Target(onnx_dir=inlined_dir))
    assert stateful.stateful and not stateless.stateful
    return stateful, stateless


def _tensors(out, real=None):
    """logits and hidden states (at the real positions of `real`, a left-padded batch), every state of a
    `StepOutput`, as float64 numpy."""
    def rows(x):
        return to_numpy(x)[real] if real is not None else to_numpy(x)

    got = {"logits": rows(out.logits)}
    got.update({k: to_numpy(v) for k, v in out.state.items()})
    got.update({f"hidden.{i}": rows(h) for i, h in enumerate(out.hidden or [])})
    return got


def _diffs(got, want, where, close=None):
    """The tensors of `got` that differ from `want`: within `close` (absolute), or failing the fp32 tolerance."""
    bad = []
    if set(got) != set(want):
        return [f"{where}: tensors {sorted(set(got) ^ set(want))[:3]} on one side only"]
    for name, ref in want.items():
        if close is not None:
            if got[name].shape != ref.shape or not np.allclose(got[name], ref, rtol=0, atol=close):
                bad.append(f"{where} {name}")
        elif not compare(got[name], ref, name, TOL).passed:
            bad.append(f"{where} {name}")
    return bad


def _decode_mismatches(tiny, stateful, stateless):
    """A left-padded batch of two prompts prefilled, then `DECODE_STEPS` greedy steps (the PyTorch model's tokens)
    on each runner. Every stateful output is kept and one state of it read while it is live; the rest is read
    after the loop, when later steps have moved the request on. Returns every mismatch, named."""
    rng = np.random.default_rng(3)
    ids, mask = left_pad([rng.integers(3, tiny.config.vocab_size, n).tolist() for n in (12, 9)],
                         pad_id=tiny.config.pad_token_id)
    real = mask.astype(bool)
    decodings = {"torch": Decoding(TorchRunner(tiny)), "sf": Decoding(stateful), "sl": Decoding(stateless)}
    kept = {name: [] for name in decodings}
    feed, feed_mask = ids, mask
    first = stateful.manifest.states[0].name
    early = []
    for step in range(DECODE_STEPS + 1):
        for name, d in decodings.items():
            out = d.feed(feed, feed_mask)
            kept[name].append((out, real if step == 0 else None))
            if name == "sf":
                early.append(np.array(out.state[first], copy=True))  # read while the variables hold it
        feed = to_numpy(kept["torch"][-1][0].logits)[:, -1].argmax(-1)[:, None].astype(np.int64)
        feed_mask = None
    bad = []
    for step in range(DECODE_STEPS + 1):
        (sf, rows), (sl, _), (ref, _) = kept["sf"][step], kept["sl"][step], kept["torch"][step]
        got = _tensors(sf, rows)
        bad += _diffs(got, _tensors(sl, rows), f"step {step} stateful vs stateless", close=CLOSE)
        bad += _diffs(got, _tensors(ref, rows), f"step {step} stateful vs pytorch")
        bad += _diffs(_tensors(sl, rows), _tensors(ref, rows), f"step {step} stateless vs pytorch")
        if not np.array_equal(early[step], got[first]):
            bad.append(f"step {step}: {first} changed after it was handed out")
    return bad


def test_stateful_equals_stateless_and_pytorch_at_every_step(tiny, inlined_dir):
    stateful, stateless = _runners(inlined_dir)
    assert _decode_mismatches(tiny, stateful, stateless) == []
    for runner in (stateful, stateless):  # exact numerics pinned on both forms
        compiled = runner.ov.compiled
        assert compiled.get_property("KV_CACHE_PRECISION") == ov.Type.f32
        assert compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 0
        assert compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    assert not stateful.ov.input_names.__contains__(stateful.manifest.states[0].name)  # no state is fed
    assert "stateful" in stateful.describe() and "stateless" in stateless.describe()


def test_a_state_not_copied_before_the_request_moves_on_is_caught(tiny, inlined_dir, monkeypatch):
    """Planted bug: the handed-out state stays bound to the variables (no copy when the request moves on), so a
    later step changes an earlier output; the step-by-step check names it."""
    monkeypatch.setattr(OpenVinoSession, "_move_on", lambda self: None)
    stateful, stateless = _runners(inlined_dir)
    bad = _decode_mismatches(tiny, stateful, stateless)
    assert any("stateful vs stateless" in b for b in bad) and any("stateful vs pytorch" in b for b in bad)


def _round_trip_mismatches(stateful, reference, tmp_path):
    """Resume, fork, load and roll back states on `stateful`; each result against `reference` (PyTorch) run over
    the whole sequence from scratch. Returns every mismatch or error, named by the case."""
    prefix = stateful.prefill(PREFIX)
    # rollback: a draft of one right token then a wrong one (the reference's greedy choices); verify feeds both,
    # then feeds the accepted token again from `prefix`
    vocab = reference.model.config.vocab_size
    cur = int(to_numpy(reference.prefill(PREFIX).logits)[0, -1].argmax())
    right = int(to_numpy(reference.prefill(np.array([[*PREFIX[0], cur]])).logits)[0, -1].argmax())
    after = int(to_numpy(reference.prefill(np.array([[*PREFIX[0], cur, right]])).logits)[0, -1].argmax())
    rolled = {}

    def rollback():
        accepted, _, rolled["out"], _ = verify(stateful, prefix, cur, [right, (after + 1) % vocab])
        assert accepted == 1, f"accepted {accepted} draft tokens, not 1"
        return rolled["out"]

    def then(*ids):
        return np.concatenate([PREFIX, *ids], axis=1)

    cases = [  # (case, every id its output covers, how to compute it), run in this order
        ("resume", then(A), lambda: stateful.prefill(A, prefix)),  # fed back as the variables hold it
        ("another prompt", OTHER, lambda: stateful.prefill(OTHER)),  # the variables: 7 other tokens
        ("fork", then(B), lambda: stateful.prefill(B, stateful.fork(prefix))),
        ("loaded", then(A), lambda: stateful.prefill(A, State.load(prefix.save(tmp_path / "p.k3state"), stateful))),
        ("resume again", then(B), lambda: stateful.prefill(B, prefix)),  # copied out when the request moved on
        ("rollback", then([[cur, right]]), rollback),
        ("step after the rollback", then([[cur, right, 5]]), lambda: stateful.step(np.array([5]), rolled["out"])),
    ]
    bad = []
    for case, whole, run in cases:
        try:
            out = run()
        except Exception as exc:  # noqa: BLE001 - a runner failing on a valid state is a mismatch too
            bad.append(f"{case}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        want = _tensors(reference.prefill(whole))
        new = out.logits.shape[1]  # the positions this call fed
        want.update({k: v[:, -new:] for k, v in want.items() if k == "logits" or k.startswith("hidden.")})
        bad += _diffs(_tensors(out), want, case)
        if out.tokens.tolist() != whole.tolist():
            bad.append(f"{case}: tokens {out.tokens.tolist()}")
    return bad


def test_resumed_forked_loaded_and_rolled_back_states_equal_a_pytorch_recompute(tiny, inlined_dir, tmp_path):
    stateful, _ = _runners(inlined_dir)
    assert _round_trip_mismatches(stateful, TorchRunner(tiny), tmp_path) == []


def test_decode_graph_equals_a_pytorch_recompute_through_resume_fork_load_and_rollback(tiny, inlined_dir,
                                                                                       tmp_path):
    """``openvino-decode-graph``: the same round trip, its prefills on the general model and its one-token steps
    (the step after the rollback, the rollback's re-feed of the accepted token) on the one-token model, the state
    moved between the two requests' variables at each switch."""
    runner = make_runner("openvino-decode-graph", Target(onnx_dir=inlined_dir))
    assert runner.stateful and runner.ov.one_token is not None
    assert _round_trip_mismatches(runner, TorchRunner(tiny), tmp_path) == []
    assert runner.ov._holder is runner.ov.one_token  # the last case was one token at batch 1


def test_decode_graph_runs_one_token_calls_and_equals_the_general_model(inlined_dir):
    """Step by step against the plain stateful runner: a prefill, greedy steps, a three-token call, more steps; a
    batch of two stays on the general model. Logits, every state and hidden state within validate's fp32 tolerance
    (two compiled models: the plugin picks kernels per shape, so not to the last bit)."""
    plain = make_runner("openvino", Target(onnx_dir=inlined_dir))
    fast = make_runner("openvino-decode-graph", Target(onnx_dir=inlined_dir))
    ov = fast.ov
    bad = []
    outs = {"plain": plain.prefill(PREFIX), "fast": fast.prefill(PREFIX)}
    assert ov._holder is not ov.one_token
    feeds = [np.array([[t]]) for t in (3, 4, 5)] + [A] + [np.array([[t]]) for t in (6, 7)]
    for i, ids in enumerate(feeds):
        outs = {k: (plain if k == "plain" else fast).prefill(ids, outs[k]) for k in outs}
        assert (ov._holder is ov.one_token) == (ids.shape[1] == 1), i
        bad += _diffs(_tensors(outs["fast"]), _tensors(outs["plain"]), f"call {i}")
    pair = np.concatenate([PREFIX, OTHER])
    two = {"plain": plain.prefill(pair), "fast": fast.prefill(pair)}
    two = {k: (plain if k == "plain" else fast).prefill(np.array([[3], [4]]), two[k]) for k in two}
    assert ov._holder is not ov.one_token
    bad += _diffs(_tensors(two["fast"]), _tensors(two["plain"]), "batch of two")
    assert bad == []


def test_a_state_not_moved_between_the_requests_is_caught(inlined_dir, monkeypatch):
    """Planted bug: the one-token request runs from whatever its variables held (the state is not moved over)."""
    class Stuck(dict):
        def items(self):
            return []

    runner = make_runner("openvino-decode-graph", Target(onnx_dir=inlined_dir))
    runner.ov.one_token.variables = Stuck(runner.ov.one_token.variables)
    plain = make_runner("openvino", Target(onnx_dir=inlined_dir))
    got, want = runner.prefill(PREFIX), plain.prefill(PREFIX)
    got, want = runner.prefill(np.array([[3]]), got), plain.prefill(np.array([[3]]), want)
    assert _diffs(_tensors(got), _tensors(want), "step")


def test_a_forked_state_not_written_into_the_variables_is_caught(tiny, inlined_dir, tmp_path, monkeypatch):
    """Planted bug: a given state of the shapes the variables hold is taken to be the one they hold and is not
    written in; the round trip names the fork (7 tokens of PREFIX given, 7 of another prompt held): same shapes,
    other values."""
    load = OpenVinoSession.load_state

    def skipping(self, state):
        held = {k: tuple(v.state.shape) for k, v in self._holder.variables.items()}
        if not self._loaded or any(held[k] != tuple(np.shape(state[k])) for k in held):
            load(self, state)

    monkeypatch.setattr(OpenVinoSession, "load_state", skipping)
    stateful, _ = _runners(inlined_dir)
    bad = _round_trip_mismatches(stateful, TorchRunner(tiny), tmp_path)
    assert any(b.startswith("fork logits") for b in bad), bad


class _CountingVariable:
    """An infer request's variable that counts the values written into it."""

    def __init__(self, variable):
        self.variable, self.writes = variable, 0

    @property
    def state(self):
        return self.variable.state

    @state.setter
    def state(self, value):
        self.writes += 1
        self.variable.state = value


def test_feeding_back_the_requests_own_state_writes_no_variable(inlined_dir):
    stateful, _ = _runners(inlined_dir)
    held = stateful.ov._holder
    variables = held.variables = {k: _CountingVariable(v) for k, v in held.variables.items()}

    def writes():
        return sum(v.writes for v in variables.values())

    n = len(stateful.manifest.states)
    out = stateful.prefill(PREFIX)
    assert writes() == n  # the initial (zero) state, written once
    for tok in (3, 4, 5):
        out = stateful.step(np.array([tok]), out)
    assert writes() == n  # each step fed the previous output as the variables hold it
    stateful.prefill(A, stateful.fork(out))
    assert writes() == 2 * n  # a fork is another state: written in
    with pytest.raises(TypeError):
        out.state["x"] = 0  # a handed-out state is read-only


def test_without_the_make_stateful_pass_one_line_is_logged_and_the_stateless_form_runs(tiny, inlined_dir,
                                                                                       monkeypatch, caplog):
    monkeypatch.setattr(openvino_session, "make_stateful", lambda graph, pairs: "MakeStateful is not here")
    with caplog.at_level(logging.WARNING, logger=openvino_session.__name__):
        runner = make_runner("openvino", Target(onnx_dir=inlined_dir))
    assert not runner.stateful and runner.ov.stateless_reason == "MakeStateful is not here"
    (record,) = caplog.records
    assert "MakeStateful is not here" in record.getMessage() and "stateless" in record.getMessage()
    assert "stateless" in runner.describe()
    out, ref = runner.prefill(PREFIX), TorchRunner(tiny).prefill(PREFIX)
    assert _diffs(_tensors(out), _tensors(ref), "fallback") == []


def test_properties_reach_the_compiled_model_and_an_unknown_one_is_refused(inlined_dir):
    """`properties` are compiled with (PERF_COUNT: the request then reports the operations it ran and their times;
    without it, every operation as not run); a property the device does not list is refused in one line naming
    it, before compiling."""
    from k3export.errors import K3ExportError
    from k3export.runtime.openvino_runner import OpenVinoRunner

    counted = OpenVinoRunner(inlined_dir, properties={"PERF_COUNT": True})
    counted.prefill(PREFIX)
    executed = [p for p in counted.ov.request.get_profiling_info() if p.status.name == "EXECUTED"]
    assert executed and sum(p.real_time.total_seconds() for p in executed) > 0
    plain = OpenVinoRunner(inlined_dir)
    plain.prefill(PREFIX)
    assert {p.status.name for p in plain.ov.request.get_profiling_info()} <= {"NOT_RUN"}
    with pytest.raises(K3ExportError, match="no property 'NOT_A_PROPERTY'"):
        OpenVinoRunner(inlined_dir, properties={"NOT_A_PROPERTY": 1})


def _resident(path) -> int:
    """Bytes of this process's mappings of `path` that are resident (/proc/self/smaps)."""
    import os

    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) >= 6 and os.path.realpath(head[5]) == os.path.realpath(path)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
def test_the_weights_read_while_compiling_are_not_kept_resident(tiny, inlined_dir):
    """Compiling reads every weight of the mapped data file (the plugin repacks the projections into its own memory);
    the session then drops the file's resident pages, so after compiling none is resident, a decode step faults in
    only what it reads, and the results are PyTorch's. A planted bug, the release skipped, keeps them resident."""
    data = sorted(inlined_dir.glob("model.onnx.data*"))
    assert data
    runner = make_runner("openvino", Target(onnx_dir=inlined_dir))
    assert runner.ov.released >= sum(p.stat().st_size for p in data) - 4096
    assert sum(_resident(p) for p in data) == 0
    with unittest.mock.patch.object(openvino_session, "release_mapped_pages", lambda files: 0):
        kept = OpenVinoSession(inlined_dir / "model.onnx")
    assert kept.released == 0 and sum(_resident(p) for p in data) > 0
    del kept
    got = runner.prefill(PREFIX)
    want = TorchRunner(tiny).prefill(PREFIX)
    assert compare(to_numpy(got.logits), to_numpy(want.logits), "logits", TOL).passed


def test_pages_are_released_while_compiling(monkeypatch):
    """While OpenVINO compiles (it reads every weight once: the build's peak) the mapped pages are released every
    `every` seconds, by a thread that is gone when the block ends; with no files, no thread."""
    import threading
    import time

    calls = []
    monkeypatch.setattr(openvino_session, "release_mapped_pages", lambda files: calls.append(set(files)) or 0)
    with openvino_session._releasing({"/x/model.onnx.data"}, every=0.01):
        time.sleep(0.2)
    assert len(calls) >= 5 and calls[0] == {"/x/model.onnx.data"}
    assert not [t for t in threading.enumerate() if t.name == "k3export-release-pages"]
    calls.clear()
    with openvino_session._releasing(set(), every=0.01):
        time.sleep(0.05)
    assert calls == []
