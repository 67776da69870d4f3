# Copyright 2026 the k3export authors. Apache-2.0.
"""Publishing k3export artifacts on the Hugging Face Hub, and fetching them back.

Two artifact kinds can be pushed:

* a converted checkpoint: ``config.json`` with ``model_type: k3``, ``*.safetensors`` weights (plus
  ``model.safetensors.index.json`` when sharded), the ``configuration_k3.py`` / ``modeling_k3.py`` remote code,
  ``generation_config.json``, tokenizer files and the optional ``conversion.json`` provenance record;
* an ONNX export: ``model.onnx``, the external data files it references, ``state_manifest.json`` and
  ``runtime_config.json``.

Anything else is refused. A push needs a passing ``validation.json`` (written by ``k3export validate``) unless
forced; the generated model card carries the provenance and the validation table.

Uploads go through one ``HfApi.create_commit`` call: the exact artifact file list plus the card (held in memory,
the local folder is never written to) land in a single commit with the caller's message. ``upload_large_folder``
is not used: it splits the work into many commits, takes no commit message and writes a ``.cache`` folder into
the artifact. Resuming does not need it either: the Hub keeps large-file blobs that arrived before a failure
(the LFS batch endpoint answers "already present" for them) and the preupload endpoint reports files that are
already committed unchanged, so re-running an interrupted push only sends what is missing.

Only regular files inside the folder are published: a symlink that leaves it (or dangles), a pipe, socket or device
is refused when it would be part of the artifact and listed as not uploaded otherwise; every path the artifact
names (external data) must stay inside the folder (`k3export.safety.confined_file`). The files are opened without
following links when the upload starts and must be the very files that were planned, so ``--dry-run`` lists
exactly what a push sends.

Tokens come from ``HF_TOKEN`` or the library's stored login; they are never printed or logged.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3export.artifacts import ConversionRecord, ExportFolder, ValidationReport
from k3export.artifacts.validation import meaningless
from k3export.errors import K3ExportError
from k3export.safety import check_finished, confined_file, hub_cache_roots, is_within, open_nofollow, real
from k3export.files import file_sha256, read_json
from k3export.units import format_bytes

__all__ = [
    "Artifact",
    "ArtifactFile",
    "HubError",
    "PushPlan",
    "PushResult",
    "ValidationReport",
    "build_model_card",
    "detect_artifact",
    "load_validation",
    "plan_push",
    "push",
    "snapshot",
]

DEFAULT_BASE_MODEL = "moonshotai/Kimi-K3"
#: the Hub takes no single file above 50 GB (its storage-limits docs; 20 GB recommended): refused before uploading
HUB_MAX_FILE_BYTES = 50 * 10**9
CHECKPOINT = "checkpoint"
ONNX = "onnx"

# Files a checkpoint folder may hold besides weights (matched on the name at the folder's top level).
_TOKENIZER_FILES = re.compile(
    r"^(tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|tiktoken\.model"
    r"|tokenizer\.model|vocab\.(json|txt)|merges\.txt|chat_template\.(jinja|json)|tokenization_[A-Za-z0-9_]+\.py)$"
)
_CHECKPOINT_EXTRAS = re.compile(
    r"^(config\.json|generation_config\.json|model\.safetensors\.index\.json|conversion\.json|validation\.json"
    r"|[A-Za-z0-9_]+\.py|LICENSE(\.[A-Za-z0-9]+)?|NOTICE(\.[A-Za-z0-9]+)?)$"
)
_ONNX_EXTRAS = re.compile(
    r"^(state_manifest\.json|runtime_config\.json|config\.json|generation_config\.json|conversion\.json"
    r"|validation\.json|LICENSE(\.[A-Za-z0-9]+)?|NOTICE(\.[A-Za-z0-9]+)?)$"
)


class HubError(K3ExportError):
    """A push or download that cannot be done as asked (bad folder, bad repo id, auth, network)."""


# --------------------------------------------------------------------------------------------------------------
# Artifact detection
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArtifactFile:
    path_in_repo: str
    local_path: Path
    size: int
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the planned file: the upload sends that file only


@dataclass
class Artifact:
    root: Path
    kind: str  # CHECKPOINT or ONNX
    files: list[ArtifactFile]
    skipped: list[str] = field(default_factory=list)  # present locally but not part of the artifact
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _read_json(path: Path, what: str) -> Any:
    return read_json(path, HubError, f"{path}: {what}")


def _top_level_entries(root: Path) -> tuple[set[str], dict[str, str]]:
    """(names of the regular files at the top of `root`, links inside it resolved; name -> why another entry
    cannot be published). Folders and dot files are neither."""
    roots = hub_cache_roots(root)
    files: set[str] = set()
    unsafe: dict[str, str] = {}
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        target = real(p)
        if p.is_symlink() and not any(is_within(target, r) for r in roots):
            unsafe[p.name] = f"symlink leaving the folder (to {target})"
            continue
        try:
            st = os.stat(target)
        except OSError:
            unsafe[p.name] = "dangling symlink"
            continue
        if stat.S_ISREG(st.st_mode):
            files.add(p.name)
        elif not stat.S_ISDIR(st.st_mode):
            unsafe[p.name] = "not a regular file (pipe, socket or device)"
    return files, unsafe


def _artifact_file(root: Path, name: str, owner: str) -> ArtifactFile:
    """`name` (a top-level file or an external-data location) as a file to upload, confined to `root`."""
    path = confined_file(root, name, f"file named by {owner}", error=HubError)
    st = os.stat(real(path))
    return ArtifactFile(name, path, st.st_size, (st.st_dev, st.st_ino))


def _looks_like_artifact(name: str) -> bool:
    return (name.endswith((".safetensors", ".onnx")) or name.startswith("model.onnx.data") or name == "README.md"
            or bool(_CHECKPOINT_EXTRAS.match(name) or _ONNX_EXTRAS.match(name) or _TOKENIZER_FILES.match(name)))


def _scan_onnx_external_data(model_path: Path) -> list[str]:
    """Locations of external data referenced by an ONNX model, read from the protobuf without `onnx`.

    ``TensorProto.external_data`` entries are ``StringStringEntryProto {key: "location", value: <file>}``; their
    encoding is ``0a 08 'location' 12 <varint length> <bytes>``, which this scan looks for.
    """
    marker = b"\x0a\x08location\x12"
    found: list[str] = []
    size = model_path.stat().st_size
    if size == 0:
        return found
    with model_path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = mm.find(marker)
        while pos != -1:
            i = pos + len(marker)
            length, shift = 0, 0
            while i < size and shift < 35:
                byte = mm[i]
                i += 1
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            if 0 < length < 4096 and i + length <= size:
                try:
                    name = mm[i : i + length].decode("utf-8")
                except UnicodeDecodeError:
                    name = ""
                if name and name not in found:
                    found.append(name)
            pos = mm.find(marker, i)
    return found


def _safe_relative(root: Path, name: str, owner: str) -> Path | None:
    """``root/name`` for an external-data location named by `owner`, None when nothing is there; a location that
    is absolute, uses ``..``, resolves outside `root` or is not a regular file is refused."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or "\x00" in name:
        raise HubError(f"{owner} references '{name}', which lies outside {root}")
    if not os.path.lexists(root / rel):
        return None
    return confined_file(root, name, f"external data of {owner}", error=HubError)


