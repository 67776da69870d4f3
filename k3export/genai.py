# Copyright 2026 the k3export authors. Apache-2.0.
"""onnxruntime-genai's runtime contract, written once from `k3export.modeling.contract` (as genai's model builder
writes ``genai_config.json``): ``write_genai_config(export_dir, config)``.

What onnxruntime-genai 0.18 needs, measured (tests/genai):

* ``model.type`` ``"decoder"``; the config is strict (an unknown key fails to load). Keys that select another cache
  (``layer_types`` -> LFM2's conv cache) must stay out.
* State names are templates (``%d`` = layer). genai finds the KV layers and the recurrent layers by matching the
  graph's input names against ``past_key_names`` and ``past_conv_names``, so a hybrid model lists every template
  and each layer carries one kind. Per KDA layer exactly one conv state [batch, C, kernel-1] and one recurrent state
  [batch, H, K, V] (the ort form's V-major: the manifest's ``axes``), static except batch, the same shape and dtype
  in every layer (genai sizes all from the first).
  Per MLA layer a key and a value of equal shape [batch, heads, past, head_size] (our latent halves, heads = 1).
* ``search.past_present_share_buffer`` false: with true, genai preallocates the KV cache at ``max_length`` and
  feeds a static mask; our graph concatenates the past (a growing cache) instead.
* The attention mask is built by genai from the ids: 1 everywhere except a row's TRAILING ``pad_token_id`` tokens
  in a batch's prompt (genai pads on the right; leading pad tokens get 1), then one column of 1 per decode step.
  A right-padded row generates what it generates alone only if a masked token is a no-op for the KDA state (no
  write, no decay, the conv window ending at the last real token) and hidden from MLA. No position input (NoPE).
* At batch > 1 a generator takes ``append_tokens`` once (the prompt); later tokens come from its search.
* The tokenizer is read from ``model.tokenizer_dir`` (``genai_tokenizer/`` when `k3export.tokenizer` writes one).
* Images: an image + text export's config has genai's ``vision`` and ``embedding`` sections and ``model.type``
  `VISION_MODEL_TYPE`; genai then runs vision.onnx -> embedding.onnx -> the decoder on ``inputs_embeds``, the KDA and
  MLA states as in the text decoder. Its image processor cannot express MoonViT's preprocessing, so the prompt's
  inputs come from `K3Processor` (`vision_inputs`, fed by ``Generator.set_inputs``); genai needs
  ``num_image_tokens`` among them, or it never runs the vision graph.

`check_contract` (also run by the writer) and `check_export` are the genai-facing checks: they name the state,
field or graph tensor that genai would refuse or misread.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3export.artifacts.export_folder import GENAI_DATA_PREFIX, GENAI_MODEL_FILE, is_genai_data
from k3export.artifacts.runtime_config import ORT_SESSION_OPTIONS
from k3export.errors import K3ExportError
from k3export.modeling import contract
from k3export.safety import check_relative, confined_file
from k3export.tokenizer import GENAI_TOKENIZER_DIR, TOKENIZER_CONFIG, TOKENIZER_JSON

if TYPE_CHECKING:  # an annotation only: importing the config pulls transformers and torch
    from k3export.modeling.configuration_k3 import K3Config

GENAI_CONFIG_FILE = "genai_config.json"
# GENAI_MODEL_FILE / GENAI_DATA_PREFIX, the graph genai runs for MXFP4 or NVFP4 experts and its 8-bit expert shards, are
# named where the export folder checks them (`k3export.artifacts.export_folder`); re-exported here
#: NoPE MLA has no positional limit; genai needs a number (its default ``search.max_length``)
DEFAULT_CONTEXT_LENGTH = 1 << 20
MODEL_TYPE = "decoder"

#: search options: greedy (genai's model builder writes the same set)
GREEDY_SEARCH: dict[str, Any] = {
    "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "top_k": 1, "top_p": 1.0, "temperature": 1.0,
    "repetition_penalty": 1.0, "length_penalty": 1.0, "diversity_penalty": 0.0, "no_repeat_ngram_size": 0,
    "early_stopping": True, "min_length": 0, "past_present_share_buffer": False,
}

#: integer fields of genai_config.json's ``model`` and ``model.decoder`` (genai refuses any other JSON type deep in its
#: parser); ``search`` fields take the types of `GREEDY_SEARCH`
_MODEL_INTS = ("vocab_size", "context_length", "bos_token_id", "pad_token_id")
_DECODER_INTS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_size", "num_hidden_layers")

# contract state kind -> genai's (inputs key, outputs key)
_TEMPLATE_KEYS = {
    "key": ("past_key_names", "present_key_names"),
    "value": ("past_value_names", "present_value_names"),
    "conv_state": ("past_conv_names", "present_conv_names"),
    "recurrent_state": ("past_recurrent_names", "present_recurrent_names"),
}
_ROLE_RANK = {"conv": 3, "recurrent": 4, "latent": 4}


#: ``model.type`` of an image + text export (measured on genai 0.18, tests/vision/test_vision_genai.py): genai builds
#: its multimodal pipeline (vision -> embedding -> decoder sessions) only for the model types it registers as
#: vision-language ("phi3v", "qwen2_5_vl", "gemma3", ...; ``"decoder"`` with an embedding section is refused). Of
#: those, phi3v's vision state runs the vision graph once over every input of the prompt that it names (no per-image
#: slicing, no position ids added), which is our graph's contract. genai's own image processor cannot be used: it reads
#: ortx ``processor_config.json`` transforms, which have no MoonViT NaViT resize (patch budget, merge-block padding)
#: or patch packing, so k3export's `K3Processor` prepares the inputs and hands them over (`vision_inputs`).
VISION_MODEL_TYPE = "phi3v"
#: the genai input that sizes ``image_features`` (its ``num_image_tokens`` extra input: one count per image); without
#: it genai skips the vision graph
NUM_IMAGE_TOKENS_INPUT = "num_image_tokens"


class GenaiError(K3ExportError):
    """The export (or the contract) is not something onnxruntime-genai can run; the message names the field."""


def templates() -> dict[str, tuple[str, str]]:
    """contract state kind -> (input name template, output name template) with ``%d`` for the layer."""
    return {kind: (contract.STATE_INPUT.format(layer="%d", kind=kind),
                   contract.STATE_OUTPUT.format(layer="%d", kind=kind)) for kind in _TEMPLATE_KEYS}


def check_contract(config: K3Config, dtype: str = "float32") -> None:
    """`GenaiError` if the contract's states for `config` break a rule genai 0.18 relies on (module docstring)."""
    specs = contract.state_specs(config)
    names = templates()
    by_kind: dict[str, list[contract.StateSpec]] = {}
    for s in specs:
        if s.kind not in names:
            raise GenaiError(f"state {s.name}: kind {s.kind!r} has no onnxruntime-genai name template "
                             f"(known: {', '.join(names)})")
        if s.name != names[s.kind][0] % s.layer or s.present != names[s.kind][1] % s.layer:
            raise GenaiError(f"state {s.name} / {s.present} does not follow the templates {names[s.kind]}")
        if len(s.shape) != _ROLE_RANK[s.role] or s.shape[0] != contract.BATCH:
            raise GenaiError(f"state {s.name}: genai needs rank {_ROLE_RANK[s.role]} with batch first, got "
                             f"{list(s.shape)}")
        dynamic = [d for d in s.shape[1:] if not isinstance(d, int)]
        if s.role != "latent" and dynamic:
            raise GenaiError(f"state {s.name}: genai needs static sizes except batch, got {list(s.shape)}")
        if s.role == "latent" and (dynamic != [contract.PAST] or s.shape[2] != contract.PAST):
            raise GenaiError(f"state {s.name}: genai needs [batch, heads, past, head_size], got {list(s.shape)}")
        by_kind.setdefault(s.kind, []).append(s)
    layers: dict[int, set[str]] = {}
    for s in specs:
        layers.setdefault(s.layer, set()).add(s.role)
    for layer, roles in layers.items():
        if roles not in ({"latent"}, {"conv", "recurrent"}):
            raise GenaiError(f"layer {layer}: genai needs either a key/value pair or one conv + one recurrent state, "
                             f"got roles {sorted(roles)}")
    for kind, group in by_kind.items():  # genai sizes every layer of a kind from the first one
        first = group[0]
        for s in group[1:]:
            if s.shape != first.shape or s.resolved_dtype(dtype) != first.resolved_dtype(dtype):
                raise GenaiError(f"state {s.name}: shape/dtype {list(s.shape)} {s.resolved_dtype(dtype)} differs from "
                                 f"{first.name} ({list(first.shape)} {first.resolved_dtype(dtype)}); genai needs one "
                                 f"per kind")
    for s_key, s_val in zip(by_kind.get("key", []), by_kind.get("value", [])):
        if s_key.layer != s_val.layer or s_key.shape != s_val.shape:
            raise GenaiError(f"layer {s_key.layer}: key {list(s_key.shape)} and value {list(s_val.shape)} must have "
                             f"the same shape")


