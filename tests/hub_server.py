"""A loopback stand-in for the parts of the Hugging Face Hub HTTP API that huggingface_hub 2.x calls.

Implemented (model repos only, read from huggingface_hub's own client code):

* ``POST /api/repos/create``                                  create_repo (409 when it exists)
* ``GET  /api/whoami-v2``                                     whoami
* ``POST /api/models/{repo}/branch/{branch}``                 create_branch
* ``POST /api/models/{repo}/preupload/{rev}``                 upload modes + remote oids (unchanged files are skipped)
* ``POST /{repo}.git/info/lfs/objects/batch``                 LFS batch API ("already present" = no actions)
* ``PUT  /lfs-upload/{oid}`` / ``POST /lfs-verify``           basic LFS transfer (body checked against its sha256)
* ``POST /api/models/{repo}/commit/{rev}``                    NDJSON commit (regular + lfsFile + deletedFile)
* ``GET  /api/models/{repo}[/revision/{rev}]``                model info (sha, siblings)
* ``GET  /api/models/{repo}/tree/{rev}``                      tree listing (with lfs metadata)
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``                   downloads with ETag / X-Repo-Commit / Range
* ``POST /api/validate-yaml``                                 card metadata check, using huggingface_hub's parser
* ``GET  /api/agent-harnesses``                               the user-agent registry the client fetches (empty)

Every request is recorded (``requests``), every blob that arrives is recorded (``uploads``), and ``drop_once``
makes the server close the connection without answering, once, on a chosen operation. It binds 127.0.0.1 only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".onnx", ".data", ".bin", ".pt", ".model", ".onnx_data")
LFS_MIN_SIZE = 1 << 20


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class Entry:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def oid(self) -> str:  # git object id as the Hub reports it
        return git_blob_oid(lfs_pointer(self.sha256, len(self.data)) if self.lfs else self.data)


@dataclass
class Commit:
    oid: str
    message: str
    parent: str | None
    files: dict[str, Entry]


@dataclass
class Repo:
    repo_id: str
    owner: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)


@dataclass
class Upload:
    kind: str  # "lfs" (PUT body) or "regular" (inline in a commit)
    path: str | None
    oid: str
    size: int


class HubState:
    def __init__(self, tokens: dict[str, str]):
        self.lock = threading.Lock()
        self.tokens = dict(tokens)  # token -> user name
        self.repos: dict[str, Repo] = {}
        self.commits: dict[str, Commit] = {}
        self.lfs_store: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.unknown: list[tuple[str, str]] = []
        self.uploads: list[Upload] = []
        self.commit_log: list[Commit] = []
        self.yaml_checks: list[dict[str, Any]] = []
        self.drop_once: set[str] = set()  # "commit", "lfs-put", "preupload", "resolve-get"
        self.dropped: list[str] = []
        self.authorizations: list[str] = []

    def take_drop(self, what: str) -> bool:
        with self.lock:
            if what in self.drop_once:
                self.drop_once.discard(what)
                self.dropped.append(what)
                return True
        return False

    def head_files(self, repo: Repo, rev: str) -> tuple[str, dict[str, Entry]] | None:
        oid = repo.branches.get(rev)
        if oid is None and rev in self.commits:
            oid = rev
        if oid is None:
            return None
        return oid, self.commits[oid].files


def validate_card_content(content: str) -> list[str]:
    """Errors the Hub would report for a README's metadata, checked with huggingface_hub's own parsers."""
    import yaml
    from huggingface_hub import ModelCard
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    errors: list[str] = []
    try:
        card = ModelCard(content)
    except Exception as exc:
        return [f"card does not parse: {exc}"]
    data = card.data.to_dict()
    if content.startswith("---"):
        raw = yaml.safe_load(content.split("---", 2)[1])
        if not isinstance(raw, dict):
            errors.append("metadata is not a mapping")
    for key in ("license", "library_name", "pipeline_tag", "license_name", "license_link"):
        if key in data and not isinstance(data[key], str):
            errors.append(f"'{key}' must be a string")
    if "tags" in data and (not isinstance(data["tags"], list) or not all(isinstance(t, str) for t in data["tags"])):
        errors.append("'tags' must be a list of strings")
    base = data.get("base_model")
    for ref in base if isinstance(base, list) else ([base] if base is not None else []):
        try:
            validate_repo_id(ref)
        except HFValidationError as exc:
            errors.append(f"'base_model' is not a repo id: {exc}")
    if data.get("license") == "other" and not ("license_name" in data and "license_link" in data):
        errors.append("license 'other' needs license_name and license_link")
    return errors


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        return

    # -- helpers ------------------------------------------------------------------------------------------------
    @property
    def state(self) -> HubState:
        return self.server.state

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            for _ in range(1 << 20):
                line = self.rfile.readline(1 << 16).strip()
                size = int(line.split(b";")[0] or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1 << 16).strip():
                        pass
                    break
                out += self.rfile.read(size)
                self.rfile.readline(8)
            return bytes(out)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str | None, message: str, *, head: bool = False, extra: dict[str, str] | None = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers, head=head)

    def _drop(self) -> None:
        """Close the connection without any answer (a network failure, as the client sees it)."""
        self.close_connection = True
        try:
            self.connection.shutdown(2)
        except OSError:
            pass

    def _user(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            self.state.authorizations.append("bearer")
            return self.state.tokens.get(auth[len("Bearer ") :])
        return None

    def _repo(self, repo_id: str, *, write: bool, head: bool = False) -> Repo | None:
        user = self._user()
        repo = self.state.repos.get(repo_id)
        if write and user is None:
            self._error(401, None, "Invalid credentials in Authorization header", head=head)
            return None
        if repo is None or (repo.private and user != repo.owner):
            self._error(404, "RepoNotFound", "Repository not found", head=head)
            return None
        if write and user != repo.owner and repo.owner != user:
            self._error(403, None, "You don't have the rights to write to this repo", head=head)
            return None
        return repo

    # -- routing ------------------------------------------------------------------------------------------------
    def _route(self, method: str) -> None:
        parts = urlsplit(self.path)
        raw = [unquote(p) for p in parts.path.split("/")[1:]]
        query = parse_qs(parts.query)
        with self.state.lock:
            self.state.requests.append((method, parts.path))
        handled = self._dispatch(method, raw, query)
        if not handled:
            with self.state.lock:
                self.state.unknown.append((method, parts.path))
            if method != "HEAD":
                self._body()
            self._error(404, None, f"stand-in does not implement {method} {parts.path}", head=method == "HEAD")

    def _dispatch(self, method: str, p: list[str], query: dict[str, list[str]]) -> bool:
        if method == "POST" and p == ["api", "repos", "create"]:
            self._create_repo()
        elif method == "GET" and p == ["api", "whoami-v2"]:
            user = self._user()
            if user is None:
                self._error(401, None, "Invalid credentials in Authorization header")
            else:
                self._json(200, {"type": "user", "name": user, "orgs": []})
        elif method == "GET" and p == ["api", "agent-harnesses"]:
            # huggingface_hub fetches this registry once per process to tag its user agent
            self._json(200, {"standardEnvVars": [], "harnesses": {}})
        elif method == "POST" and p == ["api", "validate-yaml"]:
            body = json.loads(self._body() or b"{}")
            errors = validate_card_content(body.get("content", ""))
            self.state.yaml_checks.append({"content": body.get("content", ""), "errors": errors})
            if errors:
                self._json(400, {"errors": [{"message": e} for e in errors], "warnings": []})
            else:
                self._json(200, {"errors": [], "warnings": []})
        elif len(p) >= 4 and p[0] == "api" and p[1] == "models":
            repo_id = f"{p[2]}/{p[3]}"
            rest = p[4:]
            if method == "GET" and not rest:
                self._model_info(repo_id, "main")
            elif method == "GET" and len(rest) == 2 and rest[0] == "revision":
                self._model_info(repo_id, rest[1])
            elif method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                self._tree(repo_id, rest[1], "/".join(rest[2:]))
            elif method == "POST" and len(rest) == 2 and rest[0] == "preupload":
                self._preupload(repo_id, rest[1])
            elif method == "POST" and len(rest) == 2 and rest[0] == "commit":
                self._commit(repo_id, rest[1])
            elif method == "POST" and len(rest) == 2 and rest[0] == "branch":
                self._branch(repo_id, rest[1])
            else:
                return False
        elif method == "POST" and len(p) == 6 and p[1].endswith(".git") and p[2:] == ["info", "lfs", "objects", "batch"]:
            self._lfs_batch(f"{p[0]}/{p[1][: -len('.git')]}")
        elif method == "PUT" and len(p) == 2 and p[0] == "lfs-upload":
            self._lfs_put(p[1])
        elif method == "POST" and p == ["lfs-verify"]:
            body = json.loads(self._body() or b"{}")
            ok = body.get("oid") in self.state.lfs_store
            self._json(200 if ok else 404, {"ok": ok})
        elif method in ("HEAD", "GET") and len(p) >= 5 and p[2] == "resolve":
            self._resolve(f"{p[0]}/{p[1]}", p[3], "/".join(p[4:]), head=method == "HEAD")
        else:
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802
        self._route("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._route("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._route("PUT")

    # -- endpoints ----------------------------------------------------------------------------------------------
    def _create_repo(self) -> None:
        body = json.loads(self._body() or b"{}")
        user = self._user()
        if user is None:
            self._error(401, None, "Invalid credentials in Authorization header")
            return
        namespace = body.get("organization") or user
        repo_id = f"{namespace}/{body.get('name')}"
        if namespace != user:
            self._error(403, None, f"You don't have the rights to create a repo under {namespace}")
            return
        with self.state.lock:
            if repo_id in self.state.repos:
                # like the Hub, the conflict answer still carries the repo url (create_repo(exist_ok=True) reads it)
                message = "You already created this model repo"
                body = {"error": message, "url": f"{self.server.url}/{repo_id}"}
                self._json(409, body, {"X-Error-Message": message})
                return
            private = bool(body.get("private")) or body.get("visibility") == "private"
            repo = Repo(repo_id, user, private)
            root = Commit(hashlib.sha1(f"init {repo_id}".encode()).hexdigest(), "initial commit", None, {})
            self.state.commits[root.oid] = root
            repo.branches["main"] = root.oid
            self.state.repos[repo_id] = repo
        self._json(200, {"url": f"{self.server.url}/{repo_id}", "name": repo_id})

    def _branch(self, repo_id: str, branch: str) -> None:
        body = json.loads(self._body() or b"{}")
        repo = self._repo(repo_id, write=True)
        if repo is None:
            return
        with self.state.lock:
            if branch in repo.branches:
                self._error(409, None, "Reference already exists")
                return
            start = body.get("startingPoint") or "main"
            found = self.state.head_files(repo, start)
            if found is None:
                self._error(404, "RevisionNotFound", "Invalid rev id")
                return
            repo.branches[branch] = found[0]
        self._json(200, {})

    def _model_info(self, repo_id: str, rev: str) -> None:
        repo = self._repo(repo_id, write=False)
        if repo is None:
            return
        found = self.state.head_files(repo, rev)
        if found is None:
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return
        oid, files = found
        self._json(
            200,
            {
                "id": repo_id,
                "modelId": repo_id,
                "author": repo.owner,
                "sha": oid,
                "private": repo.private,
                "siblings": [{"rfilename": name} for name in sorted(files)],
                "tags": [],
            },
        )

    def _tree(self, repo_id: str, rev: str, prefix: str) -> None:
        repo = self._repo(repo_id, write=False)
        if repo is None:
            return
        found = self.state.head_files(repo, rev)
        if found is None:
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return
        out = []
        for name, entry in sorted(found[1].items()):
            if prefix and not name.startswith(prefix.rstrip("/") + "/"):
                continue
            item: dict[str, Any] = {"type": "file", "path": name, "size": len(entry.data), "oid": entry.oid}
            if entry.lfs:
                item["lfs"] = {"oid": entry.sha256, "size": len(entry.data), "pointerSize": len(lfs_pointer(entry.sha256, len(entry.data)))}
            out.append(item)
        self._json(200, out)

    def _preupload(self, repo_id: str, rev: str) -> None:
        if self.state.take_drop("preupload"):
            self._drop()
            return
        body = json.loads(self._body() or b"{}")
        repo = self._repo(repo_id, write=True)
        if repo is None:
            return
        found = self.state.head_files(repo, rev)
        current = found[1] if found else {}
        out = []
        for f in body.get("files", []):
            path, size = f["path"], int(f["size"])
            lfs = path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE
            existing = current.get(path)
            oid = None
            if existing is not None:
                oid = existing.sha256 if existing.lfs else git_blob_oid(existing.data)
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": out})

    def _lfs_batch(self, repo_id: str) -> None:
        body = json.loads(self._body() or b"{}")
        repo = self._repo(repo_id, write=True)
        if repo is None:
            return
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            item: dict[str, Any] = {"oid": oid, "size": size}
            if oid not in self.state.lfs_store:
                item["actions"] = {
                    "upload": {"href": f"{self.server.url}/lfs-upload/{oid}"},
                    "verify": {"href": f"{self.server.url}/lfs-verify"},
                }
            objects.append(item)
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(), {"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_put(self, oid: str) -> None:
        data = self._body()
        if self.state.take_drop("lfs-put"):
            self._drop()
            return
        if hashlib.sha256(data).hexdigest() != oid:
            self._error(400, None, "sha256 mismatch")
            return
        with self.state.lock:
            self.state.lfs_store[oid] = data
            self.state.uploads.append(Upload("lfs", None, oid, len(data)))
        self._send(200, b"", {"ETag": f'"{oid[:32]}"'})

    def _commit(self, repo_id: str, rev: str) -> None:
        raw = self._body()
        if self.state.take_drop("commit"):
            self._drop()
            return
        repo = self._repo(repo_id, write=True)
        if repo is None:
            return
        lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            self._error(400, None, "missing header line")
            return
        message = lines[0]["value"]["summary"]
        with self.state.lock:
            found = self.state.head_files(repo, rev)
            if found is None or rev not in repo.branches:
                self._error(404, "RevisionNotFound", "Invalid rev id")
                return
            parent, files = found
            files = dict(files)
            regular: list[Upload] = []
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                if key == "file":
                    data = base64.b64decode(value["content"])
                    files[value["path"]] = Entry(data, False)
                    regular.append(Upload("regular", value["path"], git_blob_oid(data), len(data)))
                elif key == "lfsFile":
                    blob = self.state.lfs_store.get(value["oid"])
                    if blob is None:
                        self._error(400, None, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                        return
                    files[value["path"]] = Entry(blob, True)
                elif key == "deletedFile":
                    files.pop(value["path"], None)
                else:
                    self._error(400, None, f"unsupported commit operation {key}")
                    return
            oid = hashlib.sha1(f"{parent}:{message}:{time.monotonic_ns()}:{sorted(files)}".encode()).hexdigest()
            commit = Commit(oid, message, parent, files)
            self.state.commits[oid] = commit
            self.state.commit_log.append(commit)
            self.state.uploads.extend(regular)
            repo.branches[rev] = oid
        self._json(200, {"commitUrl": f"{self.server.url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None, "success": True})

    def _resolve(self, repo_id: str, rev: str, path: str, *, head: bool) -> None:
        repo = self._repo(repo_id, write=False, head=head)
        if repo is None:
            return
        found = self.state.head_files(repo, rev)
        if found is None:
            self._error(404, "RevisionNotFound", "Invalid rev id", head=head)
            return
        oid, files = found
        entry = files.get(path)
        if entry is None:
            self._error(404, "EntryNotFound", "Entry not found", head=head, extra={"X-Repo-Commit": oid})
            return
        if not head and self.state.take_drop("resolve-get"):
            self._drop()
            return
        data = entry.data
        headers = {"X-Repo-Commit": oid, "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if entry.lfs:
            headers["ETag"] = f'"{entry.sha256}"'
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(len(data))
        else:
            headers["ETag"] = f'"{entry.oid}"'
        status = 200
        range_header = self.headers.get("Range")
        if range_header and range_header.startswith("bytes=") and not head:
            start_s, _, end_s = range_header[len("bytes=") :].partition("-")
            start = int(start_s or 0)
            end = int(end_s) if end_s else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data = data[start : end + 1]
            status = 206
        if head:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
        else:
            self._send(status, data, headers)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, state: HubState):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class HubStandIn:
    """Run the stand-in in a background thread: ``with HubStandIn({"tok": "alice"}) as hub: ...``."""

    def __init__(self, tokens: dict[str, str]):
        self.state = HubState(tokens)
        self._server = _Server(self.state)
        self.url = self._server.url
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # conveniences for assertions
    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        repo = self.state.repos[repo_id]
        found = self.state.head_files(repo, rev)
        assert found is not None
        return {name: entry.data for name, entry in found[1].items()}

    def is_lfs(self, repo_id: str, path: str, rev: str = "main") -> bool:
        found = self.state.head_files(self.state.repos[repo_id], rev)
        assert found is not None
        return found[1][path].lfs
