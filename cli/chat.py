"""`k3export chat` (a multi-turn chat that reuses its state) and `k3export cache` (save a prompt prefix's state).

    k3export cache EXPORT --system-prompt sys.txt --chat -o sys.k3state   # the system turn's state, saved
    k3export generate EXPORT "question" --chat --prefix-state sys.k3state  # starts from it: only the question fed
    k3export chat EXPORT                                                   # interactive: /edit N TEXT, /regenerate
    k3export chat EXPORT --script turns.txt                                # say / edit N / regenerate, one a line

Each chat turn feeds only the tokens the conversation adds; an edit or a regenerate resumes from the last saved
state at or before the change (`k3export.conversation`, the rollback rule). genai is not offered: it carries its
own state, which cannot be saved or resumed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .common import user_errors
from .generate import DeviceOption, EngineOption, ModelOption, OnnxOption, eos_ids, open_runner, text_side

_RUNTIME_HELP = "torch, triton, ort, ort-cuda, ort-webgpu, trt, openvino, openvino-stateless, openvino-decode-graph, " \
                "onnx-reference, pipeline or ray " \
                "(default: torch for a checkpoint, ort for an export, pipeline for a pipeline export)."


def _read_text(path: Path) -> str:
    from k3export.errors import K3ExportError

    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise K3ExportError(f"{path}: cannot read the system prompt ({exc})") from None


def cache(
    model_or_export: Path = typer.Argument(..., metavar="MODEL_OR_EXPORT", help="Checkpoint or ONNX export folder."),
    system_prompt: Path = typer.Option(..., "--system-prompt", help="A text file: the prefix to cache."),
    output: Path = typer.Option(..., "-o", "--output", help="The .k3state file to write (atomically)."),
    chat: bool = typer.Option(False, "--chat", help="Cache the text as the chat template's system turn (then "
                              "generate --chat --prefix-state continues it with a user turn)."),
    runtime: str | None = typer.Option(None, "--runtime", help=_RUNTIME_HELP),
    model: ModelOption = None,
    onnx: OnnxOption = None,
    engine: EngineOption = None,
    device: DeviceOption = "cpu",
) -> None:
    """Run a prompt prefix once and save its state (a .k3state file) for generate --prefix-state."""
    with user_errors():
        import numpy as np

        from k3export.conversation import encode, system_turn
        from k3export.errors import K3ExportError

        runtime, ckpt, export, tok, _ = text_side(model_or_export, runtime, model, onnx)
        text = _read_text(system_prompt)
        ids = encode(tok, system_turn(tok, text) if chat else text)
        if not ids:
            raise K3ExportError(f"{system_prompt}: the prefix is empty")
        runner = open_runner(runtime, ckpt, export, engine, device)
        try:
            path = runner.prefill(np.asarray([ids], np.int64)).save(output)
        finally:
            runner.close()
        print(f"{path}: the state of {len(ids)} tokens ({path.stat().st_size} bytes)")


def chat(
    model_or_export: Path = typer.Argument(..., metavar="MODEL_OR_EXPORT", help="Checkpoint or ONNX export folder."),
    script: Path | None = typer.Option(None, "--script", help="Run these commands instead of reading the terminal: "
                                       "'say TEXT', 'edit TURN TEXT', 'regenerate', 'system TEXT' (first)."),
    system_prompt: Path | None = typer.Option(None, "--system-prompt", help="A text file: the system turn."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Most tokens per reply."),
    runtime: str | None = typer.Option(None, "--runtime", help=_RUNTIME_HELP),
    model: ModelOption = None,
    onnx: OnnxOption = None,
    engine: EngineOption = None,
    device: DeviceOption = "cpu",
) -> None:
    """A multi-turn greedy chat that feeds only each turn's new tokens (edits and regenerates roll back)."""
    with user_errors():
        from k3export.conversation import Chat, read_script

        commands = read_script(script) if script is not None else None
        runtime, ckpt, export, tok, config = text_side(model_or_export, runtime, model, onnx)
        system = _read_text(system_prompt) if system_prompt is not None else None
        if commands and commands[0][0] == "system":
            system = commands.pop(0)[1]
        runner = open_runner(runtime, ckpt, export, engine, device)
        session = Chat(runner, tok, eos_ids(config), max_new_tokens, system)
        try:
            if commands is not None:
                for verb, arg in commands:
                    _run(session, verb, arg)
            else:
                _interactive(session)
        finally:
            runner.close()


def _run(session: object, verb: str, arg: object) -> None:
    from k3export.conversation import Chat

    assert isinstance(session, Chat)
    if verb == "say":
        answer = session.say(str(arg))
    elif verb == "edit":
        turn, text = arg  # type: ignore[misc]
        answer = session.edit(turn, text)
    else:
        answer = session.regenerate()
    reply = session.tokenizer.decode(answer, skip_special_tokens=True)
    sys.stdout.write(f"[{verb}] {reply}\n[fed {session.fed} tokens, resumed at {session.resumed_at[-1]}]\n")
    sys.stdout.flush()


def _interactive(session: object) -> None:
    from k3export.errors import K3ExportError

    sys.stderr.write("chat: type a message; /edit N TEXT rewrites user turn N, /regenerate redoes the last reply, "
                     "/quit ends\n")
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/quit":
            return
        try:
            if line.startswith("/edit "):
                num, _, text = line[len("/edit "):].partition(" ")
                if not num.isdigit():
                    raise K3ExportError("expected /edit TURN TEXT")
                _run(session, "edit", (int(num), text))
            elif line.strip() == "/regenerate":
                _run(session, "regenerate", None)
            else:
                _run(session, "say", line)
        except K3ExportError as exc:  # a bad command: said, and the chat goes on
            sys.stderr.write(f"error: {exc}\n")


def register(app: typer.Typer) -> None:
    app.command("cache")(cache)
    app.command("chat")(chat)
