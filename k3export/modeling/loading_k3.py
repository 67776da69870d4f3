# Copyright 2026 the k3export authors. Apache-2.0.
"""Loading a K3 checkpoint: strict `from_pretrained` for `K3ForCausalLM`, and the checks that run before it.

`K3ForCausalLM` takes `K3LoadingMixin` first, as transformers keeps its loading in ``modeling_utils`` apart from
the models: ``modeling_k3.py`` stays the maths. A folder in our layout loads through transformers, strictly (a
missing or mis-shaped tensor is a `K3CheckpointError` naming it, never a silent re-initialisation), and only from
safetensors. Other layouts (released K3 with MXFP4 experts, Kimi-Linear, ours with experts kept in MXFP4) load
through the loader k3export registers under the ``k3export.loaders`` entry point.

This file is copied next to saved checkpoints with the modeling files (``trust_remote_code``): it imports only
the configuration and the contract, and never imports k3export.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from .configuration_k3 import MODEL_TYPES, K3Config
from .contract import parameter_count


class K3CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the configuration; the message names the tensor."""


class K3LoadingMixin:
    """`from_pretrained` for a K3 model class: our layout through transformers (strictly), others through k3export."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args: Any, **kwargs: Any):
        """transformers' `from_pretrained`, plus ``strict`` (default True): a missing or mis-shaped tensor raises
        `K3CheckpointError`. A folder in another layout (`foreign_layout`) goes to k3export's loader instead."""
        path = str(pretrained_model_name_or_path)
        config_json = read_config_json(path)
        if config_json is None and os.path.isdir(path):
            checks = k3export_entry_point("checks")
            if checks is not None and os.path.lexists(os.path.join(path, "config.json")):
                checks(path)  # k3export's reader names what is wrong with config.json, as the CLI does
            raise K3CheckpointError(f"{path}: no readable config.json (a JSON object): not a model folder")
        layout = foreign_layout(config_json)
        if layout is not None:
            loader = layout_loader()
            if loader is None:  # copied next to a checkpoint without k3export installed
                raise ValueError(f"{pretrained_model_name_or_path} is a {layout} checkpoint; loading it needs "
                                 "k3export (pip install k3export)")
            return loader(pretrained_model_name_or_path, config_json,
                          torch_dtype=kwargs.get("torch_dtype", kwargs.get("dtype")))
        if config_json is not None and kwargs.get("config") is None:
            kwargs["config"] = K3Config.from_dict(config_json)  # config.json is read once per load
        # with k3export installed, its readers' file checks (one set for the CLI and this path) run first
        checks = k3export_entry_point("checks") if os.path.isdir(path) else None
        after_load = checks(path) if checks is not None else None
        if config_json is not None and os.path.isdir(path):
            check_weight_bytes(path, kwargs["config"])
        # Strict by default: a missing or mis-shaped tensor is an error naming it, never a silent re-init.
        want_info = kwargs.pop("output_loading_info", False)
        strict = kwargs.pop("strict", True)
        kwargs.setdefault("ignore_mismatched_sizes", True)
        kwargs.setdefault("use_safetensors", True)  # never unpickle a .bin a user hands us
        model, info = super().from_pretrained(  # type: ignore[misc]
            pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        if strict:
            problems = [f"missing tensor {k!r}" for k in sorted(info.get("missing_keys", []))]
            for item in info.get("mismatched_keys", []):
                key, ckpt_shape, model_shape = (list(item) + [None, None])[:3]
                problems.append(f"tensor {key!r} has shape {tuple(ckpt_shape or ())} in the checkpoint, "
                                f"expected {tuple(model_shape or ())}")
            if problems:
                shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else "")
                raise K3CheckpointError(f"checkpoint {pretrained_model_name_or_path}: {shown}")
        if after_load is not None:
            after_load(model)  # a warning naming each tensor that holds NaN / Inf
        return (model, info) if want_info else model


def check_weight_bytes(folder: str, config: K3Config) -> None:
    """Refuse, before anything is allocated, a config that needs more bytes than the folder's shards hold
    (at least 2 bytes per parameter): a config bomb fails in milliseconds with one line."""
    shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    if not shards:
        raise K3CheckpointError(f"{folder}: no *.safetensors weights (weights are read from safetensors only, "
                                "never from pickles)")
    have = sum(os.path.getsize(os.path.join(folder, f)) for f in shards)
    need = 2 * parameter_count(config)
    if need > have:
        raise K3CheckpointError(f"{folder}/config.json: the config needs at least {need:,} bytes of weights "
                                f"(hidden_size={config.hidden_size}, num_hidden_layers={config.num_hidden_layers}, "
                                f"num_experts={config.num_experts}) but the safetensors files hold {have:,}")


def read_config_json(path: Any) -> dict[str, Any] | None:
    """The local folder's config.json as a dict, or None (a Hub id, or no readable JSON object there)."""
    config_path = os.path.join(str(path), "config.json")
    if not os.path.isfile(config_path):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return config if isinstance(config, dict) else None


def foreign_layout(config: dict[str, Any] | None) -> str | None:
    """'kimi_k3', 'kimi_linear' or 'mxfp4' when a folder with this config.json needs k3export's loader
    (another layout, or ours with experts kept in MXFP4), else None."""
    if config is None:
        return None
    if config.get("model_type") in MODEL_TYPES and config["model_type"] != K3Config.model_type:
        return config["model_type"]
    return "mxfp4" if config.get("quantization_config") else None


def k3export_entry_point(name: str) -> Callable[..., Any] | None:
    """k3export's ``k3export.loaders`` entry point `name`, or None without k3export: ``layouts`` loads other
    layouts, ``checks`` checks a folder of ours before transformers reads it (and returns the check of the
    loaded model)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="k3export.loaders"):
        if ep.name == name:
            try:
                return ep.load()
            except ImportError:  # the entry point is installed but k3export cannot be imported (hidden, removed)
                return None
    return None


def layout_loader() -> Callable[..., Any] | None:
    """k3export's loader for other layouts (entry point ``k3export.loaders:layouts``), or None without k3export."""
    return k3export_entry_point("layouts")


__all__ = ["K3CheckpointError", "K3LoadingMixin", "check_weight_bytes", "foreign_layout", "k3export_entry_point",
           "layout_loader", "read_config_json"]
