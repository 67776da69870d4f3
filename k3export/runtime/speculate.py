"""Speculative decoding with exact rollback, on any runner: a draft proposes k tokens, the runner verifies them in
one call (the decoder takes N tokens and returns N logits), and the accepted tokens are exactly greedy decoding's.

    result = speculative_decode(runner, prompt_ids, max_new=64, eos={2}, draft=PromptLookup())
    result.tokens        the tokens plain greedy decoding would give, token for token
    result.calls         runner calls (verify + rollback re-feeds); result.accepted: draft tokens accepted

One round: the state S covers every token so far but the pending one ``cur`` (the greedy choice after them). The
runner runs ``[cur, d1 .. dk]`` from S; its logits at each position give the greedy choices ``g0 .. gk``; the draft
tokens are accepted while ``d(j+1) == gj``. Rollback rule: when all k are accepted the verify call's state is the
state at the accepted length. Otherwise, on an export with a state window of at least k (``export --state-window
W``), the verify call's output taken back by the k - a rejected tokens (`StepOutput.rolled_back`: the window's
slot for the KDA states, the MLA latents cut), with no second call; without one, S (kept: runners never change
their input state) with ``[cur, d1 .. da]`` fed again, one more call and exact, as a recurrent KDA state cannot be
cut back. The next pending token is ``ga``.

Drafts: `PromptLookup` (the longest recent n-gram of the text so far found earlier in it proposes what followed it;
no model) and `DraftRunner` (a smaller model with the same tokenizer, greedy on its own state, rolled back the same
way).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from k3export.errors import K3ExportError

from .base import Runner, StepOutput, to_numpy
from .loop import next_tokens


class Draft(abc.ABC):
    """Proposes up to `k` next tokens after `history` + `cur`; told what was accepted."""

    k: int = 4

    @abc.abstractmethod
    def propose(self, history: Sequence[int], cur: int) -> list[int]:
        """Up to `k` tokens that may follow `history` + `cur` (none: verify `cur` alone)."""

    def accepted(self, history: Sequence[int], cur: int, taken: Sequence[int]) -> None:
        """`cur` and `taken` (the accepted draft tokens) now follow `history`."""


@dataclass
class PromptLookup(Draft):
    """n-gram lookup in the text so far (prompt and output): the last `max_n`..`min_n` tokens, when found earlier,
    propose the `k` tokens that followed their latest earlier occurrence."""

    k: int = 4
    max_n: int = 3
    min_n: int = 1

    def propose(self, history: Sequence[int], cur: int) -> list[int]:
        seq = [*history, cur]
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # the latest earlier occurrence
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + self.k]
        return []


class DraftRunner(Draft):
    """A draft model (any runner with the same vocabulary): greedy on its own state, which covers `history` before
    each proposal and is rolled back like the target's (re-fed from the kept state)."""

    def __init__(self, runner: Runner, k: int = 4) -> None:
        self.runner, self.k = runner, k
        self.runner.logits_to_keep = 1
        self.state: StepOutput | None = None  # covers `covered` tokens of the history
        self.covered = 0

    def _sync(self, history: Sequence[int]) -> None:
        if self.covered < len(history):
            ids = np.asarray([list(history[self.covered:])], np.int64)
            self.state = self.runner.prefill(ids, self.state)
            self.covered = len(history)

    def propose(self, history: Sequence[int], cur: int) -> list[int]:
        self._sync(history)
        out, tok, proposal = self.state, cur, []
        for _ in range(self.k):
            out = self.runner.prefill(np.asarray([[tok]], np.int64), out)
            tok = int(next_tokens(out)[0])
            proposal.append(tok)
        return proposal

    def accepted(self, history: Sequence[int], cur: int, taken: Sequence[int]) -> None:
        pass  # the kept state (before the proposal) is re-fed with the accepted tokens on the next `_sync`


@dataclass
class SpeculativeResult:
    tokens: list[int]
    calls: int = 0  # target runner calls after the prefill (verify calls + rollback re-feeds)
    proposed: int = 0
    accepted: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    rounds: list[int] = field(default_factory=list)  # accepted draft tokens per round


class Verified(NamedTuple):
    """What one verify round gives (`verify`)."""

    accepted: int  # draft tokens accepted
    greedy: list[int]  # the greedy choice after each fed token
    out: StepOutput  # the state at the accepted length
    calls: int  # runner calls: 1, or 2 when the rejected tokens were taken back by feeding the accepted ones again


def _greedy(out: StepOutput) -> list[int]:
    return to_numpy(out.logits[0], np.float32).argmax(-1).astype(int).tolist()


