"""``state_manifest.json``: every input, output and carried state of an exported graph, so a runtime needs no
model code. Written from the contract (`k3export.modeling.contract`), read strictly, and checked against the
contract of the config the export was made from::

    {"format": "k3export.state_manifest", "format_version": 1,
     "dtype": "bfloat16",                       # activation dtype (canonical name)
     "layers": [0, 6],                          # the decoder layers the graph holds (a pipeline stage: a sub-range)
     "inputs":  [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence_length"]},
                 {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "total_sequence_length"]}],
     "outputs": [{"name": "logits", "dtype": "bfloat16", "shape": ["batch", "sequence_length", 163840]}],
     "states":  [{"name": "past_key_values.0.conv_state", "present": "present.0.conv_state", "layer": 0,
                  "kind": "conv_state", "role": "conv", "dtype": "bfloat16",
                  "shape": ["batch", 36864, 3], "present_shape": ["batch", 36864, 3]}, ...]}

Dims are integers or the contract's symbols: ``batch``, ``sequence_length`` (new tokens of this call),
``past_sequence_length`` (tokens already carried; 0 on the first call) and ``total_sequence_length`` (past +
new). Every state starts as zeros of its shape with ``past_sequence_length`` = 0; after each call feed every
``present`` back as its ``name``. A stage that does not start at layer 0 takes the contract's boundary tensors
(``stage_in.*``) instead of ``input_ids``; one that does not end at the last layer returns ``stage_out.*``
instead of ``logits``. Optional debug outputs ``hidden_states.{i}`` are the residual stream after layer i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3export.dtypes import DTypeError, EXPORT_DTYPES, dtype as as_dtype
from k3export.modeling import contract
from k3export.modeling.contract import (
    ATTENTION_MASK, BATCH, INPUT_IDS, LOGITS, PAST, SEQ, STATE_INPUT, STATE_OUTPUT, TOTAL,
)

from .codec import ArtifactError, Document, fail

DIMS = (BATCH, SEQ, PAST, TOTAL)
HIDDEN = "hidden_states.{layer}"
ROLES = {"conv_state": "conv", "recurrent_state": "recurrent", "key": "latent", "value": "latent"}
GROUPS = {"conv": "conv_state", "recurrent": "recurrent_state", "latent": "latent"}  # tolerance groups
MAX_DIM = 2**31 - 1

Dim = int | str


def _check_shape(shape: tuple[Dim, ...], file: Any, where: str) -> None:
    for axis, d in enumerate(shape):
        if isinstance(d, str) and d not in DIMS:
            raise fail(file, f"{where}[{axis}]", f"unknown dimension {d!r}; dimensions are integers or "
                                                  f"{', '.join(DIMS)}")
        if isinstance(d, int) and not 0 <= d <= MAX_DIM:
            raise fail(file, f"{where}[{axis}]", f"{d} is outside [0, {MAX_DIM}]")


def _check_dtype(name: str, file: Any, where: str) -> None:
    try:
        canonical = as_dtype(name).name
    except DTypeError:
        canonical = None
    if canonical != name:
        raise fail(file, where, f"{name!r} is not a canonical dtype name" + (f" (write {canonical!r})" if canonical
                                                                              else ""))


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output that is not a carried state."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def concrete_shape(self, batch: int, seq: int, past: int = 0) -> tuple[int, ...]:
        sizes = {BATCH: batch, SEQ: seq, PAST: past, TOTAL: past + seq}
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.shape)


@dataclass(frozen=True)
class StateEntry:
    """One carried state: graph input `name`, graph output `present` (a `contract.StateSpec`, dtype resolved)."""

    name: str
    present: str
    layer: int
    kind: str  # conv_state | recurrent_state | key | value
    role: str  # conv | recurrent | latent
    dtype: str
    shape: tuple[Dim, ...]
    present_shape: tuple[Dim, ...]

    @classmethod
    def from_spec(cls, spec: contract.StateSpec, activation: str) -> StateEntry:
        return cls(spec.name, spec.present, spec.layer, spec.kind, spec.role, spec.resolved_dtype(activation),
                   tuple(spec.shape), tuple(spec.present_shape))

    @property
    def group(self) -> str:
        """Tolerance group of the state (conv_state, recurrent_state or latent)."""
        return GROUPS[self.role]

    @property
    def past_axis(self) -> int | None:
        """The axis that grows with the context, None for a constant-size state."""
        return self.shape.index(PAST) if PAST in self.shape else None

    def concrete_shape(self, batch: int, past: int = 0) -> tuple[int, ...]:
        return tuple(batch if d == BATCH else past if d == PAST else int(d) for d in self.shape)


@dataclass
class StateManifest(Document):
    """All graph I/O of one export: `inputs` and `outputs` besides the states, and the carried `states`."""

    FILE = "state_manifest.json"
    FORMAT = "k3export.state_manifest"

    dtype: str
    layers: tuple[int, int]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    states: list[StateEntry]

    # ------------------------------------------------------------------ from the contract
    @classmethod
    def from_config(cls, config: Any, dtype: Any = "float32", *, layers: range | None = None,
                    attention_mask: bool = True, debug_outputs: bool = False) -> StateManifest:
        """The manifest of the graph `config` exports to in activation dtype `dtype` (layers: a pipeline stage)."""
        act = as_dtype(dtype).name
        c = config
        layers = range(c.num_hidden_layers) if layers is None else layers
        inputs: list[TensorSpec] = []
        outputs: list[TensorSpec] = []
        if layers.start == 0:
            inputs.append(TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ)))
        else:
            inputs += [TensorSpec(b.input, act, tuple(b.shape)) for b in contract.boundary_specs(c, layers.start)]
        if attention_mask:
            inputs.append(TensorSpec(ATTENTION_MASK, "int64", (BATCH, TOTAL)))
        if layers.stop == c.num_hidden_layers:
            outputs.append(TensorSpec(LOGITS, act, (BATCH, SEQ, c.vocab_size)))
        else:
            outputs += [TensorSpec(b.output, act, tuple(b.shape)) for b in contract.boundary_specs(c, layers.stop)]
        if debug_outputs:
            outputs += [TensorSpec(HIDDEN.format(layer=i), act, (BATCH, SEQ, c.hidden_size)) for i in layers]
        states = [StateEntry.from_spec(s, act) for s in contract.state_specs(c, layers)]
        return cls(act, (layers.start, layers.stop), inputs, outputs, states)

    def check(self, file: Any) -> None:
        _check_dtype(self.dtype, file, "dtype")
        if self.dtype not in {d.name for d in EXPORT_DTYPES.values()}:
            raise fail(file, "dtype", f"{self.dtype!r} is not an export dtype")
        start, stop = self.layers
        if not 0 <= start < stop:
            raise fail(file, "layers", f"{list(self.layers)} is not a non-empty range [start, stop)")
        seen: set[str] = set()
        for group, entries in (("inputs", self.inputs), ("outputs", self.outputs)):
            for n, t in enumerate(entries):
                _check_dtype(t.dtype, file, f"{group}[{n}].dtype")
                _check_shape(t.shape, file, f"{group}[{n}].shape")
                if t.name in seen:
                    raise fail(file, f"{group}[{n}].name", f"{t.name!r} appears twice")
                seen.add(t.name)
        for n, s in enumerate(self.states):
            where = f"states[{n}]"
            if s.kind not in ROLES:
                raise fail(file, f"{where}.kind", f"unknown state kind {s.kind!r} ({', '.join(ROLES)})")
            if s.role != ROLES[s.kind]:
                raise fail(file, f"{where}.role", f"{s.role!r}; a {s.kind} has role {ROLES[s.kind]!r}")
            if not start <= s.layer < stop:
                raise fail(file, f"{where}.layer", f"{s.layer} is outside the manifest's layers {list(self.layers)}")
            for key, want in (("name", STATE_INPUT), ("present", STATE_OUTPUT)):
                if getattr(s, key) != want.format(layer=s.layer, kind=s.kind):
                    raise fail(file, f"{where}.{key}", f"{getattr(s, key)!r}, expected "
                                                         f"{want.format(layer=s.layer, kind=s.kind)!r}")
            _check_dtype(s.dtype, file, f"{where}.dtype")
            _check_shape(s.shape, file, f"{where}.shape")
            if s.present_shape != tuple(TOTAL if d == PAST else d for d in s.shape):
                raise fail(file, f"{where}.present_shape", f"{list(s.present_shape)} does not follow shape "
                                                            f"{list(s.shape)} ({PAST} -> {TOTAL})")
            for name in (s.name, s.present):
                if name in seen:
                    raise fail(file, f"{where}.name", f"{name!r} appears twice")
                seen.add(name)

    def check_config(self, config: Any, file: Any = None) -> None:
        """`ArtifactError` naming the first field that differs from what the contract derives from `config`."""
        file = self.FILE if file is None else file
        L = config.num_hidden_layers
        if self.layers[1] > L:
            raise fail(file, "layers", f"{list(self.layers)} goes past the config's {L} layers")
        names = {t.name for t in self.outputs}
        want = StateManifest.from_config(
            config, self.dtype, layers=range(*self.layers), attention_mask=ATTENTION_MASK in self.input_names,
            debug_outputs=any(n.startswith(HIDDEN.format(layer="")) for n in names))
        for key in ("inputs", "outputs", "states"):
            mine, theirs = getattr(self, key), getattr(want, key)
            for n, (a, b) in enumerate(zip(mine, theirs)):
                for f in a.__dataclass_fields__:
                    if getattr(a, f) != getattr(b, f):
                        value = getattr(a, f)
                        raise fail(file, f"{key}[{n}].{f}", f"{list(value) if isinstance(value, tuple) else value!r}"
                                                            f" disagrees with the config (the contract says "
                                                            f"{_show(getattr(b, f))})")
            if len(mine) != len(theirs):
                n = min(len(mine), len(theirs))
                what = f"lacks {theirs[n].name!r}" if len(mine) < len(theirs) else f"has an extra {mine[n].name!r}"
                raise fail(file, key, f"{what} (the config's contract has {len(theirs)} entries, this file "
                                      f"{len(mine)})")

    # ------------------------------------------------------------------ queries
    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def names(self) -> list[str]:
        return [s.name for s in self.states]

    def by_name(self) -> dict[str, StateEntry]:
        return {s.name: s for s in self.states}

    @property
    def hidden_outputs(self) -> list[str]:
        prefix = HIDDEN.format(layer="")
        return [t.name for t in self.outputs if t.name.startswith(prefix)]

    def graph_io(self) -> tuple[dict[str, tuple[str, tuple[Dim, ...]]], dict[str, tuple[str, tuple[Dim, ...]]]]:
        """({graph input: (dtype, shape)}, {graph output: (dtype, shape)}) including the states."""
        ins = {t.name: (t.dtype, t.shape) for t in self.inputs}
        outs = {t.name: (t.dtype, t.shape) for t in self.outputs}
        for s in self.states:
            ins[s.name] = (s.dtype, s.shape)
            outs[s.present] = (s.dtype, s.present_shape)
        return ins, outs

    def layer_type(self, layer: int) -> str:
        roles = {s.role for s in self.states if s.layer == layer}
        return "mla" if "latent" in roles else ("kda" if roles else "?")

    def past_length(self, state: dict[str, Any]) -> int:
        """Tokens carried by `state` (the length of a growing state; 0 when none grows)."""
        for s in self.states:
            axis = s.past_axis
            if axis is not None and s.name in state:
                return int(state[s.name].shape[axis])
        return 0

    def initial_state(self, batch: int) -> dict[str, Any]:
        """Zero state for `batch` sequences as numpy arrays of the manifest dtypes (bfloat16 via ml_dtypes)."""
        import numpy as np

        return {s.name: np.zeros(s.concrete_shape(batch, 0), dtype=as_dtype(s.dtype).numpy) for s in self.states}


def _show(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


__all__ = ["ArtifactError", "DIMS", "HIDDEN", "StateEntry", "StateManifest", "TensorSpec"]
