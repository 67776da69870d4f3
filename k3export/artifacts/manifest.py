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

An image + text export (a checkpoint with a vision tower) also lists its image graphs, each graph's role and
I/O, in the order they run, and its decoder takes ``inputs_embeds`` [batch, sequence_length, hidden] (activation
dtype) instead of ``input_ids``::

     "graphs": [{"role": "vision",
                 "inputs":  [{"name": "pixel_values", "dtype": "float32", "shape": ["num_patches", 588]},
                             {"name": "image_grid_thw", "dtype": "int64", "shape": ["num_images", 3]}],
                 "outputs": [{"name": "image_features", "dtype": "float32", "shape": ["num_image_tokens", 7168]}]},
                {"role": "embedding",
                 "inputs":  [{"name": "input_ids", ...}, {"name": "image_features", ...}],
                 "outputs": [{"name": "inputs_embeds", "dtype": "float32",
                              "shape": ["batch", "sequence_length", 7168]}]}]

(absent in a text-only export; which file holds each graph is ``runtime_config.json``'s ``graphs``).

An export with a state window (``export --state-window W``) records ``"state_window": W`` and lists, among its
outputs, ``present_window.{i}.{kind}`` [W, *shape] for every constant-size state (the contract's
``STATE_WINDOW_OUTPUT``): slot W - n is the state with the call's last n tokens taken back (absent: no window).

A state the graph keeps in another order than the contract's has ``"axes"``: the contract's axes in the graph's
order, batch first, its shapes in that order (the ort form's KDA recurrent states, V-major for GatedDeltaNet:
``[0, 1, 3, 2]``); absent, the contract's order. Compare such a state with PyTorch's through
`StateEntry.to_contract`.

Dims are integers or the contract's symbols: ``batch``, ``sequence_length`` (new tokens of this call),
``past_sequence_length`` (tokens already carried; 0 on the first call) and ``total_sequence_length`` (past +
new); in the image graphs ``num_patches`` (packed patches of every image), ``num_images`` (images or video chunks)
and ``num_image_tokens`` (their merged tokens: the placeholder tokens of the prompt).

Every state starts as zeros of its shape with ``past_sequence_length`` = 0; after each call feed every
``present`` back as its ``name``. A stage that does not start at layer 0 takes the contract's boundary tensors
(``stage_in.*``) instead of ``input_ids``; one that does not end at the last layer returns ``stage_out.*``
instead of ``logits``. Optional debug outputs ``hidden_states.{i}`` are the residual stream after layer i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3export.dtypes import DTypeError, EXPORT_DTYPES, dtype as as_dtype
from k3export.modeling import contract
from k3export.modeling.contract import (
    ATTENTION_MASK, BATCH, EMBEDDING_ROLE, IMAGE_FEATURES, IMAGE_GRID_THW, INPUT_IDS, INPUTS_EMBEDS, LOGITS,
    NUM_IMAGE_TOKENS, NUM_IMAGES, NUM_PATCHES, PAST, PIXEL_VALUES, SEQ, STATE_INPUT, STATE_OUTPUT,
    STATE_WINDOW_OUTPUT, TOTAL, VISION_ROLE,
)

from .codec import ArtifactError, Document, fail

DIMS = (BATCH, SEQ, PAST, TOTAL, NUM_PATCHES, NUM_IMAGES, NUM_IMAGE_TOKENS)
#: the graphs an export may hold besides the decoder, in the order they run
GRAPH_ROLES = (VISION_ROLE, EMBEDDING_ROLE)
HIDDEN = "hidden_states.{layer}"
ROLES = {"conv_state": "conv", "recurrent_state": "recurrent", "key": "latent", "value": "latent"}
GROUPS = {"conv": "conv_state", "recurrent": "recurrent_state", "latent": "latent"}  # tolerance groups
MAX_DIM = 2**31 - 1
#: the widest state window: a speculation round verifies at most this many draft tokens
MAX_STATE_WINDOW = 64

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
class GraphSpec:
    """The I/O of one graph besides the decoder (an image graph), by its `role`."""

    role: str  # GRAPH_ROLES
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


def image_graph_specs(vision_config: Any, hidden_size: int, dtype: Any = "float32") -> list[GraphSpec]:
    """The vision and embedding graphs' I/O for a `K3VisionConfig` feeding a text model `hidden_size` wide, in
    activation dtype `dtype` (the one home of these specs; `k3export.converters.onnx.vision` builds from them)."""
    act = as_dtype(dtype).name
    v = vision_config
    features = TensorSpec(IMAGE_FEATURES, act, (NUM_IMAGE_TOKENS, int(hidden_size)))
    return [GraphSpec(VISION_ROLE, [TensorSpec(PIXEL_VALUES, act, (NUM_PATCHES, int(v.patch_pixels))),
                                    TensorSpec(IMAGE_GRID_THW, "int64", (NUM_IMAGES, 3))],
                      [TensorSpec(IMAGE_FEATURES, act, (NUM_IMAGE_TOKENS, int(v.text_hidden_size)))]),
            GraphSpec(EMBEDDING_ROLE, [TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ)), features],
                      [TensorSpec(INPUTS_EMBEDS, act, (BATCH, SEQ, int(hidden_size)))])]


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
    #: the contract's axes in the order the graph keeps them (``numpy.transpose``'s axes; batch stays first), e.g.
    #: [0, 1, 3, 2] for a recurrent state kept V-major; None: the contract's order
    axes: tuple[int, ...] | None = None

    @classmethod
    def from_spec(cls, spec: contract.StateSpec, activation: str, axes: tuple[int, ...] | None = None) -> StateEntry:
        order = range(len(spec.shape)) if axes is None else axes
        return cls(spec.name, spec.present, spec.layer, spec.kind, spec.role, spec.resolved_dtype(activation),
                   tuple(spec.shape[a] for a in order), tuple(spec.present_shape[a] for a in order),
                   None if axes is None else tuple(axes))

    def to_contract(self, x: Any) -> Any:
        """`x` (numpy or torch, batch first; a window's slots first) of this state as the contract lays it out:
        what a PyTorch reference holds. A view where the state is kept in another order."""
        return x if self.axes is None else _permute(x, self.axes, inverse=True)

    def from_contract(self, x: Any) -> Any:
        """`to_contract`'s inverse: a state as the contract lays it out, in the order the graph keeps it."""
        return x if self.axes is None else _permute(x, self.axes)

    @property
    def group(self) -> str:
        """Tolerance group of the state (conv_state, recurrent_state or latent)."""
        return GROUPS[self.role]

    @property
    def window(self) -> str | None:
        """The state-window output of this state (None for a growing state, whose rows are cut instead)."""
        return None if PAST in self.shape else STATE_WINDOW_OUTPUT.format(layer=self.layer, kind=self.kind)

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
    #: the image graphs of an image + text export (`image_graph_specs`), in the order they run; empty: text only
    graphs: list[GraphSpec] = field(default_factory=list)
    #: W of ``export --state-window W``: the outputs hold each constant-size state after each of the call's last W
    #: positions before its end (``present_window.*``); 0: no window
    state_window: int = 0

    def to_json(self) -> dict[str, Any]:
        """As `Document.to_json`, without ``graphs`` in a text-only export and without ``state_window`` when there
        is none: such files stay what they were before either existed."""
        data = super().to_json()
        if not self.graphs:
            del data["graphs"]
        if not self.state_window:
            del data["state_window"]
        for state in data["states"]:  # kept in the contract's order: no key (the files before it existed)
            if state["axes"] is None:
                del state["axes"]
        return data

    # ------------------------------------------------------------------ from the contract
    @classmethod
    def from_config(cls, config: Any, dtype: Any = "float32", *, layers: range | None = None,
                    attention_mask: bool = True, debug_outputs: bool = False, inputs_embeds: bool = False,
                    vision_config: Any = None, state_window: int = 0,
                    recurrent_axes: tuple[int, ...] | None = None) -> StateManifest:
        """The manifest of the graph `config` exports to in activation dtype `dtype` (layers: a pipeline stage).
        `inputs_embeds`: the decoder takes ``inputs_embeds`` instead of ``input_ids``; `vision_config` (a
        `K3VisionConfig`): an image + text export, whose image graphs are listed and whose decoder takes
        ``inputs_embeds``. `state_window`: W > 0 adds the ``present_window.*`` outputs (module docstring).
        `recurrent_axes`: the order the graph keeps the KDA recurrent states in (`StateEntry.axes`)."""
        act = as_dtype(dtype).name
        c = config
        layers = range(c.num_hidden_layers) if layers is None else layers
        inputs_embeds = inputs_embeds or vision_config is not None
        inputs: list[TensorSpec] = []
        outputs: list[TensorSpec] = []
        if layers.start == 0:
            inputs.append(TensorSpec(INPUTS_EMBEDS, act, (BATCH, SEQ, c.hidden_size)) if inputs_embeds
                          else TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ)))
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
        states = [StateEntry.from_spec(s, act, recurrent_axes if s.kind == "recurrent_state" else None)
                  for s in contract.state_specs(c, layers)]
        if state_window:
            outputs += [TensorSpec(s.window, s.dtype, (int(state_window), *s.shape)) for s in states if s.window]
        graphs = [] if vision_config is None else image_graph_specs(vision_config, c.hidden_size, act)
        return cls(act, (layers.start, layers.stop), inputs, outputs, states, graphs, int(state_window))

    def check(self, file: Any) -> None:
        _check_dtype(self.dtype, file, "dtype")
        if self.dtype not in {d.name for d in EXPORT_DTYPES.values()}:
            raise fail(file, "dtype", f"{self.dtype!r} is not an export dtype")
        start, stop = self.layers
        if not 0 <= start < stop:
            raise fail(file, "layers", f"{list(self.layers)} is not a non-empty range [start, stop)")
        if not isinstance(self.state_window, int) or isinstance(self.state_window, bool) or \
                not 0 <= self.state_window <= MAX_STATE_WINDOW:
            raise fail(file, "state_window", f"{self.state_window!r}; expected an int in [0, {MAX_STATE_WINDOW}]")
        seen: set[str] = set()
        for group, entries in (("inputs", self.inputs), ("outputs", self.outputs)):
            for n, t in enumerate(entries):
                _check_dtype(t.dtype, file, f"{group}[{n}].dtype")
                _check_shape(t.shape, file, f"{group}[{n}].shape")
                if t.name in seen:
                    raise fail(file, f"{group}[{n}].name", f"{t.name!r} appears twice")
                seen.add(t.name)
        roles = [g.role for g in self.graphs]
        for n, g in enumerate(self.graphs):
            if g.role not in GRAPH_ROLES or roles.index(g.role) != n:
                raise fail(file, f"graphs[{n}].role", f"{g.role!r}; expected each of {', '.join(GRAPH_ROLES)} at "
                                                      "most once")
            for side in ("inputs", "outputs"):
                names: set[str] = set()
                for k, t in enumerate(getattr(g, side)):
                    where = f"graphs[{n}].{side}[{k}]"
                    _check_dtype(t.dtype, file, f"{where}.dtype")
                    _check_shape(t.shape, file, f"{where}.shape")
                    if t.name in names:
                        raise fail(file, f"{where}.name", f"{t.name!r} appears twice")
                    names.add(t.name)
        if self.graphs and roles != list(GRAPH_ROLES):
            raise fail(file, "graphs", f"roles {roles}; an image + text export has {list(GRAPH_ROLES)}")
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
            if s.axes is not None and (s.kind != "recurrent_state" or sorted(s.axes) != list(range(len(s.shape)))
                                       or s.axes[0] != 0):
                raise fail(file, f"{where}.axes", f"{list(s.axes)}; a recurrent state's axes are a permutation of "
                                                  f"0..{len(s.shape) - 1} that keeps the batch (0) first")
            if s.present_shape != tuple(TOTAL if d == PAST else d for d in s.shape):
                raise fail(file, f"{where}.present_shape", f"{list(s.present_shape)} does not follow shape "
                                                            f"{list(s.shape)} ({PAST} -> {TOTAL})")
            for name in (s.name, s.present):
                if name in seen:
                    raise fail(file, f"{where}.name", f"{name!r} appears twice")
                seen.add(name)

    def check_config(self, config: Any, file: Any = None, vision_config: Any = None) -> None:
        """`ArtifactError` naming the first field that differs from what the contract derives from `config` (and,
        for an image + text export, its `vision_config`)."""
        file = self.FILE if file is None else file
        L = config.num_hidden_layers
        if self.layers[1] > L:
            raise fail(file, "layers", f"{list(self.layers)} goes past the config's {L} layers")
        if bool(self.graphs) != (vision_config is not None):
            raise fail(file, "graphs", "lists image graphs, but the runtime config has no vision_config"
                       if self.graphs else "is missing: the runtime config's vision_config calls for the image graphs")
        names = {t.name for t in self.outputs}
        want = StateManifest.from_config(
            config, self.dtype, layers=range(*self.layers), attention_mask=ATTENTION_MASK in self.input_names,
            debug_outputs=any(n.startswith(HIDDEN.format(layer="")) for n in names),
            inputs_embeds=INPUTS_EMBEDS in self.input_names, vision_config=vision_config,
            state_window=self.state_window,
            recurrent_axes=next((s.axes for s in self.states if s.kind == "recurrent_state"), None))
        for n, (a, b) in enumerate(zip(self.graphs, want.graphs)):
            for side in ("inputs", "outputs"):
                if getattr(a, side) != getattr(b, side):
                    raise fail(file, f"graphs[{n}].{side}", f"{_show_specs(getattr(a, side))} disagrees with the "
                               f"vision_config (the contract says {_show_specs(getattr(b, side))})")
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

    def window_outputs(self) -> dict[str, str]:
        """{state name: its ``present_window.*`` output} (empty without a state window)."""
        return {s.name: s.window for s in self.states if s.window} if self.state_window else {}

    @property
    def hidden_outputs(self) -> list[str]:
        prefix = HIDDEN.format(layer="")
        return [t.name for t in self.outputs if t.name.startswith(prefix)]

    def graph(self, role: str) -> GraphSpec | None:
        """The image graph of `role` (`GRAPH_ROLES`), None when the export has none."""
        return next((g for g in self.graphs if g.role == role), None)

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


def _permute(x: Any, axes: tuple[int, ...], inverse: bool = False) -> Any:
    """`x` [..., *state] with its last len(`axes`) axes put in `axes`'s order (`inverse`: back)."""
    order = [axes.index(a) for a in range(len(axes))] if inverse else list(axes)
    lead = x.ndim - len(axes)
    perm = [*range(lead), *(lead + a for a in order)]
    return x.permute(*perm) if hasattr(x, "permute") else x.transpose(perm)


def _show(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _show_specs(specs: list[TensorSpec]) -> str:
    return ", ".join(f"{t.name} {t.dtype} {list(t.shape)}" for t in specs)


__all__ = ["ArtifactError", "DIMS", "GRAPH_ROLES", "GraphSpec", "HIDDEN", "MAX_STATE_WINDOW", "StateEntry",
           "StateManifest", "TensorSpec", "image_graph_specs"]
