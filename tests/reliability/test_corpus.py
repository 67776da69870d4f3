"""The corpus: every bad input and fault in `corpus.CASES`, run through the real CLI in a subprocess.

For each case: the exit code; a single ``error:`` line on stderr naming the file, tensor or field; no traceback;
nothing complete-looking left (the output absent or unchanged, only hidden lock files and partial-marked folders
beside it); the source, the export a refused command read and every protected file unchanged (content hashes
before and after); and the planted token in no output and no file.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    Ctx, base_env, check_no_secret, check_nothing_complete, check_refusal, copy_tree, snapshot,
)
from _corpus import CASES, Case  # noqa: E402


def _params():
    out = []
    for case in CASES:
        marks = []
        if case.needs:
            marks.append(pytest.mark.xfail(strict=False, reason=f"needs {case.needs}"))
        if case.id == "out-parent-read-only" and os.geteuid() == 0:
            marks.append(pytest.mark.skip(reason="root ignores folder permissions"))
        why = case.skip() if case.skip is not None else None
        if why:
            marks.append(pytest.mark.skip(reason=why))
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


def _ctx(case: Case, tmp_path: Path, released: Path, tiny: Path, request) -> Ctx:
    (tmp_path / "work").mkdir()
    ctx = Ctx(tmp=tmp_path, out=tmp_path / "work" / "out", fixture=request.getfixturevalue)
    if case.source == "released":
        ctx.src = copy_tree(released, tmp_path / "src")
    elif case.source in ("tiny", "export", "pipeline"):
        ctx.src = copy_tree(tiny, tmp_path / "model")
    if case.source == "export":
        ctx.export = copy_tree(request.getfixturevalue("exported"), tmp_path / "onnx")
    elif case.source == "pipeline":
        ctx.export = copy_tree(request.getfixturevalue("pipelined"), tmp_path / "pipeline")
    if ctx.src is not None:
        ctx.protect(ctx.src)
    return ctx


@pytest.mark.parametrize("case", _params())
def test_corpus(case: Case, cli, tmp_path, released, tiny, request):
    ctx = _ctx(case, tmp_path, released, tiny, request)
    argv = case.setup(ctx)
    protected = {p: snapshot(p) for p in ctx.protected}
    export_before = snapshot(ctx.export) if ctx.export is not None else None
    out_before = snapshot(ctx.out) if os.path.lexists(ctx.out) else None
    siblings = set(os.listdir(ctx.out.parent)) if ctx.out.parent.is_dir() else set()

    env = base_env(tmp_path, **ctx.env) if ctx.env else None
    run = cli(argv, tmp_path, timeout=case.timeout, fsize=case.fsize, as_extra=case.as_extra, env=env,
              mode=case.mode)

    if case.code == 0:
        assert run.code == 0, str(run)
    else:
        check_refusal(run, case.expect)
        if not any(ctx.out == p or p in ctx.out.parents or ctx.out in p.parents for p in ctx.protected):
            check_nothing_complete(ctx.out, out_before, siblings)
    if case.code != 0 and ctx.export is not None:  # a refused command wrote nothing into what it read
        assert snapshot(ctx.export) == export_before, f"{ctx.export} changed"
    for path, before in protected.items():
        assert snapshot(path) == before, f"{path} changed"
    check_no_secret(run, tmp_path, allowed=ctx.secrets_ok)


def test_corpus_size():
    assert len(CASES) >= 80
    by_surface = {case.surface for case in CASES}
    assert {"tokenizer", "chat", "genai", "pipeline", "generate", "deploy-plan", "engine-sidecar",
            "build"} <= by_surface, by_surface


def test_debug_shows_the_traceback(cli, tmp_path, released):
    """K3EXPORT_DEBUG=1: the same failure, with its traceback."""
    src = copy_tree(released, tmp_path / "src")
    (src / "model-00001-of-00003.safetensors").write_bytes(b"short")
    run = cli(["convert", src, tmp_path / "out", "--no-progress"], tmp_path,
              env=base_env(tmp_path, K3EXPORT_DEBUG="1"))
    assert run.code != 0 and "Traceback" in run.stderr and "truncated" in run.stderr


def test_real_console_entry_point(cli, tmp_path, released):
    """The same one-line contract through `python -m k3export_cli.main` (no pre-imported process)."""
    src = copy_tree(released, tmp_path / "src")
    (src / "config.json").write_text("[1, 2]")
    out = tmp_path / "out"
    run = cli(["convert", src, out, "--no-progress"], tmp_path, mode="exec")
    check_refusal(run, ("config.json",))
    assert not out.exists()
    run = cli(["convert", src, out, "--max-shard-size", "1e400"], tmp_path, mode="exec")
    check_refusal(run, ("--max-shard-size",))
    shutil.rmtree(src)
