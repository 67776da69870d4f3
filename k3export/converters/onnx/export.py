# Copyright 2026 the k3export authors. Apache-2.0.
"""`export_onnx`: K3 model / checkpoint folder / config -> an export folder (see the package docstring)."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import helper

from k3export.files import read_json
from k3export.errors import ConfigError, ExportError, K3ExportError
from k3export.modeling.configuration_k3 import K3Config, K3ConfigError

from .builder import WeightSpec
from .functions import DOMAIN, DOMAIN_VERSION, OPS, PLUGIN_NAMESPACE, all_functions
from .graph import K3GraphBuilder
from .weights import (
    DEFAULT_MAX_SHARD_BYTES, ModuleSource, SafetensorsSource, WeightSource, initializer, plan_layout, write_weights,
)

SUPPORTED_OPSETS = (27, 28)
DEFAULT_OPSET = 27
IR_VERSION = 11
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
MODEL_FILE = "model.onnx"
MANIFEST_FILE = "state_manifest.json"
RUNTIME_CONFIG_FILE = "runtime_config.json"
MANIFEST_FORMAT = "k3export.state_manifest"
RUNTIME_FORMAT = "k3export.onnx_runtime_config"
SCHEMA_VERSION = 1


@dataclass
class ExportResult:
    out_dir: Path
    model_path: Path
    dtype: str
    opset: int
    weights_materialized: bool
    num_nodes: int
    num_initializers: int
    weight_bytes: int
    data_files: list[str]
    seconds: float
    manifest: dict[str, Any] = field(repr=False, default_factory=dict)
    runtime_config: dict[str, Any] = field(repr=False, default_factory=dict)


# ---------------------------------------------------------------------------------------------- input checks
def normalize_dtype(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        for k, v in DTYPES.items():
            if v == dtype:
                return k
        raise ExportError(f"unsupported export dtype {dtype}; choose one of {', '.join(DTYPES)}")
    key = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if key not in DTYPES:
        raise ExportError(f"unsupported export dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return key


def check_opset(opset: int) -> int:
    if not isinstance(opset, int) or opset not in SUPPORTED_OPSETS:
        raise ExportError(
            f"unsupported opset {opset!r}: the K3 graph needs opset >= 27 (LinearAttention, RMSNormalization) and "
            f"this onnx/onnxruntime pair supports up to {max(SUPPORTED_OPSETS)}; choose one of "
            f"{', '.join(map(str, SUPPORTED_OPSETS))}")
    return opset


def _read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ExportError(f"{folder} is not a K3 / Kimi-Linear model folder: no config.json")
    data = read_json(path, ExportError)
    if not isinstance(data, dict):
        raise ExportError(f"{path} is not a JSON object")
    return data


def resolve_model(model_or_dir: Any, weights: bool) -> tuple[K3Config, WeightSource | None, str]:
    """(config, weight source or None, description of the source)."""
    from k3export.modeling.modeling_k3 import K3ForCausalLM

    if isinstance(model_or_dir, K3ForCausalLM):
        return model_or_dir.config, (ModuleSource(model_or_dir) if weights else None), "in-memory K3ForCausalLM"
    if isinstance(model_or_dir, K3Config):
        if weights:
            raise ExportError("a bare K3Config has no weights: pass weights=False (--no-weights) or a model")
        return model_or_dir, None, "config"
    if isinstance(model_or_dir, torch.nn.Module):
        raise ExportError(f"{type(model_or_dir).__name__} is not a K3ForCausalLM")
    if not isinstance(model_or_dir, (str, os.PathLike)):
        raise ExportError(f"cannot export {type(model_or_dir).__name__}: pass a K3ForCausalLM, a K3Config or a folder")
    folder = Path(model_or_dir).expanduser()
    if not folder.is_dir():
        if folder.exists():
            raise ExportError(f"{folder} is not a folder")
        from k3export import hub  # lazy: a Hub id resolves to a local snapshot

        folder = Path(hub.snapshot(str(model_or_dir)))
    data = _read_config_json(folder)
    model_type = data.get("model_type")
    if model_type not in ("k3", "kimi_linear", "kimi_k3"):
        raise ExportError(f"{folder} is not a K3 / Kimi-Linear model folder: config.json has model_type "
                          f"{model_type!r} (expected 'k3', 'kimi_k3' or 'kimi_linear')")
    try:
        config = K3Config.from_released_dict(data)
    except (K3ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{folder / 'config.json'}: {exc}") from None
    if not weights:
        return config, None, str(folder)
    if model_type == "k3" and any(folder.glob("*.safetensors")):
        return config, SafetensorsSource(folder), str(folder)
    # released K3 (MXFP4 experts) or Kimi-Linear layout: the checkpoint readers map and decode it in memory
    model = K3ForCausalLM.from_pretrained(str(folder))
    return model.config, ModuleSource(model), str(folder)


# ---------------------------------------------------------------------------------------------- manifest
def _dims_doc() -> dict[str, str]:
    return {
        "batch": "number of sequences (any >= 1, the same for every input)",
        "seq": "new tokens in this call (prefill: prompt or chunk length, decode: 1)",
        "past_len": "tokens already processed (length of every latent cache); 0 on the first call",
        "past_len+seq": "past_len of the next call",
    }


def build_manifest(b: K3GraphBuilder) -> dict[str, Any]:
    states = []
    for s in b.states:
        states.append({
            "name": s.name, "present": s.present, "layer": s.layer, "kind": s.kind,
            "shape": list(s.shape), "present_shape": list(s.present_shape), "dtype": s.resolved_dtype(b.act.name),
            "init": "empty" if s.kind == "latent" else "zeros",
            "grows_along": 1 if s.kind == "latent" else None,
        })
    return {
        "format": MANIFEST_FORMAT,
        "version": SCHEMA_VERSION,
        "dims": _dims_doc(),
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}]
        + ([{"name": "attention_mask", "dtype": "int64", "shape": ["batch", "past_len+seq"]}]
           if b.attn_mask is not None else []),
        "outputs": [{"name": "logits", "dtype": b.act.name, "shape": ["batch", "seq",
                                                                               b.config.vocab_size]}],
        "states": states,
        "debug_outputs": list(b.debug_names),
    }


def build_runtime_config(config: K3Config, dtype: str, opset: int, data_files: list[str], materialized: bool,
                         weight_bytes: int, attention_mask: bool = True) -> dict[str, Any]:
    def _first(v):
        return v[0] if isinstance(v, list) and v else v

    eos = config.eos_token_id
    return {
        "format": RUNTIME_FORMAT,
        "version": SCHEMA_VERSION,
        "model_file": MODEL_FILE,
        "manifest_file": MANIFEST_FILE,
        "data_files": data_files,
        "weights_materialized": materialized,
        "weight_bytes": weight_bytes,
        "opset": opset,
        "ir_version": IR_VERSION,
        "dtype": dtype,
        "logits_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        "custom_domain": {"domain": DOMAIN, "version": DOMAIN_VERSION, "ops": list(OPS),
                          "plugin_namespace": PLUGIN_NAMESPACE, "functions_included": True},
        "model_type": "kimi_linear" if not config.use_attn_res and config.hidden_act == "silu" else "k3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "layer_types": config.attn_types,
        "mlp_types": config.mlp_types,
        "kda": {"num_heads": config.kda_num_heads, "head_dim": config.kda_head_dim,
                "conv_kernel": config.kda_conv_kernel},
        "mla": {"num_heads": config.num_attention_heads, "kv_lora_rank": config.kv_lora_rank,
                "qk_rope_head_dim": config.qk_rope_head_dim, "latent_dim": config.mla_latent_dim},
        "moe": {"num_experts": config.num_experts, "top_k": config.num_experts_per_token},
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "eos_token_ids": eos if isinstance(eos, list) else ([eos] if eos is not None else []),
        "pad_token_id": config.pad_token_id if config.pad_token_id is not None else _first(eos),
        "supports_padding": bool(attention_mask),
        "attention_mask_input": "attention_mask" if attention_mask else None,
        "padding_side": "left" if attention_mask else None,
        "k3_config": config.to_diff_dict() if hasattr(config, "to_diff_dict") else config.to_dict(),
    }


# ---------------------------------------------------------------------------------------------- export
def build_model_proto(config: K3Config, dtype: str, opset: int, debug_outputs: bool = False,
                      attention_mask: bool = True) -> tuple[onnx.ModelProto, K3GraphBuilder]:
    """The graph with weights declared only (initializers added by the caller)."""
    b = K3GraphBuilder(config, DTYPES[dtype], debug_outputs=debug_outputs, attention_mask=attention_mask)
    b.build()
    graph = helper.make_graph(b.nodes, "k3_decoder", b.inputs, b.outputs, initializer=b.constants)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        ir_version=IR_VERSION,
        functions=all_functions(config.kda_num_heads, opset),
        producer_name="k3export",
        doc_string="Kimi K3 decoder (prefill + decode); state I/O in state_manifest.json",
    )
    return model, b


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty; pass --overwrite (overwrite=True) to replace it")


def export_onnx(model_or_dir: Any, out_dir: str | os.PathLike[str], *, dtype: str | torch.dtype = "fp32",
                opset: int = DEFAULT_OPSET, weights: bool = True, overwrite: bool = False,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, debug_outputs: bool = False,
                attention_mask: bool = True, progress=None) -> ExportResult:
    """Export a K3 decoder to ``out_dir`` (model.onnx + sharded external data + state manifest + runtime config).

    ``model_or_dir``: a `K3ForCausalLM`, a k3export / Kimi-Linear / released K3 checkpoint folder or Hub id, or a
    `K3Config` with ``weights=False``. ``debug_outputs`` adds ``hidden_states.{i}`` [batch, seq, hidden] after
    every layer (PyTorch's ``output_hidden_states``), listed in the manifest's ``debug_outputs``.
    ``attention_mask`` (default on) adds the ``attention_mask`` input [batch, past_len+seq] for left-padded
    batches; ``False`` leaves it out (then every row of a batch must have the same length).
    The folder is built in a hidden temporary sibling and renamed into place
    at the end, so an interrupted export never leaves a complete-looking folder.
    """
    t0 = time.perf_counter()
    dtype = normalize_dtype(dtype)
    opset = check_opset(opset)
    out = Path(out_dir).expanduser().absolute()
    _prepare_out(out, overwrite)
    config, source, _ = resolve_model(model_or_dir, weights)

    model, b = build_model_proto(config, dtype, opset, debug_outputs, attention_mask)
    specs: list[WeightSpec] = list(b.weights.values())
    layout = plan_layout(specs, max_shard_bytes)
    model.graph.initializer.extend(initializer(s, loc, off) for s, loc, off in layout)
    data_files = sorted({loc for _, loc, _ in layout})
    weight_bytes = sum(s.nbytes for s in specs)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if source is not None:
            write_weights(layout, tmp, source, progress=progress)
        manifest = build_manifest(b)
        runtime = build_runtime_config(config, dtype, opset, data_files, source is not None, weight_bytes,
                                       attention_mask)
        for name, data in ((MANIFEST_FILE, manifest), (RUNTIME_CONFIG_FILE, runtime)):
            (tmp / name).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        with open(tmp / MODEL_FILE, "wb") as fh:
            fh.write(model.SerializeToString())
            fh.flush()
            os.fsync(fh.fileno())
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        out_dir=out, model_path=out / MODEL_FILE, dtype=dtype, opset=opset, weights_materialized=source is not None,
        num_nodes=len(model.graph.node), num_initializers=len(model.graph.initializer), weight_bytes=weight_bytes,
        data_files=data_files, seconds=time.perf_counter() - t0, manifest=manifest, runtime_config=runtime)


# ---------------------------------------------------------------------------------------------- loading
@dataclass
class LoadedExport:
    root: Path
    model_path: Path
    manifest: dict[str, Any]
    runtime_config: dict[str, Any]

    @property
    def states(self) -> list[dict[str, Any]]:
        return self.manifest["states"]

    def initial_state(self, batch: int) -> dict[str, Any]:
        """Zero / empty state arrays (numpy) for every state input, per the manifest."""
        import numpy as np

        np_types = {"float32": np.float32, "float16": np.float16}
        out = {}
        for s in self.states:
            if s["dtype"] not in np_types:
                raise ExportError(f"{s['name']}: dtype {s['dtype']} has no numpy type; allocate it with ml_dtypes")
            shape = [batch if d == "batch" else (0 if d == "past_len" else d) for d in s["shape"]]
            out[s["name"]] = np.zeros(shape, dtype=np_types[s["dtype"]])
        return out


def load_export(dir_or_hub_id: str | os.PathLike[str]) -> LoadedExport:
    """Read an export folder's manifest and runtime config (a Hub id is fetched through `k3export.hub.snapshot`)."""
    root = Path(dir_or_hub_id).expanduser()
    if not root.is_dir():
        from k3export import hub

        root = Path(hub.snapshot(str(dir_or_hub_id)))
    docs = {}
    for name, fmt in ((MANIFEST_FILE, MANIFEST_FORMAT), (RUNTIME_CONFIG_FILE, RUNTIME_FORMAT)):
        path = root / name
        if not path.is_file():
            raise ExportError(f"{root} is not a k3export ONNX export: {name} is missing")
        data = read_json(path, ExportError)
        if not isinstance(data, dict) or data.get("format") != fmt:
            raise ExportError(f"{path}: not a {fmt} document")
        if data.get("version") != SCHEMA_VERSION:
            raise ExportError(f"{path}: schema version {data.get('version')!r}, this k3export reads {SCHEMA_VERSION}")
        docs[name] = data
    model_path = root / docs[RUNTIME_CONFIG_FILE].get("model_file", MODEL_FILE)
    if not model_path.is_file():
        raise ExportError(f"{root}: {model_path.name} is missing")
    return LoadedExport(root, model_path, docs[MANIFEST_FILE], docs[RUNTIME_CONFIG_FILE])


__all__ = ["ExportResult", "K3ExportError", "LoadedExport", "SUPPORTED_OPSETS", "export_onnx", "load_export"]
