"""Prompt caching, multi-turn chat and speculative decoding on a `k3export tiny` export (with its tokenizer): each
proven equal, token for token, to a fresh greedy run over the whole sequence."""

import numpy as np
import pytest
from typer.testing import CliRunner

from k3export.conversation import Chat, encode
from k3export.tokenizer import render_chat as render
from k3export.runtime import Target, greedy_decode, make_runner
from k3export.runtime.speculate import DraftRunner, PromptLookup, speculative_decode

SYSTEM = "You are a helpful assistant. Answer briefly about the tiny model and its layers."


def _cli(*args):
    from k3export_cli.main import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    return res


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    assert _cli("tiny", root / "model", "--seed", "3").exit_code == 0
    res = _cli("export", root / "model", root / "onnx")
    assert res.exit_code == 0, res.output
    return root


@pytest.fixture(scope="module")
def ort(folder):
    r = make_runner("ort", Target(onnx_dir=folder / "onnx"))
    r.logits_to_keep = 1
    return r


@pytest.fixture(scope="module")
def tok(folder):
    from k3export.tokenizer import load_tokenizer

    return load_tokenizer(folder / "onnx")


def _fresh(runner, ids, n):
    """Plain greedy decoding from the initial state over the whole sequence: the independent reference."""
    return greedy_decode(runner, np.asarray([ids], np.int64), n - 1).tokens[0].tolist()


