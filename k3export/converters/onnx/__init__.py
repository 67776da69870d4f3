# Copyright 2026 the k3export authors. Apache-2.0.
"""ONNX export of K3 / Kimi-Linear decoders: one graph for prefill and decode, state described by a manifest.

    from k3export.converters.onnx import export_onnx, load_export
    export_onnx(model_or_dir, "out/", dtype="bf16", opset=27)          # -> ExportResult
    export_onnx(K3Config.k3(), "out/", weights=False)                  # full graph, weights declared only
    exp = load_export("out/")                                          # manifest + runtime config (or a Hub id)

How the graph is made: `graph.K3GraphBuilder` writes the ONNX graph directly from the config, layer by layer,
mirroring ``modeling_k3.py`` (not torch.onnx tracing): the graph of the released 93-layer, 896-expert model
then costs seconds and no weight memory, the three plugin-bound ops come out as ``k3``-domain nodes with
``plugin_namespace="k3"`` and model-local FunctionProto bodies (`functions`), and nothing is frozen to a traced
length. Exactness against the PyTorch model is checked by the tests (prefill + decode, every state tensor).

Export folder
-------------
``model.onnx``                    graph (opset 27 or 28 + domain ``k3`` v1), no weight bytes inside.
``model.onnx.data.NNNNN``         external-data shards (4 KiB-aligned tensors, <= max_shard_bytes each unless one
                                  tensor is larger). Absent in a no-weights export (see ``weights_materialized``).
``state_manifest.json``           every carried state (below).
``runtime_config.json``           everything a runtime needs besides the manifest (below).
The folder is assembled as a hidden sibling ``.NAME.partial-XXXXXXXX`` and renamed into place when complete.

Graph I/O: inputs ``input_ids`` int64 [batch, seq], ``attention_mask`` int64 [batch, past_len+seq] and every
state input; outputs ``logits`` [batch, seq, vocab] (export dtype) then every ``present.*`` in manifest order. The
past length is implied by the latent caches' length. ``attention_mask`` (1 = real token, 0 = padding) lets a
batch hold prompts of different lengths, LEFT-padded: prefill with 0 over each row's leading pad tokens, then
append one column of 1 per decode step (the mask always spans every token fed so far, past and new). Semantics
are PyTorch's ``model(ids, attention_mask=mask, cache=...)``: KDA layers zero the input and beta of tokens whose
mask is 0 (they read ``mask[:, -seq:]``), so a left-padded row's state is that of the unpadded prompt; MLA layers
hide keys whose mask is 0 (they read ``mask[:, -(past_len+seq):]``) and a fully masked query gives 0. The logits
of pad positions are meaningless; those of real tokens equal the unpadded run's. Without padding feed all ones.
``export_onnx(..., attention_mask=False)`` leaves the input out (rows then share one length; runtime config
``supports_padding: false``). With ``debug_outputs=True`` the outputs end with
``hidden_states.{i}`` [batch, seq, hidden] per layer (the plain residual stream, as PyTorch's
``output_hidden_states``), for localising a mismatch.

``state_manifest.json`` (format ``k3export.state_manifest``, version 1)::

    {"format": "k3export.state_manifest", "version": 1,
     "dims": {"batch": "...", "seq": "...", "past_len": "...", "past_len+seq": "..."},   # meaning of symbols
     "inputs":  [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},         # graph inputs
                 {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "past_len+seq"]}],   # besides states
     "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", 163840]}],
     "states": [                                                   # layer order; per KDA layer q, k, v, recurrent
       {"name": "past_key_values.0.conv_state_q",   "present": "present.0.conv_state_q",   "layer": 0,
        "kind": "conv_state",      "shape": ["batch", 12288, 3], "present_shape": [...], "dtype": "bfloat16",
        "init": "zeros", "grows_along": null},
       {"name": "past_key_values.0.recurrent_state", ..., "kind": "recurrent_state",
        "shape": ["batch", 96, 128, 128], "dtype": "float32", "init": "zeros", "grows_along": null},
       {"name": "past_key_values.3.latent", "present": "present.3.latent", "layer": 3, "kind": "latent",
        "shape": ["batch", "past_len", 576], "present_shape": ["batch", "past_len+seq", 576],
        "dtype": "bfloat16", "init": "empty", "grows_along": 1}],
     "debug_outputs": []}        # or ["hidden_states.0", ...] with export_onnx(..., debug_outputs=True)

``init``: ``zeros`` = allocate the shape with batch filled in, all zeros; ``empty`` = the same with
``past_len`` = 0. After each call feed every ``present`` back as its ``name``. Dims are ints or symbol names.

``runtime_config.json`` (format ``k3export.onnx_runtime_config``, version 1): ``model_file``,
``manifest_file``, ``data_files``, ``weights_materialized`` (false: the initializers reference shards that were
not written, the graph is for inspection / engine planning only), ``weight_bytes``, ``opset``, ``ir_version``,
``dtype`` (fp32|bf16|fp16), ``logits_dtype``, ``custom_domain`` {domain, version, ops, plugin_namespace,
functions_included}, ``model_type``, ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``layer_types``
(kda|mla per layer), ``mlp_types`` (dense|moe), ``kda`` {num_heads, head_dim, conv_kernel}, ``mla``
{num_heads, kv_lora_rank, qk_rope_head_dim, latent_dim}, ``moe`` {num_experts, top_k}, ``bos_token_id``,
``eos_token_id``, ``eos_token_ids`` (list), ``pad_token_id``, ``supports_padding`` (true: the graph has the
``attention_mask`` input; false with ``attention_mask=False``), ``attention_mask_input`` (its input name, or
null), ``padding_side`` ("left", or null), ``k3_config`` (the K3Config fields that differ from defaults).

bf16 on CPU: ONNX Runtime's CPU provider has no bf16 kernels, so `lowp.emulate_low_precision` rewrites a bf16
graph into fp32 arithmetic that rounds to bf16 wherever the bf16 graph stores a bf16 value (validation only).
"""

from __future__ import annotations

from .export import (
    DEFAULT_OPSET, DTYPES, MANIFEST_FILE, MODEL_FILE, RUNTIME_CONFIG_FILE, SUPPORTED_OPSETS, ExportResult,
    LoadedExport, build_model_proto, export_onnx, load_export,
)
from .functions import DOMAIN, OPS, PLUGIN_NAMESPACE

__all__ = [
    "DEFAULT_OPSET", "DOMAIN", "DTYPES", "ExportResult", "LoadedExport", "MANIFEST_FILE", "MODEL_FILE", "OPS",
    "PLUGIN_NAMESPACE", "RUNTIME_CONFIG_FILE", "SUPPORTED_OPSETS", "build_model_proto", "export_onnx",
    "load_export",
]