def detect_artifact(folder: str | os.PathLike[str]) -> Artifact:
    """Classify ``folder`` as a converted checkpoint or an ONNX export and list the files to publish."""
    root = Path(folder).expanduser()
    if not root.exists():
        raise HubError(f"{root}: no such folder")
    if not root.is_dir():
        raise HubError(f"{root}: not a folder (push takes the folder of a converted checkpoint or an ONNX export)")
    root = root.resolve()
    names, unsafe = _top_level_entries(root)
    for name, why in unsafe.items():
        if _looks_like_artifact(name):
            raise HubError(f"{root / name}: {why}; refusing to publish it (replace it with the file itself)")

    config: dict[str, Any] | None = None
    if "config.json" in names:
        loaded = _read_json(root / "config.json", "config.json")
        config = loaded if isinstance(loaded, dict) else None
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    is_k3 = config is not None and config.get("model_type") == "k3"
    has_onnx = "model.onnx" in names

    if is_k3 and weights and has_onnx:
        raise HubError(
            f"{root} holds both a converted checkpoint (*.safetensors) and an ONNX export (model.onnx); "
            "push them from separate folders"
        )
    if is_k3 and weights:
        artifact = _detect_checkpoint(root, names, weights, config or {})
    elif has_onnx:
        artifact = _detect_onnx(root, names, config)
    else:
        artifact = None
    if artifact is not None:
        artifact.skipped = sorted(artifact.skipped + [f"{name} ({why})" for name, why in unsafe.items()])
        return artifact

    found = ", ".join(sorted(names)[:8]) or "nothing"
    hints = []
    if config is not None and not is_k3:
        hints.append(f"config.json has model_type {config.get('model_type')!r}, expected 'k3'")
    elif config is None and "config.json" in names:
        hints.append("config.json is not a JSON object")
    elif is_k3 and not weights:
        hints.append("config.json is a k3 config but there are no *.safetensors weights")
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise HubError(
        f"{root} is neither a converted K3 checkpoint (config.json with model_type 'k3' + *.safetensors) nor an "
        f"ONNX export (model.onnx + state_manifest.json + runtime_config.json){hint}; found: {found}"
    )


