"""`k3export chat` (a multi-turn chat that reuses its state) and `k3export cache` (save a prompt prefix's state).

    k3export cache EXPORT --system-prompt sys.txt --chat -o sys.k3state   # the system turn's state, saved
    k3export generate EXPORT "question" --chat --prefix-state sys.k3state  # starts from it: only the question fed
    k3export chat EXPORT                                  # interactive: a line a turn; /edit N TEXT, /regenerate
    k3export chat EXPORT --script turns.txt               # the same lines from a file

Each chat turn feeds only the tokens the conversation adds; an edit or a regenerate resumes from the last saved
state at or before the change (`k3export.conversation`, the rollback rule). Turns are counted from 1 (`/edit 2`
rewrites the second question); a script's lines are what a person types (`conversation.parse_line`, one parser). genai is not offered: it carries its
own state, which cannot be saved or resumed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .common import user_errors
from .common import KernelsOption
from .generate import DeviceOption, EngineOption, ModelOption, OnnxOption, eos_ids, open_runner, text_side

_RUNTIME_HELP = "torch, triton, ort, ort-cuda, ort-webgpu, trt, openvino, openvino-stateless, openvino-decode-graph, " \
                "onnx-reference, pipeline or ray " \
                "(default: torch for a checkpoint, ort for an export, pipeline for a pipeline export)."


def _read_text(path: Path) -> str:
    from k3export.conversation import MAX_TEXT_BYTES
    from k3export.files import read_text_file

    return read_text_file(path, "system prompt", MAX_TEXT_BYTES)


def cache(
    model_or_export: Path = typer.Argument(..., metavar="MODEL_OR_EXPORT", help="Checkpoint or ONNX export folder."),
    system_prompt: Path = typer.Option(..., "--system-prompt", help="A text file: the prefix to cache."),
    output: Path = typer.Option(..., "-o", "--output", help="The .k3state file to write (atomically): a new path, "
                                "or a saved state to replace."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing file at --output that is not a "
                                   "saved state (never an input, a link, a folder or a device)."),
    chat: bool = typer.Option(False, "--chat", help="Cache the text as the chat template's system turn (then "
                              "generate --chat --prefix-state continues it with a user turn)."),
    runtime: str | None = typer.Option(None, "--runtime", help=_RUNTIME_HELP),
    model: ModelOption = None,
    onnx: OnnxOption = None,
    engine: EngineOption = None,
    device: DeviceOption = "cpu",
    kernels: KernelsOption = None,
) -> None:
    """Run a prompt prefix once and save its state (a .k3state file) for generate --prefix-state."""
    with user_errors():
        import numpy as np

        from k3export.artifacts.saved_state import is_state_file
        from k3export.conversation import encode, system_turn
        from k3export.errors import K3ExportError
        from k3export.genai import context_length
        from k3export.safety import check_output_file

        def check_output() -> Path:
            return check_output_file(output, "a saved state (.k3state)", is_state_file, overwrite=overwrite,
                                     sources=(system_prompt, model_or_export, model, onnx, engine))

        check_output()  # before any work: a refused path costs nothing
        runtime, ckpt, export, tok, _ = text_side(model_or_export, runtime, model, onnx)
        text = _read_text(system_prompt)
        ids = encode(tok, system_turn(tok, text) if chat else text)
        if not ids:
            raise K3ExportError(f"{system_prompt}: the prefix is empty")
        limit = context_length(export)
        if len(ids) >= limit:  # a prefix must leave room for the prompt that continues it
            raise K3ExportError(f"{system_prompt}: the prefix is {len(ids)} tokens, past the context of "
                                f"{limit}")
        runner = open_runner(runtime, ckpt, export, engine, device, kernels=kernels)
        try:
            out = runner.prefill(np.asarray([ids], np.int64))
            path = out.save(check_output())  # again: the path may have changed while the model ran
        finally:
            runner.close()
        print(f"{path}: the state of {len(ids)} tokens ({path.stat().st_size} bytes)")


def chat(
    model_or_export: Path = typer.Argument(..., metavar="MODEL_OR_EXPORT", help="Checkpoint or ONNX export folder."),
    script: Path | None = typer.Option(None, "--script", help="Run these lines instead of reading the terminal: "
                                       "what you would type there (a plain line is a user turn; /edit N TEXT, "
                                       "/regenerate, /system TEXT first), one a line; # comments; the older "
                                       "say TEXT / edit N TEXT / regenerate / system TEXT too."),
    system_prompt: Path | None = typer.Option(None, "--system-prompt", help="A text file: the system turn."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Most tokens per reply."),
    runtime: str | None = typer.Option(None, "--runtime", help=_RUNTIME_HELP),
    model: ModelOption = None,
    onnx: OnnxOption = None,
    engine: EngineOption = None,
    device: DeviceOption = "cpu",
    kernels: KernelsOption = None,
) -> None:
    """A multi-turn greedy chat that feeds only each turn's new tokens (edits and regenerates roll back). Turns are
    counted from 1; each reply is marked with its turn's number."""
    with user_errors():
        from k3export.conversation import Chat, read_script
        from k3export.errors import K3ExportError
        from k3export.genai import context_length

        commands = read_script(script) if script is not None else None  # the whole script checked before any work
        runtime, ckpt, export, tok, config = text_side(model_or_export, runtime, model, onnx)
        system = _read_text(system_prompt) if system_prompt is not None else None
        if commands and commands[0].verb == "system":
            system = commands.pop(0).text
        unloaded = Chat(None, tok, eos_ids(config), max_new_tokens, system,  # type: ignore[arg-type]
                        context=context_length(export))
        for c in commands or ():  # a turn that cannot fit alone is refused before the model loads
            if c.verb in ("say", "edit"):
                try:
                    unloaded.check_turn(c.text)
                except K3ExportError as exc:
                    raise K3ExportError(f"{script}:{c.line}: {exc}") from None
        runner = open_runner(runtime, ckpt, export, engine, device, kernels=kernels)
        session = Chat(runner, tok, eos_ids(config), max_new_tokens, system, context=unloaded.context)
        try:
            if commands is not None:
                for command in commands:
                    _run(session, command)
            else:
                _interactive(session)
        finally:
            runner.close()