def _eos_ids(config: K3Config) -> list[int]:
    eos = config.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids:
        raise GenaiError("config.json has no eos_token_id; genai needs one to stop")
    return [int(i) for i in ids]


def genai_config(config: K3Config, *, dtype: str = "float32", model_file: str = "model.onnx",
                 context_length: int | None = None, tokenizer_dir: str | None = None,
                 search: dict[str, Any] | None = None, graphs: dict[str, str] | None = None,
                 image_token_id: int | None = None) -> dict[str, Any]:
    """The ``genai_config.json`` dict for an export of `config` (names from the contract). `graphs` ({role: file}
    of the vision and embedding graphs) makes it an image + text config: `VISION_MODEL_TYPE`, ``vision`` and
    ``embedding`` sections, the decoder on ``inputs_embeds``, `image_token_id` the placeholder token."""
    check_contract(config, dtype)
    ctx = int(context_length or DEFAULT_CONTEXT_LENGTH)
    if ctx < 1:
        raise GenaiError(f"context_length must be positive, got {ctx}")
    eos = _eos_ids(config)
    pad = config.pad_token_id if config.pad_token_id is not None else eos[0]
    bos = config.bos_token_id if config.bos_token_id is not None else eos[0]
    kv = next((s for s in contract.state_specs(config) if s.role == "latent"), None)  # None: KDA layers only
    names = templates()
    inputs = {"input_ids": contract.INPUT_IDS, "attention_mask": contract.ATTENTION_MASK}
    outputs = {"logits": contract.LOGITS}
    for kind, (in_key, out_key) in _TEMPLATE_KEYS.items():
        inputs[in_key], outputs[out_key] = names[kind]
    model: dict[str, Any] = {
        "type": MODEL_TYPE,
        "bos_token_id": int(bos), "eos_token_id": eos, "pad_token_id": int(pad),
        "vocab_size": int(config.vocab_size), "context_length": ctx,
        "decoder": {
            "filename": model_file,
            "session_options": {"log_id": "k3export", "provider_options": [], **ORT_SESSION_OPTIONS},
            "hidden_size": int(config.hidden_size),
            "num_attention_heads": int(config.num_attention_heads),
            "num_key_value_heads": int(kv.shape[1]) if kv else 1,
            "head_size": int(kv.shape[3]) if kv else 1,
            "num_hidden_layers": int(config.num_hidden_layers),
            "inputs": inputs,
            "outputs": outputs,
        },
    }
    if graphs:
        c = contract
        model["type"] = VISION_MODEL_TYPE
        del inputs["input_ids"]
        inputs["inputs_embeds"] = c.INPUTS_EMBEDS
        model["vision"] = {"filename": graphs[c.VISION_ROLE],
                           "inputs": {"pixel_values": c.PIXEL_VALUES, "image_grid_thw": c.IMAGE_GRID_THW},
                           "outputs": {"image_features": c.IMAGE_FEATURES}}
        model["embedding"] = {"filename": graphs[c.EMBEDDING_ROLE],
                              "inputs": {"input_ids": c.INPUT_IDS, "image_features": c.IMAGE_FEATURES},
                              "outputs": {"inputs_embeds": c.INPUTS_EMBEDS}}
        if image_token_id is not None:
            model["image_token_id"] = int(image_token_id)
    if tokenizer_dir:
        model["tokenizer_dir"] = tokenizer_dir
    return {"model": model, "search": {**GREEDY_SEARCH, "max_length": ctx, **(search or {})}}


