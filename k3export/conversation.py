"""Conversations that reuse their state: a cached prompt prefix, and a multi-turn chat that feeds only new tokens.

The one rule (the rollback rule): a conversation is always the tokens of its whole rendering (the chat template over
every message, tokenized at once: what a fresh run would feed). A saved state may be resumed only when the tokens it
covers are a prefix of those tokens; it then feeds the rest. After an edit or a regenerate, `Chat` resumes from the
longest saved state that is still such a prefix, the last one at or before the first changed token, never one past
it (a state past the change holds tokens the new conversation does not have, and a recurrent KDA state cannot be
cut back). The states it keeps are the ones after each turn's prompt and after each reply.

    chat = Chat(runner, tokenizer, eos={2}, max_new_tokens=64)
    chat.say("Hello")                  # -> the reply's token ids
    chat.edit(0, "Hello there")        # rewrites the first user turn (0-based here; the CLI's /edit 1): every
                                       # later turn is dropped, then a new reply
    chat.regenerate()                  # the last reply again (greedy: the same, from the state before it)

What a person types to a chat, in the terminal or as a script's line, is parsed here once (`parse_line`, `SYNTAX`;
turns counted from 1) and checked against the conversation so far (`check_command`); `read_script` reads a whole
script that way, size-checked first, before any model loads.
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


def fits(tokenizer: Any, text: str, limit: int, chunk: int = 1 << 16) -> bool:
    """Whether `text` is at most `limit` tokens, counted piece by piece (cut at a space, where the tokenizers'
    pre-tokenizers cut anyway) and stopped as soon as the count passes `limit` (plus one token a cut, the most a cut
    can add): a 10 MB line past the context is refused after the context's worth of text, not all of it."""
    count = cuts = at = 0
    while at < len(text):
        end = len(text)
        if end - at > chunk:
            space = text.rfind(" ", at + 1, at + chunk)
            end = space if space > at else at + chunk
        count += len(encode(tokenizer, text[at:end]))
        cuts += end < len(text)
        if count > limit + cuts:
            return False
        at = end
    return True


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
    #: tokens a conversation and its reply may reach (None: no bound); a turn past it is refused before any work
    context: int | None = None

    def __post_init__(self) -> None:
        self.pick = self.pick or latest_prefix
        if self.system is not None:
            self.messages = [{"role": "system", "content": self.system}]

    def _conversation_ids(self) -> list[int]:
        return encode(self.tokenizer, render_chat(self.tokenizer, self.messages, True))

    def _reply(self) -> list[int]:
        ids = self._conversation_ids()
        if self.context is not None and len(ids) + self.max_new_tokens > self.context:
            raise K3ExportError(f"the conversation is {len(ids)} tokens; with {self.max_new_tokens} new ones it "
                                f"needs {len(ids) + self.max_new_tokens}, past the context of {self.context}")
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

    def _with(self, messages: list[Message]) -> list[int]:
        """The reply to `messages`; the conversation as it was when that fails (a turn past the context)."""
        before, self.messages = self.messages, messages
        try:
            return self._reply()
        except BaseException:
            self.messages = before
            raise

    def check_turn(self, text: str) -> None:
        """Refuse a user turn that alone cannot fit the context with a reply (`fits`: counted only as far as the
        context), before the conversation is rendered and tokenized whole."""
        room = None if self.context is None else self.context - self.max_new_tokens
        if room is not None and not fits(self.tokenizer, text, room):
            raise K3ExportError(f"the turn is more than {max(room, 0)} tokens: with {self.max_new_tokens} new ones "
                                f"it cannot fit the context of {self.context}")

    def say(self, text: str) -> list[int]:
        """A new user turn; returns the reply's token ids."""
        self.check_turn(text)
        return self._with([*self.messages, {"role": "user", "content": text}])

    def set_system(self, text: str) -> None:
        """The system prompt, before the first user turn."""
        if self.user_turns():
            raise K3ExportError("the system prompt is set before the first user turn, not after it")
        self.system = text
        self.messages = [{"role": "system", "content": text}]

    def user_turns(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "user"]

    def edit(self, turn: int, text: str) -> list[int]:
        """Rewrite user turn `turn` (0-based among the user turns: the CLI's turn N is `turn` N - 1); the turns after
        it are dropped; a new reply."""
        turns = self.user_turns()
        self.check_turn(text)
        if not 0 <= turn < len(turns):
            raise K3ExportError(f"no user turn at index {turn} to edit (0-based; the conversation has "
                                f"{len(turns)})")
        return self._with(self.messages[:turns[turn]] + [{"role": "user", "content": text}])

    def regenerate(self) -> list[int]:
        """The last reply again, from the state before it."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise K3ExportError("nothing to regenerate: the conversation does not end with a reply")
        return self._with(self.messages[:-1])


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


#: the largest chat script or system prompt read (checked before reading: a sparse file is never read whole)
MAX_TEXT_BYTES = 16 << 20
#: what a person types, in the terminal or as a script's line
SYNTAX = "a plain line is a user turn; /edit N TEXT rewrites user turn N (from 1); /regenerate redoes the last " \
         "reply; /system TEXT (before the first turn) sets the system prompt; /quit ends; //TEXT is a turn that " \
         "starts with /"
_COMMANDS = ("/edit", "/regenerate", "/system", "/quit")
#: a script's older words, still read: ``say TEXT``, ``edit N TEXT``, ``regenerate``, ``system TEXT``
_OLD_WORDS = {"say": "", "edit": "/edit", "regenerate": "/regenerate", "system": "/system"}


@dataclass(frozen=True)
class Command:
    """One line of a chat, parsed: `verb` "say" (a user turn), "edit" (user turn `turn`, counted from 1, as a person
    counts), "regenerate", "system" or "quit"; `text` the turn's or system prompt's text; `line` its line number
    in a script (0: typed)."""

    verb: str
    text: str = ""
    turn: int = 0
    line: int = 0


def parse_line(line: str, *, old_words: bool = False, number: int = 0) -> Command:
    """A line as a person types it (`SYNTAX`); with `old_words` (a script), ``say`` / ``edit`` / ``regenerate`` /
    ``system`` too. `K3ExportError` (one line, without the file) for a command it cannot be."""
    text = line.rstrip("\r\n")
    word, _, rest = text.partition(" ")
    if old_words and word in _OLD_WORDS:
        if word == "say":
            return Command("say", rest, line=number)
        word = _OLD_WORDS[word]
    elif text.startswith("//"):
        return Command("say", text[1:], line=number)
    elif not text.startswith("/"):
        return Command("say", text, line=number)
    if word == "/edit":
        num, _, body = rest.partition(" ")
        # ASCII digits only: str.isdigit takes '²', which int() refuses
        if not (num.isascii() and num.isdigit()) or int(num) < 1 or not body.strip():
            raise K3ExportError(f"expected '/edit N TEXT' with N a user turn counted from 1, got {text[:60]!r}")
        return Command("edit", body, int(num), number)
    if word in ("/regenerate", "/quit"):
        if rest.strip():
            raise K3ExportError(f"'{word}' takes nothing after it, got {text[:60]!r}")
        return Command(word[1:], line=number)
    if word == "/system":
        return Command("system", rest, line=number)
    raise K3ExportError(f"unknown chat command {word[:40]!r} ({', '.join(_COMMANDS)}; //TEXT for a turn that "
                        "starts with /)")


def check_command(command: Command, turns: int, replied: bool) -> int:
    """Refuse `command` when the conversation so far (`turns` user turns, ending with a reply when `replied`)
    cannot take it; the number of user turns after it."""
    if command.verb == "edit":
        if command.turn > turns:
            raise K3ExportError(f"no user turn {command.turn} to edit (the conversation has "
                                f"{turns or 'none'}{f': 1 to {turns}' if turns > 1 else ''})")
        return command.turn
    if command.verb == "regenerate" and not replied:
        raise K3ExportError("nothing to regenerate: no reply yet")
    if command.verb == "system" and turns:
        raise K3ExportError("/system sets the system prompt before the first turn, not after it")
    if command.verb == "say" and not command.text.strip():
        raise K3ExportError("an empty user turn")
    return turns + (command.verb == "say")


def read_script(path: Any) -> list[Command]:
    """A chat script: the lines a person would type (`parse_line`, the older words too), ``#`` comments and blank
    lines skipped, read up to a ``/quit``; the file size-checked first (`MAX_TEXT_BYTES`), each command checked
    against the turns before it (`check_command`: an edit of a turn not yet there, a leading regenerate); every
    refusal one `K3ExportError` line naming the file and line."""
    from k3export.files import read_text_file

    lines = read_text_file(path, "chat script", MAX_TEXT_BYTES).splitlines()
    out: list[Command] = []
    turns, replied = 0, False
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            command = parse_line(line, old_words=True, number=n)
            if command.verb == "quit":
                break
            turns = check_command(command, turns, replied)
        except K3ExportError as exc:
            raise K3ExportError(f"{path}:{n}: {exc}") from None
        replied = replied or command.verb != "system"
        out.append(command)
    return out


__all__ = ["Chat", "Command", "MAX_TEXT_BYTES", "SYNTAX", "chat_suffix", "check_command", "common_prefix",
           "continue_prefix", "encode", "fits", "latest_prefix", "parse_line", "read_script", "system_turn"]
