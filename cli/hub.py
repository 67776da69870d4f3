"""`k3export push`: publish a converted checkpoint or an ONNX export on the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

import typer

from k3export.units import format_bytes

from .common import console, err_console, user_errors


def push(
    local_dir: Path = typer.Argument(..., help="Folder of a converted checkpoint or of an ONNX export."),
    repo_id: str = typer.Argument(..., help="Target repository, namespace/name."),
    private: bool = typer.Option(False, "--private", help="Create the repository as private (if it does not exist)."),
    revision: str | None = typer.Option(None, "--revision", help="Branch to commit to (created when missing)."),
    commit_message: str | None = typer.Option(None, "--commit-message", help="Message of the commit."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the files, sizes and model card; upload nothing."),
    force: bool = typer.Option(False, "--force", help="Publish even without a passing validation.json."),
) -> None:
    """Upload LOCAL_DIR to REPO_ID in one commit, with a generated model card (README.md)."""
    from k3export import hub

    with user_errors():
        plan = hub.plan_push(local_dir, repo_id, force=force)
        kind = "converted checkpoint" if plan.artifact.kind == hub.CHECKPOINT else "ONNX export"
        for warning in plan.warnings:
            err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
        if dry_run:
            console.print(f"dry run: {kind} {plan.artifact.root} -> {repo_id}", highlight=False)
            total = 0
            for name, size in plan.files:
                console.print(f"{size:>14d}  {format_bytes(size):>10}  {name}", highlight=False, markup=False)
                total += size
            console.print(f"{total:>14d}  {format_bytes(total):>10}  total ({len(plan.files)} files)", highlight=False)
            for name in plan.artifact.skipped:
                console.print(f"not uploaded: {name}", highlight=False, markup=False)
            console.print("--- README.md ---", highlight=False, markup=False)
            console.print(plan.card, highlight=False, markup=False, soft_wrap=True)
            return
        result = hub.push(
            local_dir,
            repo_id,
            private=private,
            revision=revision,
            commit_message=commit_message,
            force=force,
            plan=plan,
        )
        total = sum(size for _, size in result.files)
        console.print(
            f"pushed {kind}: {len(result.files)} files ({format_bytes(total)}) to {result.repo_id}@{result.revision}",
            highlight=False,
        )
        if result.commit_url:
            console.print(f"commit: {result.commit_url}", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("push")(push)