def verify(runner: Runner, state: Any, cur: int, proposal: Sequence[int],
           eos: set[int] = frozenset()) -> Verified:  # type: ignore[assignment]
    """One verify round from `state` (covering every token before `cur`): (accepted draft tokens a, the greedy
    choices after ``cur, d1 .. dk``, the state at the accepted length, covering ``cur, d1 .. da``, the runner calls
    it took). The rollback
    rule: all accepted, the verify call's state; else that state rolled back through the export's state window
    when it holds the rejected tokens, or `state` (unchanged) with the accepted tokens fed again."""
    keep = runner.logits_to_keep
    runner.logits_to_keep = 0  # every fed position's logits: the greedy choice after each
    try:
        out = runner.prefill(np.asarray([[cur, *proposal]], np.int64), state)
    finally:
        runner.logits_to_keep = keep
    greedy = _greedy(out)[-(len(proposal) + 1):]
    a = 0
    while a < len(proposal) and proposal[a] == greedy[a] and proposal[a] not in eos:
        a += 1
    rejected = len(proposal) - a
    if rejected and rejected <= out.can_roll_back:
        return Verified(a, greedy, out.rolled_back(rejected), 1)
    if rejected:
        return Verified(a, greedy, runner.prefill(np.asarray([[cur, *proposal[:a]]], np.int64), state), 2)
    return Verified(a, greedy, out, 1)


def speculative_steps(runner: Runner, prompt_ids: Sequence[int], max_new: int, eos: set[int], draft: Draft,
                      start: Any = None, result: SpeculativeResult | None = None) -> Iterator[int]:
    """The greedy tokens after `prompt_ids` (at most `max_new`, stopping before an eos), speculated by `draft`
    (module docstring); `start`: a saved state covering the first tokens of `prompt_ids`."""
    res = result if result is not None else SpeculativeResult([])
    keep = runner.logits_to_keep
    t0 = time.perf_counter()
    past = 0 if start is None else int(start.tokens.shape[1])
    runner.logits_to_keep = 1
    try:
        state = runner.prefill(np.asarray([list(prompt_ids[past:])], np.int64), start)
    finally:
        runner.logits_to_keep = keep
    res.prefill_seconds = time.perf_counter() - t0
    history = list(prompt_ids)
    cur = int(next_tokens(state)[0])
    t1 = time.perf_counter()
    # `state` covers `history`; `cur` is the greedy token after it, not yet fed
    while len(res.tokens) < max_new and cur not in eos:
        budget = max_new - len(res.tokens) - 1  # tokens after `cur` still wanted
        proposal = draft.propose(history, cur)[:max(0, budget)] if budget > 0 else []
        a, greedy, state, calls = verify(runner, state, cur, proposal, eos)
        res.calls += calls
        taken = [cur, *proposal[:a]]
        res.proposed += len(proposal)
        res.accepted += a
        res.rounds.append(a)
        for t in taken:
            res.tokens.append(t)
            yield t
        draft.accepted(history, cur, proposal[:a])
        history += taken
        cur = greedy[a]
    res.decode_seconds = time.perf_counter() - t1


def speculative_decode(runner: Runner, prompt_ids: Sequence[int], max_new: int, eos: set[int], draft: Draft,
                       start: Any = None) -> SpeculativeResult:
    res = SpeculativeResult([])
    for _ in speculative_steps(runner, prompt_ids, max_new, eos, draft, start, res):
        pass
    return res


def make_draft(spec: str, k: int = 4) -> Draft:
    """``prompt-lookup``, or a draft checkpoint / export folder (its runner: torch, or ort for an export)."""
    from pathlib import Path

    if spec == "prompt-lookup":
        return PromptLookup(k=k)
    folder = Path(spec)
    if not folder.is_dir():
        raise K3ExportError(f"--draft {spec}: expected 'prompt-lookup' or a draft checkpoint / export folder")
    from . import Target, make_runner

    if (folder / "state_manifest.json").is_file():
        return DraftRunner(make_runner("ort", Target(onnx_dir=folder)), k)
    from .torch_runner import load_model

    return DraftRunner(make_runner("torch", Target(model=load_model(folder))), k)


def speculative_tokens(runner: Runner, prompt_ids: Sequence[int], max_new: int, eos: set[int], draft: str | Draft,
                       start: Any = None) -> Iterator[int]:
    """`speculative_steps` with a draft named as on the command line (`make_draft`); a draft model is checked to
    share the target's vocabulary."""
    d = make_draft(draft) if isinstance(draft, str) else draft
    if isinstance(d, DraftRunner):
        mine, theirs = _vocab(runner), _vocab(d.runner)
        if mine is not None and theirs is not None and mine != theirs:
            raise K3ExportError(f"--draft: the draft model's vocabulary ({theirs}) is not the target's ({mine})")
    try:
        yield from speculative_steps(runner, prompt_ids, max_new, eos, d, start)
    finally:
        if isinstance(d, DraftRunner):
            d.runner.close()


def _vocab(runner: Runner) -> int | None:
    from k3export.modeling.contract import LOGITS

    spec = next((t for t in runner.manifest.outputs if t.name == LOGITS), None)
    return None if spec is None else int(spec.shape[-1])


__all__ = ["Draft", "DraftRunner", "PromptLookup", "SpeculativeResult", "make_draft", "speculative_decode",
           "speculative_steps", "speculative_tokens", "Verified", "verify"]
