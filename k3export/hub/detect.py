"""What a folder publishes: a converted checkpoint or an ONNX export, and the exact files of it (`detect_artifact`).

A checkpoint is ``config.json`` with ``model_type: k3`` plus ``*.safetensors`` (tied by the index when sharded),
with the remote code, generation config, tokenizer files and records beside it. An ONNX export is what
`k3export.artifacts.load_export` accepts (both documents read strictly, the graph and every external-data
reference checked): its graph, data shards, documents, onnxruntime-genai files and records. Anything else in the
folder is listed as not uploaded; an entry that is not a regular file inside the folder (a link leaving it, a
dangling link, a pipe) is refused when its name belongs to the artifact.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3export import genai
from k3export.artifacts import (MODEL_FILE, ConversionRecord, ExportFolder, HubError, RuntimeConfig, StateManifest,
                                ValidationReport, load_export)
from k3export.files import INDEX_NAME, read_json
from k3export.safety import confined_file, hub_cache_roots, is_within, real

CHECKPOINT = "checkpoint"
ONNX = "onnx"
#: the model card's name in a Hub repo: generated for every push, never taken from the folder
CARD_FILE = "README.md"

# Files a folder may hold besides weights and graphs (matched on the name at the folder's top level).
_TOKENIZER_FILES = re.compile(
    r"^(tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|tiktoken\.model"
    r"|tokenizer\.model|vocab\.(json|txt)|merges\.txt|chat_template\.(jinja|json)|tokenization_[A-Za-z0-9_]+\.py)$"
)
_RECORDS = "|".join(re.escape(n) for n in (ConversionRecord.FILE, ValidationReport.FILE))
_LEGAL = r"LICENSE(\.[A-Za-z0-9]+)?|NOTICE(\.[A-Za-z0-9]+)?"
_CHECKPOINT_EXTRAS = re.compile(
    rf"^(config\.json|generation_config\.json|{re.escape(INDEX_NAME)}|{_RECORDS}|[A-Za-z0-9_]+\.py|{_LEGAL}"
    r"|preprocessor_config\.json|processor_config\.json)$"
)
_ONNX_EXTRAS = re.compile(
    rf"^({re.escape(StateManifest.FILE)}|{re.escape(RuntimeConfig.FILE)}|config\.json|generation_config\.json"
    rf"|{_RECORDS}|{_LEGAL})$"
)


@dataclass(frozen=True)
class ArtifactFile:
    """One file to publish: its path in the repo, where it is, and what `detect_artifact` saw of it."""

    path_in_repo: str
    local_path: Path
    size: int
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the planned file: the upload sends that file only


@dataclass
class Artifact:
    """A folder's publishable artifact: its kind, the files to send, and what stays home."""

    root: Path
    kind: str  # CHECKPOINT or ONNX
    files: list[ArtifactFile]
    skipped: list[str] = field(default_factory=list)  # present locally but not part of the artifact
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] | None = None  # config.json, when the folder has one
    export: ExportFolder | None = None  # an ONNX export, as `load_export` checked it

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


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


def _artifact_file(root: Path, name: str) -> ArtifactFile:
    """`name` (a top-level file or an external-data location) as a file to upload, confined to `root`."""
    path = confined_file(root, name, error=HubError)
    st = os.stat(real(path))
    return ArtifactFile(name, path, st.st_size, (st.st_dev, st.st_ino))


def _looks_like_artifact(name: str) -> bool:
    return (name.endswith((".safetensors", ".onnx")) or name.startswith(MODEL_FILE + ".data") or name == CARD_FILE
            or bool(_CHECKPOINT_EXTRAS.match(name) or _ONNX_EXTRAS.match(name) or _TOKENIZER_FILES.match(name)))