def _until_eos(tokens, eos):
    return tokens[:next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


def test_cached_system_prompt_generates_what_the_whole_prompt_does(folder, tmp_path):
    (tmp_path / "sys.txt").write_text(SYSTEM)
    state = tmp_path / "sys.k3state"
    res = _cli("cache", folder / "onnx", "--system-prompt", tmp_path / "sys.txt", "--chat", "-o", state)
    assert res.exit_code == 0 and state.is_file(), res.output
    cached = _cli("generate", folder / "onnx", "Hello there", "--chat", "--prefix-state", state,
                  "--max-new-tokens", "12")
    from k3export.tokenizer import load_tokenizer

    full = render(load_tokenizer(folder / "onnx"), [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": "Hello there"}], True)
    plain = _cli("generate", folder / "onnx", full, "--max-new-tokens", "12")  # the whole prompt, fed from zero
    assert cached.exit_code == plain.exit_code == 0, cached.output + plain.output
    assert cached.output == plain.output and cached.output.strip()
    other = tmp_path / "o.txt"
    other.write_text("x")
    _cli("tiny", tmp_path / "m2", "--seed", "4")
    assert _cli("export", tmp_path / "m2", tmp_path / "e2").exit_code == 0
    refused = _cli("generate", tmp_path / "e2", "Hi", "--prefix-state", state)
    assert refused.exit_code == 2 and "belongs to another export" in refused.output
    assert len(refused.output.strip().splitlines()) == 1


def test_a_pipeline_export_generates_caches_and_speculates_like_its_single_graph(folder, tmp_path):
    """`generate PIPELINE` (runtime pipeline: the stages chained in this process) tokenizes with the tokenizer
    `export --stages` writes beside pipeline.json; a cached prefix and prompt-lookup speculation on it give the
    single graph's plain greedy text."""
    pipe = tmp_path / "pipe"
    assert _cli("export", folder / "model", pipe, "--stages", "2").exit_code == 0
    (tmp_path / "sys.txt").write_text(SYSTEM)
    state = tmp_path / "sys.k3state"
    assert _cli("cache", pipe, "--system-prompt", tmp_path / "sys.txt", "-o", state).exit_code == 0
    single = _cli("generate", folder / "onnx", SYSTEM + " Hello there", "--max-new-tokens", "10")
    assert single.exit_code == 0 and single.output.strip(), single.output
    for extra in ((), ("--prefix-state", state), ("--draft", "prompt-lookup")):
        prompt = " Hello there" if extra and extra[0] == "--prefix-state" else SYSTEM + " Hello there"
        res = _cli("generate", pipe, prompt, "--max-new-tokens", "10", *extra)
        assert res.exit_code == 0 and res.output == single.output, (extra, res.output, single.output)
    wrong = _cli("generate", pipe, "Hi", "--runtime", "ort")
    assert wrong.exit_code == 2 and "a pipeline export runs on runtime pipeline or ray, not ort" in wrong.output


def test_chat_edit_and_regenerate_equal_fresh_runs_and_feed_only_new_tokens(ort, tok, folder):
    eos = {2}
    chat = Chat(ort, tok, eos, max_new_tokens=8, system=SYSTEM)
    lengths = []
    for text in ("What is a layer?", "And attention?", "Thanks, one more."):
        chat.say(text)
        lengths.append(len(encode(tok, render(tok, chat.messages[:-1], True))))
    # each turn resumed from a state of the conversation so far: it fed only what the turn added
    assert chat.resumed_at[0] == 0 and 0 < chat.resumed_at[1] < lengths[1] and lengths[1] <= chat.resumed_at[2]
    assert chat.fed < sum(lengths)  # without reuse every turn would feed its whole conversation
    # edit turn 1 (the second user turn): resume at or before the change, never past it
    edited = chat.edit(1, "And latent attention?")
    ids = encode(tok, render(tok, chat.messages[:-1], True))
    old = encode(tok, render(tok, [*chat.messages[:3], {"role": "user", "content": "And attention?"}], True))
    change = next(i for i, (a, b) in enumerate(zip(ids, old)) if a != b)
    assert 0 < chat.resumed_at[-1] <= change
    assert edited == _until_eos(_fresh(ort, ids, 8), eos)
    again = chat.regenerate()  # greedy: the same reply, from a state before it
    assert again == edited and chat.resumed_at[-1] <= len(ids)


def _replies(output):
    """(turn mark, reply) of each reply a chat prints (``[turn N] text``, ``[turn N edited] text``)."""
    return [tuple(line[1:].split("] ", 1)) for line in output.splitlines() if line.startswith("[turn ")]


@pytest.mark.parametrize("form", ["typed", "older words"])
def test_chat_script_of_plain_lines_edits_turn_2_as_a_fresh_chat_would(folder, tok, ort, tmp_path, form):
    """A script of the lines a person types, turns counted from 1: the edit of turn 2 rewrites the second question,
    and its reply equals a fresh greedy run over the edited conversation (the older say / edit words, the same)."""
    lines = ([f"/system {SYSTEM}", "What is a layer?", "And attention?", "/edit 2 And latent attention?"]
             if form == "typed" else
             [f"system {SYSTEM}", "say What is a layer?", "say And attention?", "edit 2 And latent attention?"])
    script = tmp_path / "turns.txt"
    script.write_text("# a chat\n" + "\n".join(lines) + "\n")
    res = _cli("chat", folder / "onnx", "--script", script, "--max-new-tokens", "8")
    assert res.exit_code == 0, res.output
    replies = _replies(res.output)
    assert [mark for mark, _ in replies] == ["turn 1", "turn 2", "turn 2 edited"]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a layer?"},
            {"role": "assistant", "content": replies[0][1]}, {"role": "user", "content": "And latent attention?"}]
    fresh = _until_eos(_fresh(ort, encode(tok, render(tok, msgs, True)), 8), {2})
    assert replies[2][1] == tok.decode(fresh, skip_special_tokens=True)
    # the unedited second turn differs from the edit (else the test could not tell which turn was rewritten)
    wrong = msgs[:3] + [{"role": "user", "content": "And attention?"}]
    assert render(tok, wrong, True) != render(tok, msgs, True)


@pytest.mark.parametrize("line,expect", [("/edit 0 hello", "counted from 1"), ("edit 0 hello", "counted from 1"),
                                         ("/edit 3 hello", "no user turn 3"), ("edit \u00b2 hello", "counted from 1"),
                                         ("/frobnicate", "unknown chat command")])
def test_chat_script_refuses_a_turn_not_there_in_one_line_naming_the_line(folder, tmp_path, line, expect):
    bad = tmp_path / "bad.txt"
    bad.write_text(f"Hi\nAnd attention?\n{line}\n", encoding="utf-8")
    res = _cli("chat", folder / "onnx", "--script", bad)
    assert res.exit_code == 2 and f"bad.txt:3" in res.output and expect in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
           "the model reads text, the model reads text, the model reads text, the model",
           "Hello! This is a tiny Kimi K3 model with random weights. Hello! This is a tiny",
           "layers layers layers and more layers"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_lookup_speculation_is_plain_greedy_token_for_token(ort, tok, prompt):
    ids = encode(tok, prompt)
    res = speculative_decode(ort, ids, 24, set(), PromptLookup(k=4))
    assert res.tokens == _fresh(ort, ids, 24)
    assert res.calls <= 2 * 24


def test_draft_model_speculation_is_plain_greedy_and_accepts_its_own_tokens(ort, tok, folder, tiny_k3):
    ids = encode(tok, PROMPTS[1])
    same = DraftRunner(make_runner("ort", Target(onnx_dir=folder / "onnx")), k=3)  # the target as its own draft
    res = speculative_decode(ort, ids, 16, set(), same)
    assert res.tokens == _fresh(ort, ids, 16) and res.accepted == res.proposed  # every proposal is greedy's own
    cli = _cli("generate", folder / "onnx", PROMPTS[0], "--draft", "prompt-lookup", "--max-new-tokens", "16")
    plain = _cli("generate", folder / "onnx", PROMPTS[0], "--max-new-tokens", "16")
    assert cli.exit_code == 0 and cli.output == plain.output
    model = _cli("generate", folder / "onnx", PROMPTS[0], "--draft", folder / "model", "--max-new-tokens", "16")
    assert model.exit_code == 0 and model.output == plain.output, model.output


class _Oracle(PromptLookup):
    """Proposes the true greedy continuation with a wrong token planted at a varying position (none, first, middle,
    last), so every round exercises another accepted length: 0, 1, 2, 3 or all 4 and each rollback."""

    def __init__(self, truth, prompt_len):
        super().__init__(k=4)
        self.truth, self.p, self.round = truth, prompt_len, 0

    def propose(self, history, cur):
        at = len(history) + 1 - self.p  # index into `truth` of the token after `cur`
        out = list(self.truth[at:at + self.k])
        wrong = (None, 0, 2, 3, 1)[self.round % 5]
        self.round += 1
        if wrong is not None and wrong < len(out):
            out[wrong] = (out[wrong] + 1) % 512
        return out


@pytest.mark.parametrize("runtime", ["ort", "torch"])
def test_every_accepted_length_rolls_back_to_exact_greedy(ort, tok, folder, runtime):
    from k3export.runtime.torch_runner import load_model

    r = ort if runtime == "ort" else make_runner("torch", Target(model=load_model(folder / "model")))
    for prompt in PROMPTS[:2]:
        ids = encode(tok, prompt)
        truth = _fresh(r, ids, 30)
        res = speculative_decode(r, ids, 30, set(), _Oracle(truth, len(ids)))
        assert res.tokens == truth
        assert {0, 1, 2, 3, 4} <= set(res.rounds) and res.calls < 30
