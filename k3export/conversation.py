"""Conversations that reuse their state: a cached prompt prefix, and a multi-turn chat that feeds only new tokens.

The one rule (the rollback rule): a conversation is always the tokens of its whole rendering (the chat template over
every message, tokenized at once: what a fresh run would feed). A saved state may be resumed only when the tokens it
covers are a prefix of those tokens; it then feeds the rest. After an edit or a regenerate, `Chat` resumes from the
longest saved state that is still such a prefix, the last one at or before the first changed token, never one past
it (a state past the change holds tokens the new conversation does not have, and a recurrent KDA state cannot be
cut back). The states it keeps are the ones after each turn's prompt and after each reply.

    chat = Chat(runner, tokenizer, eos={2}, max_new_tokens=64)
    chat.say("Hello")                  # -> the reply's token ids
    chat.edit(0, "Hello there")        # rewrites user turn 0: every later turn is dropped, then a new reply
    chat.regenerate()                  # the last reply again (greedy: the same, from the state before it)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3export.errors import K3ExportError
from k3export.runtime.base import Runner, StepOutput
from k3export.runtime.loop import next_tokens
from k3export.tokenizer import render_chat

Message = dict[str, str]


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def continue_prefix(tokenizer: Any, prefix_tokens: Sequence[int], text: str) -> list[int]:
    """The tokens of the cached prefix's text followed by `text`, tokenized at once (what a fresh run feeds),
    refused in one line when they do not start with `prefix_tokens` (a merge across the boundary)."""
    prefix = [int(t) for t in prefix_tokens]
    full = encode(tokenizer, tokenizer.decode(prefix, skip_special_tokens=False) + text)
    if full[:len(prefix)] != prefix:
        raise K3ExportError(f"the prompt's tokens do not continue the cached prefix (they differ at token "
                            f"{common_prefix(full, prefix)} of its {len(prefix)}): cache a prefix that ends at a "
                            "token boundary, e.g. a whole chat turn (cache --chat)")
    if len(full) == len(prefix):
        raise K3ExportError("the prompt adds no token to the cached prefix")
    return full


def chat_suffix(tokenizer: Any, prompt: str) -> str:
    """The text a user turn `prompt` (and the assistant's generation prompt) adds after a cached system turn."""
    system = [{"role": "system", "content": "\x00"}]
    before = render_chat(tokenizer, system, False)
    after = render_chat(tokenizer, [*system, {"role": "user", "content": prompt}], True)
    if not after.startswith(before):
        raise K3ExportError("the chat template renders a system turn differently once a user turn follows it: a "
                            "cached system prompt cannot be continued")
    return after[len(before):]


def system_turn(tokenizer: Any, system_prompt: str) -> str:
    """A system prompt as the chat template's system turn (what `cache --chat` caches)."""
    return render_chat(tokenizer, [{"role": "system", "content": system_prompt}], False)


@dataclass
class Chat:
    """A multi-turn greedy chat on `runner` that keeps its states (module docstring).

    `fed` counts the tokens fed to the runner (what reuse saves), `resumed_at` the length of the state each reply
    resumed from. `pick` chooses the state to resume from (`latest_prefix`; a test plants a wrong one)."""

    runner: Runner
    tokenizer: Any
    eos: set[int]
    max_new_tokens: int = 64
    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    saved: list[StepOutput] = field(default_factory=list)
    fed: int = 0
    resumed_at: list[int] = field(default_factory=list)
    pick: Callable[[list[StepOutput], list[int]], StepOutput | None] = field(default=None)  # type: ignore[assignment]
    on_token: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        self.pick = self.pick or latest_prefix
        if self.system is not None:
            self.messages = [{"role": "system", "content": self.system}]

    def _conversation_ids(self) -> list[int]:
        return encode(self.tokenizer, render_chat(self.tokenizer, self.messages, True))

    def _reply(self) -> list[int]:
        ids = self._conversation_ids()
        start = self.pick(self.saved, ids)
        past = 0 if start is None else int(start.tokens.shape[1])
        self.saved = [s for s in self.saved if s.tokens.shape[1] <= past]  # states of the old conversation go
        self.resumed_at.append(past)
        out = self.runner.prefill(np.asarray([ids[past:]], np.int64), start)
        self.fed += len(ids) - past
        self.saved.append(out)  # the state after this turn's prompt
        answer: list[int] = []
        for _ in range(self.max_new_tokens):
            tok = int(next_tokens(out)[0])
            if tok in self.eos:
                break
            answer.append(tok)
            if self.on_token is not None:
                self.on_token(tok)
            if len(answer) == self.max_new_tokens:
                break
            out = self.runner.prefill(np.asarray([[tok]], np.int64), out)
            self.fed += 1
        if out is not self.saved[-1]:
            self.saved.append(out)  # the state after the reply (its last token not fed yet)
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(answer,
                                                                                     skip_special_tokens=True)})
        return answer

    def say(self, text: str) -> list[int]:
        """A new user turn; returns the reply's token ids."""
        self.messages.append({"role": "user", "content": text})
        return self._reply()

    def user_turns(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "user"]

    def edit(self, turn: int, text: str) -> list[int]:
        """Rewrite user turn `turn` (0-based among the user turns); the turns after it are dropped; a new reply."""
        turns = self.user_turns()
        if not 0 <= turn < len(turns):
            raise K3ExportError(f"no user turn {turn} to edit (the conversation has {len(turns)})")
        self.messages = self.messages[:turns[turn]] + [{"role": "user", "content": text}]
        return self._reply()

    def regenerate(self) -> list[int]:
        """The last reply again, from the state before it."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise K3ExportError("nothing to regenerate: the conversation does not end with a reply")
        self.messages.pop()
        return self._reply()


def latest_prefix(saved: list[StepOutput], ids: list[int]) -> StepOutput | None:
    """The rollback rule: the longest saved state whose tokens are a prefix of `ids` and leave at least one token to
    feed (the last at or before the first changed token); None: start from the initial state."""
    best = None
    for s in saved:
        covered = s.tokens[0].tolist()
        if len(covered) < len(ids) and ids[:len(covered)] == covered:
            if best is None or len(covered) > best.tokens.shape[1]:
                best = s
    return best


def read_script(path: Any) -> list[tuple[str, Any]]:
    """A chat script: one command a line (``say TEXT``, ``edit N TEXT``, ``regenerate``, ``system TEXT`` first),
    ``#`` comments and blank lines skipped; `K3ExportError` naming the line otherwise."""
    from pathlib import Path

    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise K3ExportError(f"{p}: cannot read the chat script ({exc})") from None
    out: list[tuple[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        verb, _, rest = line.partition(" ")
        if verb == "say" or verb == "system":
            if verb == "system" and out:
                raise K3ExportError(f"{p}:{n}: 'system' must come first")
            out.append((verb, rest))
        elif verb == "edit":
            num, _, text = rest.partition(" ")
            if not num.isdigit():
                raise K3ExportError(f"{p}:{n}: expected 'edit TURN TEXT' with TURN a user-turn number")
            out.append((verb, (int(num), text)))
        elif verb == "regenerate" and not rest.strip():
            out.append((verb, None))
        else:
            raise K3ExportError(f"{p}:{n}: unknown chat command {verb!r} (say, edit, regenerate, system)")
    return out


__all__ = ["Chat", "chat_suffix", "common_prefix", "continue_prefix", "encode", "latest_prefix", "read_script",
           "system_turn"]