def vision_inputs(input_ids: Any, pixel_values: Any, grid_thws: Any, merge_kernel_size: Any) -> dict[str, Any]:
    """What an image + text prompt hands to a genai generator (``og.NamedTensors`` -> ``Generator.set_inputs``),
    as numpy arrays by name: ``input_ids`` int32 [1, T] (placeholders expanded, `K3Processor`), ``pixel_values``
    float32 [patches, C * p * p], ``image_grid_thw`` int64 [images, 3] and `NUM_IMAGE_TOKENS_INPUT` int64
    [images] (merged tokens per image)."""
    import numpy as np

    grid = np.asarray(grid_thws, dtype=np.int64)
    px = np.asarray(pixel_values, dtype=np.float32)
    kh, kw = (int(k) for k in merge_kernel_size)
    return {contract.INPUT_IDS: np.asarray(input_ids, dtype=np.int32).reshape(1, -1),
            contract.PIXEL_VALUES: np.ascontiguousarray(px.reshape(px.shape[0], -1)),
            contract.IMAGE_GRID_THW: grid,
            NUM_IMAGE_TOKENS_INPUT: (grid[:, 1] // kh) * (grid[:, 2] // kw)}


def write_genai_config(export_dir: str | os.PathLike[str], config: K3Config, *, dtype: str = "float32",
                       model_file: str = "model.onnx", context_length: int | None = None,
                       tokenizer_dir: str | None = None, graphs: dict[str, str] | None = None,
                       image_token_id: int | None = None) -> Path:
    """Write ``genai_config.json`` into `export_dir` (atomically). `tokenizer_dir` defaults to
    ``genai_tokenizer`` when that folder exists there. Returns the file's path."""
    root = Path(export_dir)
    if tokenizer_dir is None and (root / GENAI_TOKENIZER_DIR).is_dir():
        tokenizer_dir = GENAI_TOKENIZER_DIR
    data = genai_config(config, dtype=dtype, model_file=model_file, context_length=context_length,
                        tokenizer_dir=tokenizer_dir, graphs=graphs, image_token_id=image_token_id)
    path = root / GENAI_CONFIG_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def export_files(export_dir: str | os.PathLike[str]) -> list[str]:
    """The onnxruntime-genai files of an export folder that exist, relative (for publishing):
    ``genai_config.json``, the genai graph of MXFP4 or NVFP4 experts and its data, and the ``genai_tokenizer/``
    files."""
    root = Path(export_dir)
    shards = sorted(p.name for p in root.iterdir() if is_genai_data(p.name)) if root.is_dir() else []
    names = [GENAI_CONFIG_FILE, GENAI_MODEL_FILE, *shards, f"{GENAI_TOKENIZER_DIR}/{TOKENIZER_JSON}",
             f"{GENAI_TOKENIZER_DIR}/{TOKENIZER_CONFIG}"]
    return [n for n in names if (root / n).is_file() and not (root / n).is_symlink()]


def read_genai_config(export_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``genai_config.json`` of `export_dir` (JSON object with ``model.decoder``), else `GenaiError`."""
    path = Path(export_dir) / GENAI_CONFIG_FILE
    if not path.is_file():
        raise GenaiError(f"{path}: no such file (export with a k3export that writes the genai config)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenaiError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict) \
            or not isinstance(data["model"].get("decoder"), dict):
        raise GenaiError(f"{path}: field model.decoder is missing")
    _check_types(data, path)
    return data


def context_length(export_dir: str | os.PathLike[str] | None) -> int:
    """The tokens a conversation and its reply may reach: an export's declared ``model.context_length``
    (genai_config.json), else `DEFAULT_CONTEXT_LENGTH` (K3 is NoPE: no positional limit of its own)."""
    if export_dir is None or not (Path(export_dir) / GENAI_CONFIG_FILE).is_file():
        return DEFAULT_CONTEXT_LENGTH
    value = read_genai_config(export_dir)["model"].get("context_length")
    if type(value) is not int or value < 1:
        raise K3ExportError(f"{Path(export_dir) / GENAI_CONFIG_FILE}: field 'model.context_length' is {value!r}, "
                            "expected a token count >= 1")
    return value


def _check_types(data: dict[str, Any], path: Path) -> None:
    """The JSON types of the fields k3export writes, so a wrong one is named here rather than by genai's parser."""

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def fail(field: str, expected: str, value: Any) -> None:
        raise GenaiError(f"{path}: field {field} must be {expected}, got {json.dumps(value)}")

    model, dec = data["model"], data["model"]["decoder"]
    for key in _MODEL_INTS:
        if key in model and not (is_int(model[key]) and model[key] >= 0):
            fail(f"model.{key}", "a non-negative integer", model[key])
    eos = model.get("eos_token_id")
    if "eos_token_id" in model and not (is_int(eos) and eos >= 0) and not (
            isinstance(eos, list) and eos and all(is_int(i) and i >= 0 for i in eos)):
        fail("model.eos_token_id", "a token id or a non-empty list of them", eos)
    vocab = model.get("vocab_size")
    for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
        ids = model.get(key) if isinstance(model.get(key), list) else [model.get(key)]
        if vocab is not None and any(i is not None and i >= vocab for i in ids):
            fail(f"model.{key}", f"a token id in [0, vocab_size) = [0, {vocab})", model[key])
    for key in ("type", "tokenizer_dir"):
        if key in model and not isinstance(model[key], str):
            fail(f"model.{key}", "a string", model[key])
    for key in _DECODER_INTS:
        if key in dec and not (is_int(dec[key]) and dec[key] >= 1):
            fail(f"model.decoder.{key}", "a positive integer", dec[key])
    if "filename" in dec and not isinstance(dec["filename"], str):
        fail("model.decoder.filename", "a string", dec["filename"])
    for key in ("inputs", "outputs", "session_options"):
        if key in dec and not isinstance(dec[key], dict):
            fail(f"model.decoder.{key}", "an object", dec[key])
    for key in ("inputs", "outputs"):
        for name, value in (dec.get(key) or {}).items():
            if not isinstance(value, str):
                fail(f"model.decoder.{key}.{name}", "a string", value)
    search = data.get("search", {})
    if not isinstance(search, dict):
        fail("search", "an object", search)
    for key, default in {**GREEDY_SEARCH, "max_length": 1}.items():
        value = search.get(key)
        if key not in search:
            continue
        if isinstance(default, bool) and not isinstance(value, bool):
            fail(f"search.{key}", "true or false", value)
        if is_int(default) and not is_int(value):
            fail(f"search.{key}", "an integer", value)
        if isinstance(default, float) and not (is_int(value) or isinstance(value, float)):
            fail(f"search.{key}", "a number", value)


def _check_image_sections(root: Path, model: dict[str, Any], path: Path) -> None:
    """The ``vision`` and ``embedding`` sections name graph files inside the export whose inputs and outputs they
    list."""
    import onnx

    for section in ("vision", "embedding"):
        part = model.get(section)
        if not isinstance(part, dict) or not isinstance(part.get("filename"), str):
            raise GenaiError(f"{path}: field model.{section}.filename is missing (an image + text config needs the "
                             "vision and embedding sections)")
        confined_file(root, part["filename"], error=GenaiError, file=path, field=f"model.{section}.filename")
        graph = onnx.load(str(root / part["filename"]), load_external_data=False).graph
        names = {"inputs": {i.name for i in graph.input}, "outputs": {o.name for o in graph.output}}
        for side, have in names.items():
            for key, name in (part.get(side) or {}).items():
                if name not in have:
                    raise GenaiError(f"{path}: model.{section}.{side}.{key} {name!r} is not a {side[:-1]} of "
                                     f"{part['filename']}")


def check_export(export_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Check ``genai_config.json`` against the graph of `export_dir` without onnxruntime-genai: the decoder file,
    every name template against the graph's inputs and outputs (each state input has its output), the KV and
    recurrent shapes, and the tokenizer folder. Returns the config; `GenaiError` names the first problem."""
    import onnx

    root = Path(export_dir)
    cfg = read_genai_config(root)
    path = root / GENAI_CONFIG_FILE
    model, dec = cfg["model"], cfg["model"]["decoder"]
    vision = "vision" in model or "embedding" in model
    want_type = VISION_MODEL_TYPE if vision else MODEL_TYPE
    if model.get("type") != want_type:
        raise GenaiError(f"{path}: model.type is {model.get('type')!r}, expected {want_type!r}")
    if cfg.get("search", {}).get("past_present_share_buffer", True):
        raise GenaiError(f"{path}: search.past_present_share_buffer must be false (the graph grows its KV cache)")
    fname = dec.get("filename")
    confined_file(root, fname, error=GenaiError, file=path, field="model.decoder.filename")  # inside, a file
    graph = onnx.load(str(root / fname), load_external_data=False).graph
    ins = {i.name: i for i in graph.input}
    outs = {o.name: o for o in graph.output}

    def dims(vi: Any) -> list[Any]:
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    first = "inputs_embeds" if vision else "input_ids"
    if dec["inputs"].get(first) not in ins:
        raise GenaiError(f"{path}: model.decoder.inputs.{first} is not a graph input")
    if vision:
        _check_image_sections(root, model, path)
    if dec["outputs"].get("logits") not in outs:
        raise GenaiError(f"{path}: model.decoder.outputs.logits is not a graph output")
    found: dict[str, dict[int, list[Any]]] = {}
    for kind, (in_key, out_key) in _TEMPLATE_KEYS.items():
        t_in, t_out = dec["inputs"].get(in_key), dec["outputs"].get(out_key)
        if not isinstance(t_in, str) or not isinstance(t_out, str) or t_in.count("%d") != 1 or t_out.count("%d") != 1:
            raise GenaiError(f"{path}: model.decoder inputs.{in_key} / outputs.{out_key} must be templates with one %d")
        pre, post = t_in.split("%d")
        for name, vi in ins.items():
            mid = name[len(pre):len(name) - len(post)] if name.startswith(pre) and name.endswith(post) else ""
            if mid.isdigit():
                layer = int(mid)
                if t_out % layer not in outs:
                    raise GenaiError(f"{path}: graph input {name} has no output {t_out % layer}")
                found.setdefault(kind, {})[layer] = dims(vi)
    kv, conv = found.get("key", {}), found.get("conv_state", {})
    if not kv and not conv:
        raise GenaiError(f"{root / fname}: no graph input matches {dec['inputs']['past_key_names']!r} or "
                         f"{dec['inputs']['past_conv_names']!r}")
    if set(kv) != set(found.get("value", {})) or set(conv) != set(found.get("recurrent_state", {})):
        raise GenaiError(f"{root / fname}: every KV layer needs a key and a value, every recurrent layer a conv and a "
                         "recurrent state")
    if set(kv) & set(conv):
        raise GenaiError(f"{root / fname}: layers {sorted(set(kv) & set(conv))} carry both a KV cache and a "
                         "recurrent state")
    for layer, shape in kv.items():
        if shape != found["value"][layer] or len(shape) != 4 or shape[1] != dec.get("num_key_value_heads") \
                or shape[3] != dec.get("head_size"):
            raise GenaiError(f"{root / fname}: layer {layer} key {shape} / value {found['value'][layer]} do not match "
                             f"num_key_value_heads {dec.get('num_key_value_heads')} and head_size "
                             f"{dec.get('head_size')}")
    for kind, rank in (("conv_state", 3), ("recurrent_state", 4)):
        shapes = list(found.get(kind, {}).values())
        if any(len(s) != rank or not all(isinstance(d, int) and d > 0 for d in s[1:]) for s in shapes) \
                or any(s != shapes[0] for s in shapes):
            raise GenaiError(f"{root / fname}: {kind} inputs must be rank {rank}, static except batch and the same in "
                             f"every layer, got {shapes[:3]}")
    tok = model.get("tokenizer_dir")
    if tok is not None:
        check_relative(tok, error=GenaiError, file=path, field="model.tokenizer_dir")
        if not (root / tok / TOKENIZER_JSON).is_file() or not (root / tok).resolve().is_relative_to(root.resolve()):
            raise GenaiError(f"{path}: field 'model.tokenizer_dir': {tok!r} is not a folder inside {root} with a "
                             f"{TOKENIZER_JSON}")
    return cfg


__all__ = [
    "DEFAULT_CONTEXT_LENGTH", "GENAI_CONFIG_FILE", "GENAI_DATA_PREFIX", "GENAI_MODEL_FILE", "GENAI_TOKENIZER_DIR",
    "GREEDY_SEARCH", "GenaiError", "NUM_IMAGE_TOKENS_INPUT", "VISION_MODEL_TYPE", "check_contract", "check_export",
    "context_length",
    "export_files", "genai_config", "vision_inputs",
    "read_genai_config", "templates", "write_genai_config",
]
