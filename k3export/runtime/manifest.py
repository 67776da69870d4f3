"""The state manifest: every carried decode-state tensor, by name, so a runtime needs no model code.

An export writes ``state_manifest.json`` beside ``model.onnx``. Each entry describes one state input and
the output that returns its updated value::

    {"name": "past_key_values.0.recurrent_state", "present": "present.0.recurrent_state",
     "layer": 0, "attn_type": "kda", "kind": "recurrent_state",
     "shape": ["batch", 4, 16, 16], "dtype": "float32", "initial": "zeros"}

Names follow onnxruntime-genai's family: KDA layer i carries ``past_key_values.{i}.conv_state_q|k|v``
[batch, H*K, kernel-1] (model dtype) and ``past_key_values.{i}.recurrent_state`` [batch, H, K, V] (fp32);
MLA layer i carries ``past_key_values.{i}.latent`` [batch, past_sequence_length, kv_lora_rank + rope].
Outputs are the same names with ``present.{i}.`` instead of ``past_key_values.{i}.``.

Symbolic dims: ``batch`` is the batch size; any other string dim (``past_sequence_length``, ...) is a
length that starts at 0. ``initial`` is ``"zeros"`` (an empty tensor when a dim is a length).

`StateManifest.from_config` builds the same manifest from a `K3Config`, which is how the PyTorch
runners name their state, so states of every runtime compare by name.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3export.files import read_json
from k3export.errors import K3ExportError

MANIFEST_FILE = "state_manifest.json"
RUNTIME_CONFIG_FILE = "runtime_config.json"
BATCH_DIM = "batch"
PAST_DIM = "past_sequence_length"

KDA_KINDS = ("conv_state_q", "conv_state_k", "conv_state_v", "recurrent_state")
MLA_KINDS = ("latent",)

_DTYPE_ALIASES = {
    "float": "float32", "fp32": "float32", "float32": "float32", "tensor(float)": "float32",
    "half": "float16", "fp16": "float16", "float16": "float16", "tensor(float16)": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16", "tensor(bfloat16)": "bfloat16",
    "double": "float64", "float64": "float64", "fp64": "float64", "tensor(double)": "float64",
    "int64": "int64", "tensor(int64)": "int64", "int32": "int32", "tensor(int32)": "int32",
}


class ManifestError(K3ExportError, ValueError):
    """A state manifest that is missing, malformed or inconsistent with what a runtime exposes."""


def canonical_dtype(name: Any) -> str:
    """'float32' | 'float16' | 'bfloat16' | 'float64' | ... from a torch/numpy/ONNX spelling."""
    key = str(name).lower().replace("torch.", "")
    if key not in _DTYPE_ALIASES:
        raise ManifestError(f"unknown dtype {name!r} in state manifest")
    return _DTYPE_ALIASES[key]


def kind_group(kind: str) -> str:
    """Tolerance group of a tensor kind: conv_state_q/k/v -> conv_state; others unchanged."""
    return "conv_state" if kind.startswith("conv_state") else kind


@dataclass(frozen=True)
class StateEntry:
    """One carried state tensor: its input name, output (present) name, layer, kind, shape, dtype, init."""

    name: str
    present: str
    layer: int
    attn_type: str  # "kda" | "mla"
    kind: str  # conv_state_q | conv_state_k | conv_state_v | recurrent_state | latent
    shape: tuple[int | str, ...]
    dtype: str
    initial: str = "zeros"

    def concrete_shape(self, batch: int, past: int = 0) -> tuple[int, ...]:
        dims = []
        for d in self.shape:
            if isinstance(d, int):
                dims.append(d)
            elif d == BATCH_DIM:
                dims.append(batch)
            else:  # any other symbolic dim is a sequence length, 0 at the start
                dims.append(past)
        return tuple(dims)

    @property
    def group(self) -> str:
        return kind_group(self.kind)


@dataclass
class StateManifest:
    """All carried state of one exported decoder, in layer order."""

    states: list[StateEntry]
    input_ids: str = "input_ids"
    logits: str = "logits"
    dtype: str = "float32"  # model (activation) dtype
    num_layers: int = 0
    attn_types: list[str] = field(default_factory=list)
    debug_outputs: list[str] = field(default_factory=list)  # e.g. hidden_states.{i} (per-layer residual stream)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: Any, dtype: str = "float32") -> StateManifest:
        """The manifest the PyTorch runners use: same names, shapes and dtypes as the export's."""
        dtype = canonical_dtype(dtype)
        H, K, kern = config.kda_num_heads, config.kda_head_dim, config.kda_conv_kernel
        states: list[StateEntry] = []
        for i, t in enumerate(config.attn_types):
            if t == "kda":
                for kind in KDA_KINDS[:3]:
                    states.append(StateEntry(f"past_key_values.{i}.{kind}", f"present.{i}.{kind}", i, "kda", kind,
                                             (BATCH_DIM, H * K, kern - 1), dtype))
                states.append(StateEntry(f"past_key_values.{i}.recurrent_state", f"present.{i}.recurrent_state", i,
                                         "kda", "recurrent_state", (BATCH_DIM, H, K, K), "float32"))
            else:
                states.append(StateEntry(f"past_key_values.{i}.latent", f"present.{i}.latent", i, "mla", "latent",
                                         (BATCH_DIM, PAST_DIM, config.mla_latent_dim), dtype))
        return cls(states=states, dtype=dtype, num_layers=config.num_hidden_layers,
                   attn_types=list(config.attn_types),
                   debug_outputs=[f"hidden_states.{i}" for i in range(config.num_hidden_layers)])

    @classmethod
    def from_dict(cls, data: dict[str, Any], runtime_config: dict[str, Any] | None = None) -> StateManifest:
        """Parse a manifest dict (plus the export's ``runtime_config.json`` for dtype and layer types).
        Tolerant of spellings (present/present_name, attn_type/layer_type, init/initial, ...)."""
        if not isinstance(data, dict):
            raise ManifestError("state manifest must be a JSON object")
        rc = runtime_config if isinstance(runtime_config, dict) else {}
        raw = data.get("states", data.get("state", data.get("entries")))
        if not isinstance(raw, list) or not raw:
            raise ManifestError("state manifest has no 'states' list")
        states = []
        for n, e in enumerate(raw):
            if not isinstance(e, dict) or "name" not in e:
                raise ManifestError(f"state manifest entry {n} has no 'name'")
            name = str(e["name"])
            parts = name.split(".")
            kind = str(e.get("kind") or parts[-1])
            if kind in ("conv_state", "conv"):  # refine to conv_state_q|k|v
                if "component" in e:
                    kind = f"conv_state_{e['component']}"
                elif parts[-1].startswith("conv_state_"):
                    kind = parts[-1]
            layer = e.get("layer", e.get("layer_idx"))
            if layer is None:
                digits = [p for p in parts if p.isdigit()]
                if not digits:
                    raise ManifestError(f"state {name!r}: no 'layer' and none in its name")
                layer = digits[0]
            attn = e.get("attn_type", e.get("layer_type", "mla" if kind == "latent" else "kda"))
            present = e.get("present", e.get("present_name", e.get("output")))
            if present is None:
                present = name.replace("past_key_values.", "present.", 1)
            shape = tuple(int(d) if isinstance(d, int) or (isinstance(d, str) and d.isdigit()) else str(d)
                          for d in e.get("shape", ()))
            if not shape:
                raise ManifestError(f"state {name!r}: no 'shape'")
            initial = e.get("initial", e.get("initial_value", e.get("init", "zeros")))
            if attn == "kda" and kind == "latent":
                attn = "mla"
            if isinstance(initial, dict):
                initial = initial.get("kind", initial.get("type", "zeros"))
            initial = str(initial)
            if initial not in ("zeros", "empty", "0", "0.0"):
                raise ManifestError(f"state {name!r}: initial value {initial!r} is not supported (zeros/empty)")
            states.append(StateEntry(name, str(present), int(layer), str(attn), kind, shape,
                                     canonical_dtype(e.get("dtype", "float32")), "zeros"))
        io = dict(data.get("io", {})) if isinstance(data.get("io"), dict) else {}
        for key, role in (("inputs", "input_ids"), ("outputs", "logits")):
            listed = data.get(key)
            if isinstance(listed, list) and role not in io:
                names = [str(x.get("name") if isinstance(x, dict) else x) for x in listed]
                match = [n for n in names if role in n]
                if match:
                    io[role] = match[0]
        attn_types = data.get("attn_types") or data.get("layer_types") or rc.get("layer_types") or []
        num_layers = int(data.get("num_layers", data.get("num_hidden_layers", rc.get("num_hidden_layers", 0))) or 0)
        if not num_layers:
            num_layers = max(len(attn_types), 1 + max(s.layer for s in states))
        if not attn_types:
            by_layer = {s.layer: s.attn_type for s in states}
            attn_types = [by_layer.get(i, "?") for i in range(num_layers)]
        dbg = data.get("debug_outputs", [])
        if isinstance(dbg, dict):
            dbg = list(dbg)
        return cls(
            states=states,
            input_ids=str(data.get("input_ids", io.get("input_ids", "input_ids"))),
            logits=str(data.get("logits", io.get("logits", "logits"))),
            dtype=canonical_dtype(data.get("dtype", data.get("model_dtype", rc.get("dtype", "float32")))),
            num_layers=num_layers,
            attn_types=[str(t) for t in attn_types],
            debug_outputs=[str(d["name"] if isinstance(d, dict) else d) for d in dbg],
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> StateManifest:
        """Read ``state_manifest.json`` (a file, or the export folder holding it)."""
        p = Path(path)
        if p.is_dir():
            p = p / MANIFEST_FILE
        if not p.is_file():
            raise ManifestError(f"{p}: no state manifest (an export writes {MANIFEST_FILE} beside model.onnx)")
        data = read_json(p, ManifestError)
        rc_path = p.parent / RUNTIME_CONFIG_FILE
        rc = None
        if rc_path.is_file():
            rc = read_json(rc_path, ManifestError)
        return cls.from_dict(data, rc)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1, "input_ids": self.input_ids, "logits": self.logits, "dtype": self.dtype,
            "num_layers": self.num_layers, "attn_types": self.attn_types, "debug_outputs": self.debug_outputs,
            "states": [dict(asdict(s), shape=list(s.shape)) for s in self.states],
        }

    # ------------------------------------------------------------------ queries
    def names(self) -> list[str]:
        return [s.name for s in self.states]

    def by_name(self) -> dict[str, StateEntry]:
        return {s.name: s for s in self.states}

    def by_present(self) -> dict[str, StateEntry]:
        return {s.present: s for s in self.states}

    def layer_type(self, layer: int) -> str:
        return self.attn_types[layer] if 0 <= layer < len(self.attn_types) else "?"

    def initial_state(self, batch: int) -> dict[str, np.ndarray]:
        """Zero state for `batch` sequences as numpy arrays (bfloat16 as float32: runners cast on feed)."""
        out = {}
        for s in self.states:
            dt = np.float32 if s.dtype == "bfloat16" else np.dtype(s.dtype)
            out[s.name] = np.zeros(s.concrete_shape(batch, 0), dtype=dt)
        return out

    def check_compatible(self, other: StateManifest, what: str = "export") -> None:
        """Raise `ManifestError` naming the first state whose name/shape differs from `other` (the reference)."""
        mine, theirs = self.by_name(), other.by_name()
        missing = [n for n in theirs if n not in mine]
        extra = [n for n in mine if n not in theirs]
        if missing or extra:
            raise ManifestError(f"{what} state manifest does not match the model: missing {missing[:4]}, "
                                f"unexpected {extra[:4]}")
        for n, s in theirs.items():
            m = mine[n]
            fixed = [(a, b) for a, b in zip(m.shape, s.shape) if isinstance(a, int) and isinstance(b, int)]
            if len(m.shape) != len(s.shape) or any(a != b for a, b in fixed):
                raise ManifestError(f"{what} state {n!r} has shape {list(m.shape)}; the model expects {list(s.shape)}")
