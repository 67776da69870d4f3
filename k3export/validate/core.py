"""The validation loop: drive the reference and every runtime through each scenario in lockstep, compare.

At every step (the prefill is step 0) the runtime's logits, every carried state tensor (by manifest name)
and, when both sides expose them, the per-layer hidden states are compared with the reference's. Each
runtime feeds back ITS OWN state; the tokens are the reference's greedy choice. A failing run with images is
localised in the vision tower first (`localise.localise_vision`), stage by stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from k3export.artifacts import StateManifest
from k3export.runtime.base import Runner, StepOutput, to_numpy
from k3export.runtime.loop import Decoding, next_tokens, with_images

from .compare import Metrics, Tolerance, Tolerances, compare, judging_dtype
from .localise import localise, localise_vision
from .scenarios import Scenario
from .text_quality import QualityRun


@dataclass
class TensorRecord:
    runtime: str
    scenario: str
    step: int  # 0 = prefill, then decode steps
    position: int  # sequence position of the last token of this call
    tensor: str  # "logits", a manifest state name, or "hidden_states.{i}"
    kind: str  # logits | hidden | conv_state | recurrent_state | latent
    layer: int | None
    metrics: Metrics


@dataclass
class RunResult:
    """Everything measured for one (runtime, scenario)."""

    runtime: str
    scenario: str
    records: list[TensorRecord] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)  # per (step, sequence): runtime argmax == reference argmax
    steps_run: int = 0
    seconds: float = 0.0
    error: str | None = None  # the runtime raised: counts as a failure
    localisation: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and all(r.metrics.passed for r in self.records)


@dataclass
class ValidationResult:
    reference: str
    runtimes: list[str]
    runtime_descriptions: dict[str, str]
    scenarios: list[Scenario]
    tolerances: Tolerances  # at the reference's dtype; `runtime_tolerances` judged each runtime
    runs: list[RunResult]
    skipped: dict[str, str] = field(default_factory=dict)  # runtime -> why it did not run
    reference_dtype: str = "float32"
    runtime_dtypes: dict[str, str] = field(default_factory=dict)  # runtime -> the dtype it computes in
    runtime_tolerances: dict[str, Tolerances] = field(default_factory=dict)  # runtime -> what judged it
    yardsticks: dict[str, str] = field(default_factory=dict)  # runtime -> the yardstick that widened them
    #: ``validate --quality``: runtime -> its figures over the text and their verdict (`text_quality.run_quality`)
    quality: dict[str, QualityRun] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return (bool(self.runs) or bool(self.quality)) and all(r.passed for r in self.runs) and \
            all(q.passed for q in self.quality.values())

    @property
    def localisation(self) -> str | None:
        lines = [f"{r.runtime}/{r.scenario}: {r.localisation}" for r in self.runs if not r.passed and r.localisation]
        lines += [f"{q.runtime}/quality: {'; '.join(q.reasons)}" for q in self.quality.values() if not q.passed]
        return "; ".join(lines) if lines else None


def _cat(outs: list[StepOutput]) -> StepOutput:
    """Concatenate chunked-prefill outputs along time (the state is the last chunk's)."""
    logits = np.concatenate([to_numpy(o.logits) for o in outs], axis=1)
    hidden = None
    if all(o.hidden is not None for o in outs):
        hidden = [np.concatenate([to_numpy(o.hidden[i]) for o in outs], axis=1) for i in range(len(outs[0].hidden))]
    return StepOutput(logits=logits, state=outs[-1].state, hidden=hidden)


#: a runtime computing in a narrower dtype than the reference may differ from it by this many times what the
#: reference model itself differs by when run in that dtype (its yardstick), tensor by tensor and step by step
YARDSTICK_FACTOR = 2.0


class Judge:
    """The tolerance of each tensor of one runtime: the defaults of its judging dtype (with the user's overrides),
    widened to `YARDSTICK_FACTOR` x the yardstick's largest error on the same tensor up to the same step when the
    runtime computes in a narrower dtype than the reference. Static bf16 tolerances cannot do this job: how far bf16
    arithmetic drifts from fp32 depends on the model (a random tiny K3 drifts to 0.1 in its logits within 16
    steps, selection-free; a routing flip makes it O(1)), while the model's own bf16 run drifts the same way."""

    def __init__(self, tolerances: Tolerances, yardstick: RunResult | None = None) -> None:
        self.tolerances = tolerances
        self.yardstick = yardstick
        self._worst: dict[tuple[int, str], tuple[float, float]] = {}  # (step, tensor) -> (rms_rel, max_abs_rel)
        self._last: dict[str, tuple[float, float]] = {}
        self._seen = 0

    def __call__(self, step: int, tensor: str, kind: str) -> Tolerance:
        tol = self.tolerances.for_kind(kind)
        if self.yardstick is None:
            return tol
        for r in self.yardstick.records[self._seen:]:  # its records come in step order
            m = r.metrics
            if m.finite:
                before = self._last.get(r.tensor, (0.0, 0.0))
                self._last[r.tensor] = (max(before[0], m.rms_rel), max(before[1], m.max_abs / max(m.ref_max, 1e-30)))
                self._worst[(r.step, r.tensor)] = self._last[r.tensor]
        self._seen = len(self.yardstick.records)
        worst = self._worst.get((step, tensor))
        if worst is None:
            return tol
        return replace(tol, rms_rel=max(tol.rms_rel, YARDSTICK_FACTOR * worst[0]),
                       max_abs_rel=max(tol.max_abs_rel, YARDSTICK_FACTOR * worst[1]))


def _compare_step(run: RunResult, ref: StepOutput, out: StepOutput, step: int, position: int,
                  manifest: StateManifest, judge: Judge, kept: StateManifest) -> None:
    """`out` against `ref` (whose states are laid out as `manifest`'s, the contract's); `kept`: the runtime's own
    manifest, which says how its export keeps each state (`StateEntry.to_contract`)."""
    order = kept.by_name()

    def add(tensor: str, kind: str, layer: int | None, x: Any, r: Any) -> None:
        m = compare(to_numpy(x), to_numpy(r), kind, judge(step, tensor, kind))
        run.records.append(TensorRecord(run.runtime, run.scenario, step, position, tensor, kind, layer, m))

    add("logits", "logits", None, out.logits, ref.logits)
    for s in manifest.states:
        if s.name not in out.state:
            run.records.append(TensorRecord(run.runtime, run.scenario, step, position, s.name, s.group, s.layer,
                                            Metrics(np.inf, np.inf, np.inf, 0.0, 0.0, False, passed=False,
                                                    reason="state missing from the runtime's output")))
            continue
        add(s.name, s.group, s.layer, order.get(s.name, s).to_contract(out.state[s.name]), ref.state[s.name])
    if ref.hidden is not None and out.hidden is not None:
        for i, (x, r) in enumerate(zip(out.hidden, ref.hidden)):
            add(f"hidden_states.{i}", "hidden", i, x, r)
    run.greedy.extend((next_tokens(ref) == next_tokens(out)).tolist())


def _localise(res: RunResult, reference: Runner, runner: Runner, sc: Scenario, manifest: StateManifest,
              tols: Tolerances) -> str | None:
    """The text localisation (`localise`), or, in a scenario with images, the first diverging vision stage when
    there is one (the text layers after it only inherit its error)."""
    text = localise(res.records, manifest)
    if sc.images is None:
        return text
    try:
        vision = localise_vision(reference, runner, sc.images, tols)
    except Exception as exc:  # noqa: BLE001 - the run has failed already; say why its vision was not localised
        return f"{text} [vision stages not compared: {type(exc).__name__}: {exc}]"
    return vision if vision is not None else text


def _yardsticks(reference: Runner, dtypes: set[str]) -> dict[str, Runner]:
    """The reference model run in each of `dtypes` (`Judge`), when the reference is a PyTorch model."""
    model = getattr(reference, "model", None)
    if model is None or not dtypes:
        return {}
    from k3export.runtime.torch_runner import TorchRunner, cast_model

    return {dt: TorchRunner(cast_model(model, dt), name=f"{reference.name} in {dt} (yardstick)",
                            device=str(reference.device), hidden=reference.hidden) for dt in sorted(dtypes)}


def _state_run(reference: Runner, runner: Runner, sc: Scenario, manifest: StateManifest,
               tols: Tolerances) -> RunResult:
    """One runtime through a state scenario (`state_scenarios.run_state_scenario`), localised: the faults it names
    outright first, else the first diverging layer at the first failing check."""
    from .state_scenarios import run_state_scenario

    res = RunResult(runner.name, sc.name)
    t0 = time.perf_counter()
    named: list[str] = []
    labels: dict[int, str] = {}
    try:
        def compare_step(*args: Any) -> None:  # judged with the runtime's tolerances (no yardstick here)
            _compare_step(*args[:-1], Judge(args[-1]), runner.manifest)

        record = SimpleNamespace(compare_step=compare_step, tensor_record=TensorRecord)
        named, labels = run_state_scenario(reference, runner, sc, manifest, tols, res, record)
        res.steps_run = len(labels)
    except Exception as exc:  # noqa: BLE001 - any runtime failure is a validation failure
        res.error = f"{type(exc).__name__}: {exc}"
    res.seconds = time.perf_counter() - t0
    if named:
        res.records.append(TensorRecord(res.runtime, sc.name, len(labels), -1, "state rule", "logits", None,
                                        Metrics(np.inf, np.inf, np.inf, 0.0, 0.0, True, passed=False,
                                                reason=named[0])))
    if not res.passed:
        failing = [r.step for r in res.records if not r.metrics.passed]
        text = localise([r for r in res.records if r.tensor != "state rule"], manifest)
        at = f"{sc.name} at {labels[min(failing)]!r}: " if failing and min(failing) in labels else ""
        res.localisation = res.error or "; ".join([*named, *([at + text] if text else [])])
    return res


def validate(reference: Runner, runners: list[Runner], scenarios: list[Scenario],
             tolerances: Tolerances | None = None, skipped: dict[str, str] | None = None,
             progress: Any = None) -> ValidationResult:
    """Run every scenario; return all measurements (`ValidationResult.passed` is the verdict).

    A runtime that raises while running is recorded as failed with its error (fail closed). Each runtime is
    judged with `tolerances` at its `judging_dtype` (its own dtype, or the reference's when that is coarser).
    `progress(msg)` is called between scenarios when given.
    """
    tols = (tolerances or Tolerances()).at(reference.manifest.dtype)
    manifest = reference.manifest
    names = [r.name for r in runners]
    if len(set(names)) != len(names):
        raise ValueError(f"runtime names must be unique, got {names}")
    judged = {r.name: tols.at(judging_dtype(manifest.dtype, r.manifest.dtype)).for_runtime(r.tolerances)
              for r in runners}
    yardsticks = _yardsticks(reference, {t.dtype for t in judged.values()} - {manifest.dtype})
    runs: list[RunResult] = []
    for sc in scenarios:
        if sc.plan is not None:  # a state scenario: its own driver, the same records
            if progress:
                progress(f"scenario {sc.name}: a kept / forked / rolled-back state against a fresh recompute")
            runs += [_state_run(reference, r, sc, manifest, judged[r.name]) for r in runners]
            continue
        if progress:
            progress(f"scenario {sc.name}: batch {sc.batch}, prefill {sc.prompt_len}, {sc.steps} decode steps")
        results = {r.name: RunResult(r.name, sc.name) for r in [*yardsticks.values(), *runners]}
        judges = {y.name: Judge(tols.at(dt)) for dt, y in yardsticks.items()}
        for r in runners:
            y = yardsticks.get(judged[r.name].dtype)
            judges[r.name] = Judge(judged[r.name], results[y.name] if y is not None else None)
        ref = Decoding(with_images(reference, sc.images))
        t_ref = ref.feed(sc.prompts)
        position = sc.prompt_len - 1
        active: dict[str, Decoding] = {}
        for r in [*yardsticks.values(), *runners]:  # a yardstick's error at a step is known before it is needed
            res = results[r.name]
            t0 = time.perf_counter()
            try:
                d = Decoding(with_images(r, sc.images))  # a runner that cannot take images fails this scenario
                if sc.chunks:
                    bounds = np.cumsum([0, *sc.chunks])
                    out = _cat([d.feed(sc.prompts[:, a:b]) for a, b in zip(bounds, bounds[1:])])
                else:
                    out = d.feed(sc.prompts)
                _compare_step(res, t_ref, out, 0, position, manifest, judges[r.name], r.manifest)
                active[r.name] = d
            except Exception as exc:  # noqa: BLE001 - any runtime failure is a validation failure
                res.error = f"{type(exc).__name__}: {exc}"
            res.seconds += time.perf_counter() - t0
        for step in range(1, sc.steps + 1):
            position += 1
            tokens = next_tokens(t_ref)[:, None]  # the reference's greedy choice, fed to every runtime
            t_ref = ref.feed(tokens)
            for name, d in list(active.items()):
                if d.runner.max_steps is not None and step > d.runner.max_steps:
                    active.pop(name)
                    continue
                res = results[name]
                t0 = time.perf_counter()
                try:
                    _compare_step(res, t_ref, d.feed(tokens), step, position, manifest, judges[name],
                                  d.runner.manifest)
                    res.steps_run = step
                except Exception as exc:  # noqa: BLE001
                    res.error = f"{type(exc).__name__} at decode step {step}: {exc}"
                    active.pop(name)
                res.seconds += time.perf_counter() - t0
        by_name = {r.name: r for r in runners}
        for y in yardsticks.values():
            failed = results.pop(y.name).error  # then the runtimes of its dtype get the plain defaults
            if failed and progress:
                progress(f"yardstick {y.describe()} failed: {failed}")
        for res in results.values():
            if not res.passed:
                res.localisation = res.error or _localise(res, reference, by_name[res.runtime], sc, manifest,
                                                          judged[res.runtime])
            runs.append(res)
    return ValidationResult(reference=reference.name, runtimes=names,
                            runtime_descriptions={r.name: r.describe() for r in [reference, *runners]},
                            scenarios=scenarios, tolerances=tols, runs=runs, skipped=dict(skipped or {}),
                            reference_dtype=manifest.dtype,
                            runtime_dtypes={r.name: r.manifest.dtype for r in runners}, runtime_tolerances=judged,
                            yardsticks={r.name: yardsticks[t.dtype].describe() for r, t in
                                        zip(runners, judged.values()) if t.dtype in yardsticks})


__all__ = ["RunResult", "TensorRecord", "ValidationResult", "validate"]