def _subfolders(root: Path, keep: list[str]) -> list[str]:
    """The folders of `root` (``name/``) that hold none of the files in `keep`: not uploaded."""
    return sorted(p.name + "/" for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and not any(k.startswith(p.name + "/") for k in keep))


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
        loaded = read_json(root / "config.json", HubError, f"{root / 'config.json'}: config.json")
        config = loaded if isinstance(loaded, dict) else None
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    # ours: a text checkpoint (model_type k3) or an image + text one, in K3ForConditionalGeneration's layout (the
    # released model_type, our architecture name: the released folder itself is not a converted checkpoint)
    is_k3 = config is not None and (config.get("model_type") == "k3" or (
        config.get("model_type") == "kimi_k3" and "K3ForConditionalGeneration" in (config.get("architectures") or [])))
    has_onnx = MODEL_FILE in names

    if is_k3 and weights and has_onnx:
        raise HubError(f"{root} holds both a converted checkpoint (*.safetensors) and an ONNX export ({MODEL_FILE}); "
                       "push them from separate folders")
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
        f"ONNX export ({MODEL_FILE} + {StateManifest.FILE} + {RuntimeConfig.FILE}){hint}; found: {found}"
    )


def _detect_checkpoint(root: Path, names: set[str], weights: list[str], config: dict[str, Any]) -> Artifact:
    notes: list[str] = []
    if INDEX_NAME in names:
        index = read_json(root / INDEX_NAME, HubError, f"{root / INDEX_NAME}: {INDEX_NAME}")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise HubError(f"{root / INDEX_NAME}: no 'weight_map' object")
        missing = sorted({str(v) for v in weight_map.values()} - set(weights))
        if missing:
            raise HubError(f"{root / INDEX_NAME} references shard(s) that are not in the folder: {', '.join(missing)}")
    elif len(weights) > 1:
        raise HubError(f"{root}: {len(weights)} safetensors files but no {INDEX_NAME} to tie them together")

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
    for name in sorted(names - {CARD_FILE}):  # the folder's README is replaced by the generated card
        if name.endswith(".safetensors") or _CHECKPOINT_EXTRAS.match(name) or _TOKENIZER_FILES.match(name):
            keep.append(name)
        else:
            skipped.append(name)
    skipped += _subfolders(root, [])
    files = [_artifact_file(root, n) for n in keep]
    return Artifact(root, CHECKPOINT, files, skipped, notes, config)


def _detect_onnx(root: Path, names: set[str], config: dict[str, Any] | None) -> Artifact:
    missing = [n for n in (StateManifest.FILE, RuntimeConfig.FILE) if n not in names]
    if missing:
        raise HubError(f"{root}: {MODEL_FILE} is there but {' and '.join(missing)} is missing (not a k3export ONNX "
                       "export)")
    export = load_export(root)  # what every runtime checks before it reads a byte
    runtime = export.runtime
    # a graph-only export (`--no-weights`) declares its shards without writing them: publishable, with a note
    absent = [] if runtime.weights_materialized else [n for n in runtime.data_files if not os.path.lexists(root / n)]
    notes = []
    if absent:
        notes.append(
            f"graph-only export (weights_materialized: false): {len(absent)} external data file(s) are declared "
            "but not present, the published graph cannot run"
        )
    graphs = [runtime.model_file] + ([export.ort_form_path.name] if export.ort_form_path is not None else [])
    graphs += [g.model_file for g in runtime.graphs]  # an image + text export's vision and embedding graphs
    declared = [*runtime.data_files, *export.ort_form_data, *(n for g in runtime.graphs for n in g.data_files)]
    data = [n for n in declared if runtime.weights_materialized or os.path.lexists(root / n)]
    keep = graphs + data
    if runtime.graphs:  # the image processor that feeds the vision graph: its settings and the code AutoProcessor
        from transformers.utils import IMAGE_PROCESSOR_NAME  # loads them with

        from k3export.modeling.image_processing_k3 import CODE_FILES, PROCESSOR_CONFIG

        keep += [n for n in (IMAGE_PROCESSOR_NAME, PROCESSOR_CONFIG, *CODE_FILES) if n in names and n not in keep]
    keep += [n for n in genai.export_files(root) if n not in keep]
    skipped: list[str] = []
    for name in sorted(names - set(keep) - {CARD_FILE}):
        if _ONNX_EXTRAS.match(name) or _TOKENIZER_FILES.match(name):
            keep.append(name)
        else:
            skipped.append(name)
    skipped += _subfolders(root, keep)
    files = [_artifact_file(root, n) for n in keep]
    return Artifact(root, ONNX, files, skipped, notes, config, export)


__all__ = ["CARD_FILE", "CHECKPOINT", "ONNX", "Artifact", "ArtifactFile", "detect_artifact"]
