"""Publishing an artifact: `plan_push` computes everything a push sends, offline (files, sizes, model card) and
refuses what may not be published; `push` sends it to the Hub in one commit.

A push needs a passing ``validation.json`` (written by ``k3export validate``) unless forced; an ONNX export's
graph, data and documents must still have the sha256 the report recorded. A file above the Hub's per-file limit is
refused before anything is sent.

The upload is one ``HfApi.create_commit`` call: the exact artifact file list plus the card (held in memory, the
local folder is never written to) land in a single commit with the caller's message. ``upload_large_folder`` is
not used: it splits the work into many commits, takes no commit message and writes a ``.cache`` folder into the
artifact. Resuming does not need it either: the Hub keeps large-file blobs that arrived before a failure (the LFS
batch endpoint answers "already present" for them) and the preupload endpoint reports files that are already
committed unchanged, so re-running an interrupted push only sends what is missing. The files are opened without
following links when the upload starts and must be the very files that were planned, so ``--dry-run`` lists
exactly what a push sends. Tokens come from ``HF_TOKEN`` or the library's stored login; they are never printed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from k3export.artifacts import ConversionRecord, HubError, ValidationReport
from k3export.artifacts.snapshot import check_repo_id, hub_error
from k3export.files import file_sha256
from k3export.safety import check_finished, open_nofollow, real

from .card import build_model_card, check_model_card
from .detect import CARD_FILE, CHECKPOINT, ONNX, Artifact, ArtifactFile, detect_artifact

#: the Hub takes no single file above 50 GB (its storage-limits docs; 20 GB recommended): refused before uploading
HUB_MAX_FILE_BYTES = 50 * 10**9


def load_validation(folder: str | os.PathLike[str]) -> ValidationReport | None:
    """``validation.json`` of ``folder`` (`k3export.artifacts.ValidationReport`, read strictly); None when absent."""
    return ValidationReport.read_if_present(folder)


@dataclass
class PushPlan:
    """Everything one push sends, computed offline: what ``--dry-run`` prints and `push` uploads."""

    artifact: Artifact
    repo_id: str
    card: str
    validation: ValidationReport | None
    conversion: ConversionRecord | None
    warnings: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[tuple[str, int]]:
        """(path in repo, size in bytes) of everything the commit holds, the card included."""
        out = [(f.path_in_repo, f.size) for f in self.artifact.files]
        out.append((CARD_FILE, len(self.card.encode("utf-8"))))
        return sorted(out)


@dataclass
class PushResult:
    """Where a push landed: the repo (namespace filled in), the branch, the commit, the files it holds."""

    repo_id: str
    revision: str
    commit_oid: str | None
    commit_url: str | None
    files: list[tuple[str, int]]


def _changed_since_validation(artifact: Artifact, validation: ValidationReport) -> list[str]:
    """Validated files whose sha256 now differs or that are gone, and export files validation never saw."""
    uploads = {f.path_in_repo: f.local_path for f in artifact.files}
    export_files = set(artifact.export.file_names) if artifact.export is not None else set()
    changed = [name for name in validation.artifacts if name not in uploads]
    for name, path in uploads.items():
        if name not in validation.artifacts:
            if name in export_files:
                changed.append(name)
        elif file_sha256(path) != validation.artifacts[name]:
            changed.append(name)
    return changed


def plan_push(folder: str | os.PathLike[str], repo_id: str, *, force: bool = False) -> PushPlan:
    """Everything a push would send, computed locally (no network): files, sizes and the model card."""
    check_repo_id(repo_id)
    artifact = detect_artifact(folder)
    big = next((f for f in artifact.files if f.size > HUB_MAX_FILE_BYTES), None)
    if big is not None:  # the Hub would refuse it after the rest was sent
        raise HubError(f"{big.local_path}: {big.size / 1e9:.1f} GB, above the Hub's {HUB_MAX_FILE_BYTES / 1e9:.0f} GB "
                       "limit for one file; write it in smaller shards (the export's and the converter's shard "
                       "size) and push again")
    check_finished(artifact.root)
    validation = load_validation(artifact.root)
    conversion = ConversionRecord.read_if_present(artifact.root)
    warnings: list[str] = []
    if validation is None:
        if not force:
            how = (f"`k3export validate MODEL_DIR --onnx {artifact.root}` writes it" if artifact.kind != CHECKPOINT
                   else f"`k3export validate {artifact.root} --onnx EXPORT_DIR --report "
                        f"{artifact.root / ValidationReport.FILE}` writes it")
            raise HubError(f"{artifact.root}: no validation.json ({how}); pass --force to publish an unvalidated "
                           "artifact")
        warnings.append("no validation.json: publishing an unvalidated artifact (--force)")
    elif not validation.passed:
        failed = [r for r in validation.summary if not r.passed]
        detail = ""
        if failed:
            r = failed[0]
            detail = f" (first failure: {r.runtime} / {r.scenario} / {r.tensor}; {len(failed)} failing rows)"
        elif validation.localisation:
            detail = f" ({validation.localisation.splitlines()[0]})"
        if not force:
            raise HubError(
                f"{artifact.root / ValidationReport.FILE} says the validation failed{detail}; "
                "pass --force to publish anyway"
            )
        warnings.append(f"validation failed{detail}: publishing anyway (--force)")
    if validation is not None and artifact.kind == ONNX:
        changed = _changed_since_validation(artifact, validation)
        if changed and not force:
            raise HubError(f"{artifact.root / changed[0]}: changed since {artifact.root / ValidationReport.FILE} was "
                           f"written ({len(changed)} file(s) differ from the validated sha256); validate again, "
                           "or pass --force")
        if changed:
            warnings.append(f"{len(changed)} file(s) changed since validation: publishing anyway (--force)")
    card = build_model_card(artifact, repo_id, validation, conversion)
    check_model_card(card)
    return PushPlan(artifact, repo_id, card, validation, conversion, warnings + list(artifact.notes))


def _resolve_token(token: str | None) -> str:
    if token:
        return token
    from huggingface_hub import get_token

    found = get_token()
    if not found:
        raise HubError("no Hugging Face token: set HF_TOKEN or log in with `hf auth login`")
    return found


def _open_planned(f: ArtifactFile) -> Any:
    """The planned file `f`, opened without following a link and checked to be the same file as planned."""
    try:
        fd = open_nofollow(real(f.local_path))
    except OSError as exc:
        raise HubError(f"{f.local_path}: cannot be opened for upload ({exc.strerror}); it changed since the push was "
                       "planned") from None
    st = os.fstat(fd)
    if f.identity is not None and (st.st_dev, st.st_ino) != f.identity:
        os.close(fd)
        raise HubError(f"{f.local_path}: was replaced since the push was planned; run the push again")
    return os.fdopen(fd, "rb")


def push(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    force: bool = False,
    token: str | None = None,
    plan: PushPlan | None = None,
) -> PushResult:
    """Create ``repo_id`` if needed and commit the artifact in ``folder`` plus its model card in one commit."""
    plan = plan or plan_push(folder, repo_id, force=force)
    token = _resolve_token(token)
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    repo = plan.repo_id
    action = f"push to {repo}"
    try:
        if "/" not in repo:
            user = api.whoami().get("name")
            if not isinstance(user, str) or not user:
                raise HubError("cannot tell which namespace the token belongs to; pass REPO_ID as namespace/name")
            repo = f"{user}/{repo}"
            action = f"push to {repo}"
        api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo, branch=revision, exist_ok=True, repo_type="model")
        with contextlib.ExitStack() as opened:
            operations = [
                CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=opened.enter_context(_open_planned(f)))
                for f in plan.artifact.files
            ]
            operations.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=plan.card.encode("utf-8")))
            kind = "checkpoint" if plan.artifact.kind == CHECKPOINT else "ONNX export"
            message = commit_message or f"Upload K3 {kind} with k3export"
            info = api.create_commit(repo, operations, commit_message=message, revision=revision, repo_type="model")
    except HubError:
        raise
    except Exception as exc:  # every failure below the library becomes one clear line
        raise hub_error(exc, action, token) from None
    oid, url = getattr(info, "oid", None), getattr(info, "commit_url", None)
    return PushResult(repo, revision or "main", oid, url, plan.files)


__all__ = ["HUB_MAX_FILE_BYTES", "PushPlan", "PushResult", "load_validation", "plan_push", "push"]
