# Copyright 2026 the k3export authors. Apache-2.0.
"""ONNX export of K3 / Kimi-Linear decoders: one graph for prefill and decode, state described by a manifest.

    from k3export.converters.onnx import export_onnx, load_export
    export_onnx(model_or_dir, "out/", dtype="bf16", opset=27)          # -> ExportResult
    export_onnx(K3Config.k3(), "out/", weights=False)                  # full graph, weights declared only
    exp = load_export("out/")                                          # checked ExportFolder (or a Hub id)

How the graph is made: `graph.K3GraphBuilder` writes the ONNX graph directly from the config, layer by layer,
mirroring ``modeling_k3.py`` (not torch.onnx tracing): the graph of the released 93-layer, 896-expert model
then costs seconds and no weight memory, the three plugin-bound ops come out as ``k3``-domain nodes with
``plugin_namespace="k3"`` and model-local FunctionProto bodies (`functions`), and nothing is frozen to a traced
length. Exactness against the PyTorch model is checked by the tests (prefill + decode, every state tensor).

Export folder
-------------
``model.onnx``                    graph (opset 23 to 28 + domain ``k3`` v1), no weight bytes inside.
``model.onnx.data.NNNNN``         external-data shards (4 KiB-aligned tensors, <= max_shard_bytes each unless one
                                  tensor is larger). Absent in a no-weights export (see ``weights_materialized``).
``state_manifest.json``           `k3export.artifacts.StateManifest`: every input, output and carried state.
``runtime_config.json``           `k3export.artifacts.RuntimeConfig`: model file, data files, the K3Config.
``vision.onnx``, ``embedding.onnx`` an image + text model's image graphs (`vision`), each with its data shards, and the
                                  processor files; ``model.onnx`` then takes ``inputs_embeds`` (docs/vision.md).
The folder is assembled as a hidden sibling ``.NAME.partial-XXXXXXXX``, checked with `load_export`
(`k3export.artifacts.ExportFolder`) and renamed into place when complete.

Graph I/O (names, shapes and dtypes from `k3export.modeling.contract`): inputs ``input_ids`` int64 [batch,
sequence_length], ``attention_mask`` int64 [batch, total_sequence_length] and every state input
``past_key_values.{i}.*``; outputs ``logits`` [batch, sequence_length, vocab] (export dtype) then every
``present.{i}.*``. The past length is the MLA key/value length. ``attention_mask`` (1 = real token, 0 = padding)
lets a batch hold prompts of different lengths, LEFT-padded: prefill with 0 over each row's leading pad tokens,
then append one column of 1 per decode step (the mask always spans every token fed so far, past and new;
`k3export.runtime.loop` builds it). Semantics are PyTorch's ``model(ids, attention_mask=mask, cache=...)``: KDA
layers zero the input and beta of tokens whose mask is 0, so a left-padded row's state is that of the unpadded
prompt; MLA layers hide keys whose mask is 0 and a fully masked query gives 0. The logits of pad positions are
meaningless; those of real tokens equal the unpadded run's. ``export_onnx(..., attention_mask=False)`` leaves
the input out (rows then share one length). With ``debug_outputs=True`` the outputs end with
``hidden_states.{i}`` [batch, sequence_length, hidden] per layer (the plain residual stream, as PyTorch's
``output_hidden_states``), for localising a mismatch. ``layers=range(a, b)`` exports a pipeline stage.

bf16 on CPU: ONNX Runtime's CPU provider has no bf16 kernels, so `lowp.emulate_low_precision` rewrites a bf16
graph into fp32 arithmetic that rounds to bf16 wherever the bf16 graph stores a bf16 value (validation only).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names resolve on first use (PEP 562), so running an export (`runtime.ort_session`) imports neither torch nor
# transformers: only exporting needs the model.
_HOMES = {
    "MODEL_FILE": "k3export.artifacts", "ExportFolder": "k3export.artifacts", "RuntimeConfig": "k3export.artifacts",
    "StateManifest": "k3export.artifacts",
    "DEFAULT_OPSET": ".export", "SUPPORTED_OPSETS": ".export", "ExportResult": ".export",
    "build_model_proto": ".export", "export_onnx": ".export", "load_export": ".export",
    "DOMAIN": ".functions", "OPS": ".functions", "PLUGIN_NAMESPACE": ".functions",
}
__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from k3export.artifacts import MODEL_FILE, ExportFolder, RuntimeConfig, StateManifest

    from .export import DEFAULT_OPSET, SUPPORTED_OPSETS, ExportResult, build_model_proto, export_onnx, load_export
    from .functions import DOMAIN, OPS, PLUGIN_NAMESPACE


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value
