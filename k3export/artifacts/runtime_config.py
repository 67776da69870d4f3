"""``runtime_config.json``: what a runtime needs besides the state manifest (which files, which config)::

    {"format": "k3export.runtime_config", "format_version": 1,
     "model_file": "model.onnx",                        # relative to the export folder
     "data_files": ["model.onnx.data.00000", ...],      # every external-data file model.onnx references
     "weights_materialized": true,                      # false: a graph-only export, the data files were not written
     "weight_bytes": 123456, "opset": 27,
     "graph_form": "functions",                         # how the graph is written (GRAPH_FORMS; absent: functions)
     "config": {...},                                   # the K3Config (config.to_dict()) the graph was built from
     "session_options": {"enable_mem_pattern": false},  # onnxruntime SessionOptions attributes to set (optional)
     # an export with quantized dense projections only (export --quantize; absent otherwise):
     "quantize": "int8", "quantize_block_size": 32,     # MatMulNBits codes and the weights a scale covers
     "quantize_accuracy_level": 4,                      # MatMulNBits' accuracy_level: 4 int8 activations, 0 fp32
     # an image + text export only (absent otherwise):
     "graphs": [{"role": "vision", "model_file": "vision.onnx", "data_files": ["vision.onnx.data.00000"]},
                {"role": "embedding", "model_file": "embedding.onnx", "data_files": [...]}],
     "vision_config": {...},                            # the K3VisionConfig the image graphs were built from
     "media_placeholder_token_id": 163605}              # the token the image features replace

``graphs`` names the file of each graph besides the decoder (``model_file``) and its role, in the order a runtime
runs them (vision -> embedding -> decoder); their I/O is the manifest's. With ``graphs`` the decoder takes
``inputs_embeds`` (the embedding graph's output) instead of ``input_ids``.

The activation dtype, the inputs, outputs and states are the manifest's (`StateManifest`); tokens (bos / eos /
pad) and every model dimension are the config's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3export.safety import confined_file

from .codec import ArtifactError, Document, fail, read_json_file

MAX_INT = 2**31 - 1
MAX_LAYERS = 1 << 16

#: onnxruntime ``SessionOptions`` a k3export graph runs with, chosen by measurement (`bench/ort_options.py`,
#: docs/speed.md): without the memory pattern, which ORT plans anew for every input shape, the peak RSS of a
#: 512-token prefill on big_cfg is 572 instead of 622 MiB (64 tokens: 520 / 528), at the same speed.
ORT_SESSION_OPTIONS: dict[str, Any] = {"enable_mem_pattern": False}
#: the graph forms an export's model.onnx may be written in, default first (how each is written and which consumer
#: reads it: `graph_forms`); files written before the field existed hold the default
GRAPH_FORMS = ("functions", "standard", "inlined", "ort")
#: how an export may store its dense projections block-quantized (`k3export.converters.onnx.quantize`)
QUANTIZE_FORMS = ("int8", "int4")
#: the ``vision_config`` fields an image's feeds are checked against (`k3export.modeling.contract.vision_feeds`)
IMAGE_FEED_FIELDS = ("in_channels", "patch_size", "merge_kernel_size", "init_pos_emb_time")


@dataclass
class GraphFiles:
    """One graph of an export besides the decoder: its role (`k3export.artifacts.manifest.GRAPH_ROLES`), its file
    and the external-data files it references."""

    role: str
    model_file: str
    data_files: list[str]


@dataclass
class RuntimeConfig(Document):
    FILE = "runtime_config.json"
    FORMAT = "k3export.runtime_config"

    model_file: str
    data_files: list[str]
    weights_materialized: bool
    weight_bytes: int
    opset: int
    config: dict[str, Any]
    session_options: dict[str, Any] = field(default_factory=dict)
    graph_form: str = GRAPH_FORMS[0]
    graphs: list[GraphFiles] = field(default_factory=list)
    vision_config: dict[str, Any] | None = None
    media_placeholder_token_id: int | None = None
    quantize: str | None = None
    quantize_block_size: int | None = None
    quantize_accuracy_level: int | None = None

    def to_json(self) -> dict[str, Any]:
        """As `Document.to_json`, without the image fields in a text-only export (its file stays as it was)."""
        data = super().to_json()
        if not self.graphs and self.vision_config is None and self.media_placeholder_token_id is None:
            del data["graphs"], data["vision_config"], data["media_placeholder_token_id"]
        if self.quantize is None and self.quantize_block_size is None and self.quantize_accuracy_level is None:
            del data["quantize"], data["quantize_block_size"], data["quantize_accuracy_level"]
        return data

    def graph_files(self, role: str) -> GraphFiles | None:
        """The graph of `role`, None when the export has none."""
        return next((g for g in self.graphs if g.role == role), None)

    @staticmethod
    def config_json(config: Any) -> dict[str, Any]:
        """A `K3Config` as field ``config`` holds it: every key, as JSON spells it."""
        return json.loads(config.to_json_string(use_diff=False))

    def check(self, file: Any) -> None:
        if self.weight_bytes < 0:
            raise fail(file, "weight_bytes", f"{self.weight_bytes} is negative")
        if len(set(self.data_files)) != len(self.data_files):
            raise fail(file, "data_files", "lists a file twice")
        if self.graph_form not in GRAPH_FORMS:
            raise fail(file, "graph_form", f"is {self.graph_form!r}; this k3export writes {', '.join(GRAPH_FORMS)}")
        from .manifest import GRAPH_ROLES

        roles = [g.role for g in self.graphs]
        if (self.vision_config is None) != (not self.graphs) or (self.graphs and roles != list(GRAPH_ROLES)):
            raise fail(file, "graphs", f"roles {roles} with{'out' if self.vision_config is None else ''} a "
                       f"vision_config; an image + text export has graphs {list(GRAPH_ROLES)} and a vision_config")
        if (self.vision_config is None) != (self.media_placeholder_token_id is None):
            raise fail(file, "media_placeholder_token_id", "must be given exactly when vision_config is")
        for key in IMAGE_FEED_FIELDS if self.vision_config is not None else ():
            # what a runtime checks an image's feeds against (`contract.vision_feeds`), read from this dict so that
            # feeding an image needs no `K3VisionConfig` (transformers)
            value = self.vision_config.get(key)
            want = 2 if key == "merge_kernel_size" else 1
            values = value if isinstance(value, list) and want == 2 else [value]
            if len(values) != want or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_INT
                                              for v in values):
                expected = "two positive integers" if want == 2 else "a positive integer"
                raise fail(file, f"vision_config.{key}", f"expected {expected}, got {value!r}")
        if self.media_placeholder_token_id is not None and self.media_placeholder_token_id < 0:
            raise fail(file, "media_placeholder_token_id", f"{self.media_placeholder_token_id} is negative")
        files = [self.model_file, *(g.model_file for g in self.graphs)]
        data = [*self.data_files, *(d for g in self.graphs for d in g.data_files)]
        if len(set(files)) != len(files) or len(set(data)) != len(data) or set(files) & set(data):
            raise fail(file, "graphs", "two graphs share a model or data file")
        if self.quantize not in (None, *QUANTIZE_FORMS):
            raise fail(file, "quantize", f"is {self.quantize!r}; this k3export writes {', '.join(QUANTIZE_FORMS)}")
        bs = self.quantize_block_size
        if (self.quantize is None) != (bs is None) or (bs is not None and (bs < 16 or bs & (bs - 1))):
            raise fail(file, "quantize_block_size", f"is {bs!r}; expected a power of two >= 16 exactly when "
                                                    "quantize is given")
        level = self.quantize_accuracy_level
        if (self.quantize is None) != (level is None) or level not in (None, 0, 4):
            raise fail(file, "quantize_accuracy_level", f"is {level!r}; expected 0 or 4 exactly when quantize is given")
        for key, value in self.session_options.items():
            if not key.isidentifier() or key.startswith("_") or not isinstance(value, (bool, int, float, str)):
                raise fail(file, f"session_options.{key}", "expected an onnxruntime SessionOptions attribute and a "
                           f"scalar, got {value!r}")

    def check_files(self, folder: str | os.PathLike[str], file: Any) -> None:
        """Every path this file names lies inside `folder`; the model file and (when materialized) every data
        file exists as a regular file."""
        confined_file(folder, self.model_file, error=ArtifactError, file=file, field="model_file")
        for n, name in enumerate(self.data_files):
            confined_file(folder, name, error=ArtifactError, file=file, field=f"data_files[{n}]",
                          must_exist=self.weights_materialized)
        for n, g in enumerate(self.graphs):
            confined_file(folder, g.model_file, error=ArtifactError, file=file, field=f"graphs[{n}].model_file")
            for k, name in enumerate(g.data_files):
                confined_file(folder, name, error=ArtifactError, file=file, field=f"graphs[{n}].data_files[{k}]",
                              must_exist=self.weights_materialized)

    @classmethod
    def read(cls, folder: str | os.PathLike[str], name: str | None = None) -> RuntimeConfig:
        path, data = read_json_file(folder, name or cls.FILE)
        doc = cls.from_json(data, path)
        doc.check_files(folder, path)
        return doc

    def k3_config(self, file: Any = None) -> Any:
        """The `K3Config` of field ``config`` (bounded before anything is built from it)."""
        from k3export.modeling.configuration_k3 import K3Config

        file = Path(file) if file is not None else self.FILE
        for key, value in self.config.items():
            if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT <= value <= MAX_INT:
                raise fail(file, f"config.{key}", f"{value} is out of range")
        layers = self.config.get("num_hidden_layers")
        if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= MAX_LAYERS:
            raise fail(file, "config.num_hidden_layers", f"expected an integer in [1, {MAX_LAYERS}], got {layers!r}")
        try:
            return K3Config.from_released_dict(dict(self.config))
        except (TypeError, ValueError, KeyError) as exc:
            raise fail(file, "config", str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None

    def k3_vision_config(self, file: Any = None) -> Any:
        """The `K3VisionConfig` of field ``vision_config`` (None in a text-only export), every field checked."""
        if self.vision_config is None:
            return None
        from k3export.modeling.configuration_k3 import K3VisionConfig

        file = Path(file) if file is not None else self.FILE
        for key, value in self.vision_config.items():
            if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT <= value <= MAX_INT:
                raise fail(file, f"vision_config.{key}", f"{value} is out of range")
        try:
            return K3VisionConfig(**{k: v for k, v in self.vision_config.items() if k != "model_type"})
        except (TypeError, ValueError, KeyError) as exc:
            raise fail(file, "vision_config", str(exc).splitlines()[0] if str(exc) else type(exc).__name__) \
                from None


__all__ = ["GRAPH_FORMS", "QUANTIZE_FORMS", "GraphFiles", "ORT_SESSION_OPTIONS", "RuntimeConfig"]
