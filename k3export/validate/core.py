"""The validation loop: drive the reference and every runtime through each scenario in lockstep, compare.

At every step (the prefill is step 0) the runtime's logits, every carried state tensor (by manifest name)
and, when both sides expose them, the per-layer hidden states are compared with the reference's. Each
runtime feeds back ITS OWN state; the tokens are the reference's greedy choice. A failing run with images is
localised in the vision tower first (`localise.localise_vision`), stage by stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from k3export.artifacts import StateManifest
from k3export.runtime.base import Runner, StepOutput, to_numpy
from k3export.runtime.loop import Decoding, next_tokens, with_images

from .compare import Metrics, Tolerances, compare
from .localise import localise, localise_vision
from .scenarios import Scenario


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
    tolerances: Tolerances
    runs: list[RunResult]
    skipped: dict[str, str] = field(default_factory=dict)  # runtime -> why it did not run

    @property
    def passed(self) -> bool:
        return bool(self.runs) and all(r.passed for r in self.runs)

    @property
    def localisation(self) -> str | None:
        lines = [f"{r.runtime}/{r.scenario}: {r.localisation}" for r in self.runs if not r.passed and r.localisation]
        return "; ".join(lines) if lines else None


def _cat(outs: list[StepOutput]) -> StepOutput:
    """Concatenate chunked-prefill outputs along time (the state is the last chunk's)."""
    logits = np.concatenate([to_numpy(o.logits) for o in outs], axis=1)
    hidden = None
    if all(o.hidden is not None for o in outs):
        hidden = [np.concatenate([to_numpy(o.hidden[i]) for o in outs], axis=1) for i in range(len(outs[0].hidden))]
    return StepOutput(logits=logits, state=outs[-1].state, hidden=hidden)


def _compare_step(run: RunResult, ref: StepOutput, out: StepOutput, step: int, position: int,
                  manifest: StateManifest, tols: Tolerances) -> None:
    def add(tensor: str, kind: str, layer: int | None, x: Any, r: Any) -> None:
        m = compare(to_numpy(x), to_numpy(r), kind, tols.for_kind(kind))
        run.records.append(TensorRecord(run.runtime, run.scenario, step, position, tensor, kind, layer, m))

    add("logits", "logits", None, out.logits, ref.logits)
    for s in manifest.states:
        if s.name not in out.state:
            run.records.append(TensorRecord(run.runtime, run.scenario, step, position, s.name, s.group, s.layer,
                                            Metrics(np.inf, np.inf, np.inf, 0.0, 0.0, False, passed=False,
                                                    reason="state missing from the runtime's output")))
            continue
        add(s.name, s.group, s.layer, out.state[s.name], ref.state[s.name])
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
        record = SimpleNamespace(compare_step=_compare_step, tensor_record=TensorRecord)
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

    A runtime that raises while running is recorded as failed with its error (fail closed).
    `progress(msg)` is called between scenarios when given.
    """
    tols = tolerances or Tolerances(reference.manifest.dtype)
    manifest = reference.manifest
    names = [r.name for r in runners]
    if len(set(names)) != len(names):
        raise ValueError(f"runtime names must be unique, got {names}")
    runs: list[RunResult] = []
    for sc in scenarios:
        if sc.plan is not None:  # a state scenario: its own driver, the same records
            if progress:
                progress(f"scenario {sc.name}: a kept / forked / rolled-back state against a fresh recompute")
            runs += [_state_run(reference, r, sc, manifest, tols) for r in runners]
            continue
        if progress:
            progress(f"scenario {sc.name}: batch {sc.batch}, prefill {sc.prompt_len}, {sc.steps} decode steps")
        results = {r.name: RunResult(r.name, sc.name) for r in runners}
        ref = Decoding(with_images(reference, sc.images))
        t_ref = ref.feed(sc.prompts)
        position = sc.prompt_len - 1
        active: dict[str, Decoding] = {}
        for r in runners:
            res = results[r.name]
            t0 = time.perf_counter()
            try:
                d = Decoding(with_images(r, sc.images))  # a runner that cannot take images fails this scenario
                if sc.chunks:
                    bounds = np.cumsum([0, *sc.chunks])
                    out = _cat([d.feed(sc.prompts[:, a:b]) for a, b in zip(bounds, bounds[1:])])
                else:
                    out = d.feed(sc.prompts)
                _compare_step(res, t_ref, out, 0, position, manifest, tols)
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
                    _compare_step(res, t_ref, d.feed(tokens), step, position, manifest, tols)
                    res.steps_run = step
                except Exception as exc:  # noqa: BLE001
                    res.error = f"{type(exc).__name__} at decode step {step}: {exc}"
                    active.pop(name)
                res.seconds += time.perf_counter() - t0
        by_name = {r.name: r for r in runners}
        for res in results.values():
            if not res.passed:
                res.localisation = res.error or _localise(res, reference, by_name[res.runtime], sc, manifest, tols)
            runs.append(res)
    return ValidationResult(reference=reference.name, runtimes=names,
                            runtime_descriptions={r.name: r.describe() for r in [reference, *runners]},
                            scenarios=scenarios, tolerances=tols, runs=runs, skipped=dict(skipped or {}))


__all__ = ["RunResult", "TensorRecord", "ValidationResult", "validate"]
