"""State scenarios: a kept, forked or rolled-back state, each proven equal to a fresh recompute.

    prefix_reuse  a prefix's state saved to a ``.k3state`` file and loaded back, then a continuation and decode steps
    multi_turn    three turns, each fed alone from the state of the turns before it; an edit of turn 2 resumed from the
                  last saved state at or before the change (`k3export.conversation.latest_prefix`), then a
                  regenerate of turn 3 from the state after the edited turn 2
    fork          two continuations of one state (the second from ``runner.fork`` of it after the first ran)
    rollback      speculative verify rounds (`k3export.runtime.speculate.verify`) with 0, 1 and all W draft tokens
                  accepted, the state kept at the accepted length (W: the export's state window, whose slots then
                  give that state with no second call; else `WINDOW`, and the accepted tokens are fed again)

Every check compares the runtime's logits over the tokens it was just fed, and every state tensor, with the
reference's ONE fresh prefill over the whole sequence those cover. Two faults are named outright, besides the
first diverging layer: a runtime that changed the state it was given (its value after the call differs from a copy
taken before: ``input state changed in place``), and a resume from a state past the change (``rolled back past
the change``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3export.runtime.base import Runner, StepOutput, to_numpy

from .compare import Metrics, Tolerances
from .scenarios import Scenario, random_prompts

STATE_SCENARIOS = ("prefix_reuse", "multi_turn", "fork", "rollback")
WINDOW = 3  # draft tokens per verify round of the rollback scenario, without a state window


@dataclass
class StatePlan:
    """The token segments of a state scenario (ids [1, n] each) and the rollback rule it resumes by."""

    segments: list[np.ndarray]
    pick: Callable[[list[StepOutput], list[int]], StepOutput | None] | None = None  # None: `latest_prefix`


def state_scenarios(vocab_size: int, *, prompt_len: int = 16, seed: int = 0,
                    which: tuple[str, ...] = STATE_SCENARIOS) -> list[Scenario]:
    """The state scenarios over seeded prompts (batch 1)."""
    rng = np.random.default_rng(seed + 31337)
    low = 3 if vocab_size > 16 else 0

    def seg(n: int) -> np.ndarray:
        return rng.integers(low, vocab_size, size=(1, n), dtype=np.int64)

    prefix = random_prompts(1, max(prompt_len, 4), vocab_size, seed + 11)
    out = []
    for name in which:
        if name == "prefix_reuse":
            segments = [prefix, seg(5)]
        elif name == "multi_turn":
            turn2 = seg(6)
            edited = turn2.copy()
            edited[0, 3] = (edited[0, 3] + 1 - low) % (vocab_size - low) + low  # the edit: turn 2's 4th token
            segments = [prefix, turn2, seg(4), edited]
        elif name == "fork":
            segments = [prefix, seg(4), seg(3)]
        else:
            segments = [prefix]
        out.append(Scenario(name, np.concatenate(segments[:2] if len(segments) > 1 else segments, axis=1), 3,
                            plan=StatePlan(segments)))
    return out


class _Checks:
    """Compares a runtime's outputs with the reference's fresh recompute, recording as `core` does."""

    def __init__(self, reference: Runner, manifest: Any, tols: Tolerances, res: Any, record: Any) -> None:
        self.reference, self.manifest, self.tols, self.res, self.record = reference, manifest, tols, res, record
        self.labels: dict[int, str] = {}
        self.named: list[str] = []

    def fresh(self, tokens: np.ndarray) -> StepOutput:
        return self.reference.prefill(tokens)

    def check(self, label: str, out: StepOutput, expect: list[int] | None = None) -> StepOutput:
        """`out` (its logits over the tokens just fed, its state) against a fresh run over the sequence it should
        cover: `expect`, default the tokens it says it covers."""
        step = len(self.labels)
        self.labels[step] = label
        fresh = self.fresh(out.tokens if expect is None else np.asarray([expect], np.int64))
        n = int(np.shape(out.logits)[1])
        ref = StepOutput(logits=to_numpy(fresh.logits)[:, -n:], state=fresh.state)
        self.record.compare_step(self.res, ref, StepOutput(logits=out.logits, state=out.state), step,
                                 out.tokens.shape[1] - 1, self.manifest, self.tols)
        return fresh

    def untouched(self, label: str, given: StepOutput, copy: dict[str, np.ndarray]) -> None:
        """Fail, naming the tensor, when the runtime changed the state it was given."""
        for s in self.manifest.states:
            now = to_numpy(given.state[s.name])
            if not np.array_equal(now, copy[s.name]):
                m = Metrics(float(np.abs(now - copy[s.name]).max()), np.inf, np.inf, 0.0, 0.0, True, passed=False,
                            reason=f"input state changed in place by the call ({label})")
                self.res.records.append(self.record.tensor_record(self.res.runtime, self.res.scenario,
                                                                  len(self.labels), int(given.tokens.shape[1]) - 1,
                                                                  s.name, s.group, s.layer, m))
                self.named.append(f"{self.res.scenario} {label}: the runtime changed its input state in place "
                                  f"({s.name})")
                return

    def resumed(self, label: str, start: StepOutput | None, ids: list[int]) -> None:
        """Fail when the state resumed from covers a token the new sequence does not have."""
        if start is None:
            return
        covered = start.tokens[0].tolist()
        if ids[:len(covered)] != covered:
            agree = next(i for i, (a, b) in enumerate(zip(covered, ids)) if a != b)
            self.named.append(f"{self.res.scenario} {label}: rolled back past the change (resumed from a state of "
                              f"{len(covered)} tokens; the new sequence differs from token {agree})")


def _snapshot(out: StepOutput, manifest: Any) -> dict[str, np.ndarray]:
    return {s.name: to_numpy(out.state[s.name]).copy() for s in manifest.states}


def run_state_scenario(reference: Runner, runner: Runner, sc: Scenario, manifest: Any, tols: Tolerances, res: Any,
                       record: Any) -> tuple[list[str], dict[int, str]]:
    """Drive `runner` through state scenario `sc`, recording every check in `res` (a `core.RunResult`) through
    `record` (``compare_step`` and ``tensor_record``: the validation loop's own, handed in by `core`); returns the
    faults named outright (`_Checks.untouched`, `_Checks.resumed`) and the label of each checked step."""
    from k3export.conversation import latest_prefix
    from k3export.runtime.speculate import verify

    plan: StatePlan = sc.plan
    c = _Checks(reference, manifest, tols, res, record)
    seg = plan.segments
    if sc.name == "prefix_reuse":
        from k3export.artifacts import State

        prefix = runner.prefill(seg[0])
        with tempfile.TemporaryDirectory(prefix="k3export-validate-") as tmp:
            state = State.load(prefix.save(Path(tmp) / "prefix.k3state"), runner)
        out = runner.prefill(seg[1], state)
        fresh = c.check("continuation of a saved prefix", out)
        for k in range(1, sc.steps + 1):
            tok = to_numpy(fresh.logits[:, -1], np.float32).argmax(-1).astype(np.int64)[:, None]
            out = runner.prefill(tok, out)
            fresh = c.check(f"decode step {k} after the prefix", out)
    elif sc.name == "fork":
        prefix = runner.prefill(seg[0])
        copy = _snapshot(prefix, manifest)
        c.check("fork A", runner.prefill(seg[1], prefix))
        c.untouched("fork A", prefix, copy)
        c.check("fork B", runner.prefill(seg[2], runner.fork(prefix)))
        c.check("fork A again", runner.prefill(seg[1], prefix))
    elif sc.name == "multi_turn":
        pick = plan.pick or latest_prefix
        saved: list[StepOutput] = []
        out = None
        for n, turn in enumerate(seg[:3], 1):
            out = runner.prefill(turn, out)
            saved.append(out)
            c.check(f"turn {n}", out)
        for label, turns in (("edit of turn 2", [seg[0], seg[3], seg[2]]), ("regenerate of turn 3",
                                                                            [seg[0], seg[3], seg[2]])):
            ids = np.concatenate(turns, axis=1)[0].tolist()
            start = pick(saved, ids)
            c.resumed(label, start, ids)
            past = 0 if start is None else int(start.tokens.shape[1])
            copy = None if start is None else _snapshot(start, manifest)
            if label.startswith("edit"):  # the edited turn 2 first: a state at its end is saved for the regenerate
                cut = len(np.concatenate(turns[:2], axis=1)[0])
                if past < cut:
                    mid = runner.prefill(np.asarray([ids[past:cut]]), start)
                    saved = [s for s in saved if s.tokens.shape[1] <= past] + [mid]
                    out = runner.prefill(np.asarray([ids[cut:]]), mid)
                else:
                    out = runner.prefill(np.asarray([ids[past:]]), start)
            else:
                out = runner.prefill(np.asarray([ids[past:]]), start)
            if start is not None:
                c.untouched(label, start, copy)  # type: ignore[arg-type]
            c.check(label, out, ids)
    elif sc.name == "rollback":
        prefix = runner.prefill(seg[0])
        truth = c.fresh(seg[0])
        cur = int(to_numpy(truth.logits[:, -1], np.float32).argmax())
        greedy = [cur]
        out = truth
        window = runner.manifest.state_window
        W = window or WINDOW
        how = "state window" if window else "accepted tokens fed again"
        for _ in range(W):  # the reference's greedy continuation: what a draft is right about
            out = reference.prefill(np.asarray([[greedy[-1]]]), out)
            greedy.append(int(to_numpy(out.logits[:, -1], np.float32).argmax()))
        for accepted in sorted({0, 1, W}):
            proposal = greedy[1:W + 1]
            if accepted < W:
                proposal[accepted] = (proposal[accepted] + 1) % int(np.shape(truth.logits)[-1])
            copy = _snapshot(prefix, manifest)
            a, _, kept, calls = verify(runner, prefix, cur, proposal)
            c.untouched(f"verify, {accepted} accepted", prefix, copy)
            if a != accepted:
                c.named.append(f"rollback: {a} draft tokens accepted where greedy decoding agrees with {accepted}")
            elif window and calls != 1:
                c.named.append(f"rollback: {calls} calls for a verify round with {accepted} of {W} accepted; the "
                               "state window should have taken the rejected tokens back")
            c.check(f"state after verify with {accepted} of {W} accepted ({how})", kept)
    return c.named, c.labels


__all__ = ["STATE_SCENARIOS", "StatePlan", "WINDOW", "run_state_scenario", "state_scenarios"]
