"""Publishing k3export artifacts on the Hugging Face Hub, and fetching them back.

Two artifact kinds can be pushed; anything else is refused:

* a converted checkpoint: ``config.json`` with ``model_type: k3``, ``*.safetensors`` weights (plus their index
  when sharded), the ``configuration_k3.py`` / ``modeling_k3.py`` remote code, ``generation_config.json``,
  tokenizer files and the optional ``conversion.json`` provenance record;
* an ONNX export, as `k3export.artifacts.load_export` accepts it: ``model.onnx``, its external data files,
  ``state_manifest.json``, ``runtime_config.json`` and the onnxruntime-genai files.

    detect.py   which kind a folder holds and the exact files to publish (`detect_artifact`)
    card.py     the generated model card: metadata, provenance, validation table (`build_model_card`)
    push.py     the offline plan (`plan_push`, what ``--dry-run`` prints) and the one-commit upload (`push`)

Fetching back is `k3export.artifacts.snapshot` (re-exported here), which every reader of a Hub id uses.
"""

from __future__ import annotations

from k3export.artifacts import HubError, snapshot

from .card import build_model_card, check_model_card
from .detect import CHECKPOINT, ONNX, Artifact, ArtifactFile, detect_artifact
from .push import HUB_MAX_FILE_BYTES, PushPlan, PushResult, load_validation, plan_push, push

__all__ = [
    "CHECKPOINT", "HUB_MAX_FILE_BYTES", "ONNX", "Artifact", "ArtifactFile", "HubError", "PushPlan", "PushResult",
    "build_model_card", "check_model_card", "detect_artifact", "load_validation", "plan_push", "push", "snapshot",
]
