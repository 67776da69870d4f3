"""A local folder for a Hub repo id or a local path (`snapshot`), and the Hub's failures as one `HubError` line.

Every reader of an artifact (the checkpoint loaders, `load_export`, ``k3export push``) takes a folder; `snapshot`
turns a Hub id into one through the huggingface_hub cache, pinned to one commit. `check_repo_id` and `hub_error`
are shared with the push side (`k3export.hub`): a repo id is checked before any request, and every failure below
huggingface_hub (HTTP status, network, missing revision) becomes one line that never carries the token.
"""

from __future__ import annotations

import os
from pathlib import Path

from k3export.errors import K3ExportError


class HubError(K3ExportError):
    """A push or download that cannot be done as asked (bad folder, bad repo id, auth, network)."""


def check_repo_id(repo_id: str) -> None:
    """`HubError` unless `repo_id` is a repo id the Hub accepts (huggingface_hub's own check, offline)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise HubError(f"invalid repo id {repo_id!r}: {exc}") from None


def _scrub(message: str, token: str | None) -> str:
    return message.replace(token, "***") if token else message


def hub_error(exc: BaseException, action: str, token: str | None) -> HubError:
    """`exc` from huggingface_hub / HTTP as one clear `HubError` line about `action` (never carrying `token`)."""
    import httpx2
    from huggingface_hub import errors as hf_errors

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return HubError(_scrub(f"{action}: revision not found ({first})", token))
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return HubError(_scrub(f"{action}: repository not found, or the token has no access to it ({first})", token))
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return HubError(_scrub(f"{action}: the Hub refused the token (HTTP {status}); check HF_TOKEN / "
                                   "`hf auth login` and its write access", token))
        return HubError(_scrub(f"{action}: the Hub answered HTTP {status}: {first}", token))
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    if any(isinstance(e, (httpx2.TransportError, ConnectionError, TimeoutError)) for e in chain):
        root = chain[-1]
        return HubError(_scrub(f"{action}: network failure ({type(root).__name__}: {str(root) or 'connection lost'}); "
                               "run the same command again to resume: files that reached the Hub are not sent twice",
                               token))
    return HubError(_scrub(f"{action}: {type(exc).__name__}: {first}", token))


def _looks_like_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or value.count("/") > 1 or (os.sep != "/" and os.sep in value)


def snapshot(
    repo_id_or_path: str | os.PathLike[str],
    revision: str | None = None,
    *,
    allow_patterns: list[str] | str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | None = None,
) -> Path:
    """A local folder holding ``repo_id_or_path``: local folders pass through, Hub repos go through the cache.

    ``revision`` (branch, tag or commit) is resolved once to a commit and the returned folder is that commit's
    snapshot, so every file comes from the same revision. Without network, an already cached snapshot is used.
    """
    if isinstance(repo_id_or_path, os.PathLike):
        path = Path(repo_id_or_path).expanduser()
        if not path.is_dir():
            raise HubError(f"{path}: no such folder")
        return path.resolve()
    value = str(repo_id_or_path)
    local = Path(value).expanduser()
    if local.is_dir():
        return local.resolve()
    if _looks_like_path(value):
        raise HubError(f"{value}: no such folder (and not a Hub repo id)")
    check_repo_id(value)
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(value, revision=revision, repo_type="model", allow_patterns=allow_patterns,
                                   cache_dir=str(cache_dir) if cache_dir is not None else None, token=token)
    except Exception as exc:  # every failure below the library becomes one clear line
        from huggingface_hub.errors import LocalEntryNotFoundError

        if isinstance(exc, LocalEntryNotFoundError):
            raise HubError(f"download of {value}: the Hub is unreachable and no cached copy exists") from None
        raise hub_error(exc, f"download of {value}", token) from None
    return Path(folder)


__all__ = ["HubError", "check_repo_id", "hub_error", "snapshot"]