def _detect_checkpoint(root: Path, names: set[str], weights: list[str], config: dict[str, Any]) -> Artifact:
    notes: list[str] = []
    index_name = "model.safetensors.index.json"
    if index_name in names:
        index = _read_json(root / index_name, index_name)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise HubError(f"{root / index_name}: no 'weight_map' object")
        missing = sorted({str(v) for v in weight_map.values()} - set(weights))
        if missing:
            raise HubError(f"{root / index_name} references shard(s) that are not in the folder: {', '.join(missing)}")
    elif len(weights) > 1:
        raise HubError(f"{root}: {len(weights)} safetensors files but no {index_name} to tie them together")

    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict):
        for target in auto_map.values():
            refs = target if isinstance(target, list) else [target]
            for ref in refs:
                if isinstance(ref, str) and "--" not in ref and "." in ref:
                    module = ref.split(".", 1)[0] + ".py"
                    if module not in names:
                        raise HubError(
                            f"{root / 'config.json'}: auto_map points to {ref!r} but {module} is not in the folder"
                        )
    for code in ("configuration_k3.py", "modeling_k3.py"):
        if code not in names:
            notes.append(f"{code} is absent: loading needs the k3export package installed (no remote code)")
    if "generation_config.json" not in names:
        notes.append("generation_config.json is absent")
    if not any(_TOKENIZER_FILES.match(n) for n in names):
        notes.append("no tokenizer files")

    keep: list[str] = []
    skipped: list[str] = []
    for name in sorted(names):
        if name == "README.md":
            continue  # replaced by the generated card
        if name.endswith(".safetensors") or _CHECKPOINT_EXTRAS.match(name) or _TOKENIZER_FILES.match(name):
            keep.append(name)
        else:
            skipped.append(name)
    skipped.extend(sorted(p.name + "/" for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")))
    files = [_artifact_file(root, n, "the folder") for n in keep]
    return Artifact(root, CHECKPOINT, files, skipped, notes, config)


def _detect_onnx(root: Path, names: set[str], config: dict[str, Any] | None) -> Artifact:
    missing = [n for n in ("state_manifest.json", "runtime_config.json") if n not in names]
    if missing:
        raise HubError(
            f"{root}: model.onnx is there but {' and '.join(missing)} is missing (not a k3export ONNX export)"
        )
    _read_json(root / "state_manifest.json", "state_manifest.json")
    runtime = _read_json(root / "runtime_config.json", "runtime_config.json")
    runtime = runtime if isinstance(runtime, dict) else {}
    # a graph-only export (`--no-weights`) declares its shards without writing them: publishable, with a note
    materialized = runtime.get("weights_materialized") is not False

    models = ["model.onnx"] + sorted(n for n in names if n.endswith(".onnx") and n != "model.onnx")
    references: list[tuple[str, str]] = []
    for model in models:
        references += [(model, loc) for loc in _scan_onnx_external_data(root / model)]
    listed = runtime.get("data_files")
    if isinstance(listed, list):
        references += [("runtime_config.json", str(loc)) for loc in listed]
    data: list[str] = []
    absent: list[str] = []
    for owner, location in references:
        path = _safe_relative(root, location, root / owner)
        if location in data or location in absent:
            continue
        if path is not None:
            data.append(location)
        elif materialized:
            raise HubError(f"{root / owner} references external data '{location}', which is not in the folder")
        else:
            absent.append(location)
    notes = []
    if absent:
        notes.append(
            f"graph-only export (weights_materialized: false): {len(absent)} external data file(s) are declared "
            "but not present, the published graph cannot run"
        )

    from k3export import genai

    keep = list(models) + [d for d in data if d not in models]
    keep += [n for n in genai.export_files(root) if n not in keep]
    keep_set = set(keep)
    skipped: list[str] = []
    for name in sorted(names):
        if name in keep_set or name == "README.md":
            continue
        if _ONNX_EXTRAS.match(name) or _TOKENIZER_FILES.match(name):
            keep.append(name)
        else:
            skipped.append(name)
    skipped.extend(
        sorted(
            p.name + "/"
            for p in root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and not any(d.startswith(p.name + "/") for d in keep)
        )
    )
    files = [_artifact_file(root, n, "the folder" if n in names or "/" in n else "model.onnx") for n in keep]
    return Artifact(root, ONNX, files, skipped, notes, config)


# --------------------------------------------------------------------------------------------------------------
# validation.json
# --------------------------------------------------------------------------------------------------------------


def load_validation(folder: str | os.PathLike[str]) -> ValidationReport | None:
    """``validation.json`` of ``folder`` (`k3export.artifacts.ValidationReport`, read strictly); None when absent."""
    return ValidationReport.read_if_present(folder)


def _load_conversion(root: Path) -> ConversionRecord | None:
    """``conversion.json`` of ``root`` (`k3export.artifacts.ConversionRecord`, read strictly); None when absent."""
    return ConversionRecord.read_if_present(root)


# --------------------------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------------------------


def _existing_card_license(root: Path) -> str | None:
    readme = root / "README.md"
    if not readme.is_file():
        return None
    from huggingface_hub import ModelCard

    try:
        card = ModelCard(readme.read_text(encoding="utf-8"), ignore_metadata_errors=True)
    except Exception:  # an unparsable README only loses its license hint
        return None
    value = getattr(card.data, "license", None)
    return value if isinstance(value, str) and value else None


def _fmt_float(value: float | None) -> str:
    if value is None:
        return "–"
    if value == 0:
        return "0"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if abs(value) >= 1e-3 and abs(value) < 1e4:
        return f"{value:.4f}".rstrip("0").rstrip(".")
    return f"{value:.3e}"


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def build_model_card(
    artifact: Artifact, repo_id: str | None, validation: ValidationReport | None, conversion: ConversionRecord | None
) -> str:
    """The README.md published with the artifact: YAML metadata, provenance and the validation table."""
    import yaml

    source = conversion.source if conversion is not None else None
    base_model = (source.repo_id if source is not None else None) or DEFAULT_BASE_MODEL
    license_ = _existing_card_license(artifact.root) or "other"

    fmt_tag = "safetensors" if artifact.kind == CHECKPOINT else "onnx"
    tags = ["k3export", "kimi-k3", fmt_tag]
    if artifact.kind == CHECKPOINT and any(f.path_in_repo == "modeling_k3.py" for f in artifact.files):
        tags.append("custom_code")
    meta: dict[str, Any] = {
        "library_name": "transformers" if artifact.kind == CHECKPOINT else "onnx",
        "license": license_,
    }
    if license_ == "other":
        meta["license_name"] = "source-model-license"
        meta["license_link"] = f"https://huggingface.co/{base_model}"
    meta.update({"base_model": base_model, "pipeline_tag": "text-generation", "tags": tags})
    header = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).strip()

    title = repo_id.split("/")[-1] if repo_id else artifact.root.name
    what = "A converted checkpoint (safetensors)" if artifact.kind == CHECKPOINT else "An ONNX export"
    lines = [f"---\n{header}\n---", "", f"# {title}", ""]
    lines.append(
        f"{what} of [{base_model}](https://huggingface.co/{base_model}), produced with k3export. "
        "The license of the source model applies."
    )
    lines.append("")
    if artifact.kind == CHECKPOINT:
        target = repo_id or "<repo_id>"
        lines += [
            "## Usage",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{target}", trust_remote_code=True)',
            "```",
            "",
        ]
    else:
        lines += [
            "## Usage",
            "",
            "`model.onnx` (with its external data files) runs under ONNX Runtime; `runtime_config.json` and "
            "`state_manifest.json` describe the inputs, outputs and recurrent state the runtime has to carry.",
            "",
        ]

    lines += ["## Conversion", ""]
    if conversion is None or source is None:
        lines += ["No `conversion.json` was found next to the artifact: the provenance is not recorded.", ""]
    else:
        lines.append(f"- Tool: {_md(conversion.tool)} {_md(conversion.tool_version)}")
        lines.append(f"- Created: {_md(conversion.created)}")
        if source.repo_id:
            rev = f" at revision `{_md(source.revision)}`" if source.revision else ""
            lines.append(f"- Source: `{_md(source.repo_id)}`{rev}")
        else:
            lines.append(f"- Source: local folder `{_md(source.name)}`")
        lines.append("")
        for label, rows in (("Source files", source.files), ("Outputs", conversion.outputs)):
            if rows:
                lines += [f"{label}:", "", "| File | Bytes | SHA-256 |", "|---|---:|---|"]
                lines += [f"| {_md(row.name)} | {row.bytes} | `{row.sha256}` |" for row in rows]
                lines.append("")
        if conversion.options:
            dump = json.dumps(conversion.options, indent=2, sort_keys=True)
            lines += ["Options:", "", "```json", dump, "```", ""]
        if conversion.skipped:
            lines += ["Skipped during conversion:", "", "```json", json.dumps(conversion.skipped, indent=2), "```", ""]

    lines += ["## Validation", ""]
    if validation is None:
        lines += ["**Not validated**: no `validation.json` was published with this artifact.", ""]
    else:
        verdict = "passed" if validation.passed else "**FAILED**"
        runtimes = ", ".join(validation.runtimes) or "–"
        lines.append(f"Cross-runtime validation {verdict} (reference: {_md(validation.reference)}; runtimes: "
                     f"{_md(runtimes)}).")
        extra = [f"created {_md(validation.created)}", f"k3export {_md(validation.tool_version)}"]
        if validation.scenarios:
            extra.append("scenarios: " + ", ".join(_md(s) for s in validation.scenario_names))
        lines.append("Report " + "; ".join(extra) + ".")
        for runtime, reason in validation.skipped.items():
            lines.append(f"- Not run: {_md(runtime)} ({_md(reason)})")
        for kind, metrics in validation.tolerance_overrides.items():
            forced = any(meaningless(v) for v in metrics.values())
            lines.append(f"- Tolerance override: {_md(kind)} " + ", ".join(f"{k}={v:g}" for k, v in metrics.items())
                         + (" (**forced**: this tolerance passes any output, so this comparison means nothing)"
                            if forced else ""))
        if validation.localisation:
            lines += ["", "First divergence:", "", "```", validation.localisation, "```"]
        lines.append("")
        if validation.summary:
            lines += [
                "| Runtime | Scenario | Tensor | max abs | RMS rel | cosine | top-1 agree | greedy agree | Result |",
                "|---|---|---|---:|---:|---:|---:|---:|---|",
            ]
            for row in validation.summary:
                lines.append(
                    f"| {_md(row.runtime)} | {_md(row.scenario)} | {_md(row.tensor)} | "
                    f"{_fmt_float(row.max_abs)} | {_fmt_float(row.rms_rel)} | {_fmt_float(row.cosine)} | "
                    f"{_fmt_float(row.top1_agreement)} | {_fmt_float(row.greedy_agreement)} | "
                    f"{'pass' if row.passed else 'FAIL'} |"
                )
            lines.append("")

    lines += ["## Files", "", "| File | Size |", "|---|---:|"]
    for f in artifact.files:
        lines.append(f"| {_md(f.path_in_repo)} | {format_bytes(f.size)} |")
    lines.append("")
    return "\n".join(lines)


def check_model_card(card: str) -> dict[str, Any]:
    """Parse ``card`` with huggingface_hub's own card parser (offline) and return its metadata."""
    from huggingface_hub import ModelCard

    try:
        parsed = ModelCard(card)
    except Exception as exc:  # ValueError for bad YAML, anything else from the parser
        raise HubError(f"generated model card does not parse: {exc}") from None
    data = parsed.data.to_dict()
    for key in ("library_name", "license", "base_model", "pipeline_tag", "tags"):
        if key not in data:
            raise HubError(f"generated model card lacks '{key}' metadata")
    return data


# --------------------------------------------------------------------------------------------------------------
# Push
# --------------------------------------------------------------------------------------------------------------


@dataclass
class PushPlan:
    artifact: Artifact
    repo_id: str
    card: str
    validation: ValidationReport | None
    conversion: ConversionRecord | None
    warnings: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[tuple[str, int]]:
        """(path in repo, size in bytes) of everything the commit holds, README.md included."""
        out = [(f.path_in_repo, f.size) for f in self.artifact.files]
        out.append(("README.md", len(self.card.encode("utf-8"))))
        return sorted(out)


@dataclass
class PushResult:
    repo_id: str
    revision: str
    commit_oid: str | None
    commit_url: str | None
    files: list[tuple[str, int]]


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise HubError(f"invalid repo id {repo_id!r}: {exc}") from None


def _changed_since_validation(artifact: Artifact, validation: ValidationReport) -> list[str]:
    """Validated files whose sha256 now differs or that are gone, and graph / data files validation never saw."""
    uploads = {f.path_in_repo: f.local_path for f in artifact.files}
    changed = [name for name in validation.artifacts if name not in uploads]
    for name, path in uploads.items():
        if name not in validation.artifacts:
            if name.endswith(".onnx") or name.startswith("model.onnx.data") or name in (
                    "state_manifest.json", "runtime_config.json"):
                changed.append(name)
            continue
        if file_sha256(path) != validation.artifacts[name]:
            changed.append(name)
    return changed


def plan_push(folder: str | os.PathLike[str], repo_id: str, *, force: bool = False) -> PushPlan:
    """Everything a push would send, computed locally (no network): files, sizes and the model card."""
    _check_repo_id(repo_id)
    artifact = detect_artifact(folder)
    big = next((f for f in artifact.files if f.size > HUB_MAX_FILE_BYTES), None)
    if big is not None:  # the Hub would refuse it after the rest was sent
        raise HubError(f"{big.local_path}: {big.size / 1e9:.1f} GB, above the Hub's {HUB_MAX_FILE_BYTES / 1e9:.0f} GB "
                       "limit for one file; write it in smaller shards (the export's and the converter's shard "
                       "size) and push again")
    check_finished(artifact.root)
    validation = load_validation(artifact.root)
    conversion = _load_conversion(artifact.root)
    warnings: list[str] = []
    if force and artifact.kind == ONNX:
        # --force skips the validated digests, which vouch for the files otherwise: the folder gets the checks
        # every runtime makes before it reads a byte (a data shard cut short is refused, not published)
        ExportFolder.load(artifact.root)
    if validation is None:
        if not force:
            how = (f"`k3export validate MODEL_DIR --onnx {artifact.root}` writes it" if artifact.kind != CHECKPOINT
                   else f"`k3export validate {artifact.root} --onnx EXPORT_DIR --report "
                        f"{artifact.root / 'validation.json'}` writes it")
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
                f"{artifact.root / 'validation.json'} says the validation failed{detail}; "
                "pass --force to publish anyway"
            )
        warnings.append(f"validation failed{detail}: publishing anyway (--force)")
    if validation is not None and artifact.kind != CHECKPOINT:
        changed = _changed_since_validation(artifact, validation)
        if changed and not force:
            raise HubError(f"{artifact.root / changed[0]}: changed since {artifact.root / 'validation.json'} was "
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


def _scrub(message: str, token: str | None) -> str:
    if token:
        message = message.replace(token, "***")
    return message


def _hub_error(exc: BaseException, action: str, token: str | None) -> HubError:
    """Translate huggingface_hub / HTTP failures into one clear `HubError` line (never carrying the token)."""
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
            return HubError(
                _scrub(
                    f"{action}: the Hub refused the token (HTTP {status}); check HF_TOKEN / `hf auth login` "
                    "and its write access",
                    token,
                )
            )
        return HubError(_scrub(f"{action}: the Hub answered HTTP {status}: {first}", token))
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    if any(isinstance(e, (httpx2.TransportError, ConnectionError, TimeoutError)) for e in chain):
        root = chain[-1]
        return HubError(
            _scrub(
                f"{action}: network failure ({type(root).__name__}: {str(root) or 'connection lost'}); run the same "
                "command again to resume: files that reached the Hub are not sent twice",
                token,
            )
        )
    return HubError(_scrub(f"{action}: {type(exc).__name__}: {first}", token))


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
            operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=plan.card.encode("utf-8")))
            kind = "checkpoint" if plan.artifact.kind == CHECKPOINT else "ONNX export"
            message = commit_message or f"Upload K3 {kind} with k3export"
            info = api.create_commit(repo, operations, commit_message=message, revision=revision, repo_type="model")
    except HubError:
        raise
    except Exception as exc:  # every failure below the library becomes one clear line
        raise _hub_error(exc, action, token) from None
    oid, url = getattr(info, "oid", None), getattr(info, "commit_url", None)
    return PushResult(repo, revision or "main", oid, url, plan.files)


# --------------------------------------------------------------------------------------------------------------
# Download
# --------------------------------------------------------------------------------------------------------------


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
    _check_repo_id(value)
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            value,
            revision=revision,
            repo_type="model",
            allow_patterns=allow_patterns,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            token=token,
        )
    except Exception as exc:
        from huggingface_hub.errors import LocalEntryNotFoundError

        if isinstance(exc, LocalEntryNotFoundError):
            raise HubError(f"download of {value}: the Hub is unreachable and no cached copy exists") from None
        raise _hub_error(exc, f"download of {value}", token) from None
    return Path(folder)