def _run(session: object, command: object) -> None:
    """Run one parsed command (`conversation.Command`, checked by `check_command`) and print its reply, marked
    with its turn's number (from 1)."""
    from k3export.conversation import Chat, Command

    assert isinstance(session, Chat) and isinstance(command, Command)
    if command.verb == "system":
        session.set_system(command.text)
        return
    if command.verb == "say":
        answer, how = session.say(command.text), ""
    elif command.verb == "edit":
        answer, how = session.edit(command.turn - 1, command.text), " edited"
    else:
        answer, how = session.regenerate(), " regenerated"
    reply = session.tokenizer.decode(answer, skip_special_tokens=True)
    sys.stdout.write(f"[turn {len(session.user_turns())}{how}] {reply}\n"
                     f"[fed {session.fed} tokens, resumed at {session.resumed_at[-1]}]\n")
    sys.stdout.flush()


def _interactive(session: object) -> None:
    from k3export.conversation import SYNTAX, Chat, check_command, parse_line
    from k3export.errors import K3ExportError

    assert isinstance(session, Chat)
    sys.stderr.write(f"chat: {SYNTAX}\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = parse_line(line)
            if command.verb == "quit":
                return
            replied = bool(session.messages) and session.messages[-1]["role"] == "assistant"
            check_command(command, len(session.user_turns()), replied)
            _run(session, command)
        except K3ExportError as exc:  # a bad command: said, and the chat goes on
            sys.stderr.write(f"error: {exc}\n")


def register(app: typer.Typer) -> None:
    app.command("cache")(cache)
    app.command("chat")(chat)
