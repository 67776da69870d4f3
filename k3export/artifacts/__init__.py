"""One strict, versioned type per artifact file k3export writes; the type that writes a file is the one that
reads it (`Document.write` / `Document.read`), and every refusal is one `ArtifactError` line naming the file and
the field.

    StateManifest     state_manifest.json   graph inputs, outputs and carried states (from the contract)
    RuntimeConfig     runtime_config.json   model file, external-data files, the K3Config
    ValidationReport  validation.json       the verdict of ``k3export validate``
    ConversionRecord  conversion.json       the provenance of ``k3export convert``
    StagePlanFile     a stage plan file     the layer range of each pipeline stage (``--stage-plan``)
    EngineSidecar     <engine>.json         how a TensorRT engine was built (a build asked the same keeps it)
    ResumeRecord      .k3export-resume/     a resumable export's key; ShardRecord: each data shard it finished
    State             <name>.k3state        a saved decode state: a prefix's state tensors, its tokens, the export
                                            (and manifest) sha256 it belongs to (safetensors)
    ExportFolder      an ONNX export folder, checked as a whole by `load_export` before any runtime sees it
                      (its optional ORT form, ``model.genai.onnx`` + its ``model.genai.experts.q8.NNNNN``, included)

`snapshot` turns a Hub repo id (or a local path) into the local folder these readers take; `HubError` is its
refusal, and the push side's (`k3export.hub`).

Nothing here imports torch: the contract's names (`k3export.modeling.contract`) load without it, and an export
folder builds its `K3Config` (a transformers config) only on first use of `ExportFolder.config`.
"""

from __future__ import annotations

from .codec import ArtifactError, Document, write_bytes_atomic
from .conversion import ConversionRecord, ConversionSource, FileDigest
from .engine_sidecar import EngineNode, EngineProfile, EngineSidecar
from .export_folder import GENAI_DATA_PREFIX, GENAI_MODEL_FILE, MODEL_FILE, ExportFolder, load_export
from .manifest import HIDDEN, GraphSpec, StateEntry, StateManifest, TensorSpec, image_graph_specs
from .resume import ResumeRecord, ShardRecord
from .runtime_config import ORT_SESSION_OPTIONS, GraphFiles, RuntimeConfig
from .saved_state import State, manifest_sha256
from .snapshot import HubError, snapshot
from .stage_plan import StagePlanFile
from .validation import QualityEntry, RunEntry, ScenarioEntry, StepRow, SummaryRow, ToleranceEntry, ValidationReport

__all__ = [
    "ArtifactError", "ConversionRecord", "ConversionSource", "Document", "EngineNode", "EngineProfile",
    "EngineSidecar", "ExportFolder", "FileDigest", "GENAI_DATA_PREFIX", "GENAI_MODEL_FILE", "GraphFiles",
    "GraphSpec", "HIDDEN", "HubError", "MODEL_FILE", "ORT_SESSION_OPTIONS", "QualityEntry", "ResumeRecord", "RunEntry",
    "RuntimeConfig", "ScenarioEntry",
    "ShardRecord", "StagePlanFile", "State", "StateEntry", "StateManifest", "StepRow", "SummaryRow", "TensorSpec",
    "ToleranceEntry", "ValidationReport", "image_graph_specs", "load_export", "manifest_sha256", "snapshot",
    "write_bytes_atomic",
]
