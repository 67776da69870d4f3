"""One runner interface for every runtime (PyTorch eager, Triton kernels, ONNX Runtime, TensorRT).

A runner runs the decoder on token ids, the attention mask and the carried state, all keyed by the names of its
`StateManifest` (``k3export.artifacts``)::

    out = runner.prefill(input_ids)                 # state=None: the manifest's initial (zero) state
    out = runner.step(next_ids, out.state)          # one decode step, [B] or [B, 1] ids
    out.logits  [B, T, vocab]; out.state {name: tensor}; out.hidden [per layer [B, T, d]] or None

`prefill` / `step` feed an all-ones mask; `Decoding` carries the mask of a left-padded
batch, and the tokens the state covers.

A state can be kept, forked and resumed (`k3export.artifacts.State`, the ``.k3state`` file)::

    out = runner.prefill(system_ids)                # out.tokens: every id the state covers
    out.save("sys.k3state")                         # or out.kept(): the State in memory
    state = State.load("sys.k3state", runner)       # refused for another export, dtype or manifest
    a = runner.prefill(question_ids, state)         # resumes: `state` is never changed in place
    b = runner.prefill(other_ids, runner.fork(state))

`prefill` takes as its start a `State`, a `StepOutput` or a bare state dict (tokens then unknown).

An export with a state window (``export --state-window W``) also returns each constant-size state after each of
the call's last W positions before its end, so a call's last n <= W tokens can be taken back without running
anything (speculative decoding's rollback)::

    out = runner.prefill(draft_ids, state)          # out.window: {state name: [W, ...]}
    back = out.rolled_back(2)                       # the state, tokens and mask without the last 2 tokens fed

State values are numpy arrays or torch tensors (torch keeps bfloat16 and the device); runners accept
either and `to_numpy` turns any of them into float64 numpy for comparison.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from k3export.errors import K3ExportError

if TYPE_CHECKING:  # only a name here: running an export must not import the artifacts (and through them the
    from k3export.artifacts import State, StateManifest  # modeling package and transformers)

Tensor = Any  # numpy.ndarray | torch.Tensor


class RuntimeUnavailable(K3ExportError):
    """A runtime that cannot run here (package missing, no GPU, kernels not registered); the message says why."""


@dataclass
class StepOutput:
    """What one forward (prefill or decode step) returns."""

    logits: Tensor  # [B, T, vocab]
    #: manifest name -> updated state (the next call's input): a dict, or a read-only mapping a runner reads lazily
    #: (OpenVINO's stateful `openvino_session.CarriedState`); either is fed back as it is
    state: dict[str, Tensor]
    hidden: list[Tensor] | None = None  # per layer, the residual stream after it [B, T, d]; None if not exposed
    #: set by `Decoding`: every token id [B, past + T] and mask column the state covers (tokens None: unknown, a
    #: decoding resumed from a bare state dict), and the runner that computed it
    tokens: np.ndarray | None = None
    mask: np.ndarray | None = None
    runner: Runner | None = field(default=None, repr=False, compare=False)
    #: an export with a state window: {state name: [W, *shape]}, slot W - n the state without the last n tokens fed
    window: dict[str, Tensor] | None = field(default=None, repr=False)
    fed: int = 0  # tokens this call fed (set by `Decoding`)

    @property
    def can_roll_back(self) -> int:
        """How many of this call's last tokens `rolled_back` can take back: at most W, and not the call's first token
        (the state before the call is the one it was given); 0 without a state window."""
        if self.window is None or self.runner is None:
            return 0
        return max(0, min(self.runner.manifest.state_window, self.fed - 1))

    def rolled_back(self, n: int) -> StepOutput:
        """This output with its call's last `n` tokens taken back, read from the state window (no call runs): the
        constant-size states from slot W - n, the growing ones (MLA latents) cut by n rows, tokens and mask cut,
        the logits of the tokens kept. The result has no window (it cannot be rolled back further)."""
        if n == 0:
            return self
        if not 0 < n <= self.can_roll_back:
            raise K3ExportError(f"cannot take back {n} tokens: this call fed {self.fed} (its first is never taken "
                                "back: the state before it is the one it was given) and its export's state window "
                                f"holds {self.runner.manifest.state_window if self.runner else 0} "
                                "(export --state-window W)")
        assert self.window is not None and self.runner is not None
        manifest = self.runner.manifest
        state: dict[str, Tensor] = {}
        for s in manifest.states:
            axis = s.past_axis
            if axis is None:
                state[s.name] = self.window[s.name][manifest.state_window - n]
            else:
                x = self.state[s.name]
                state[s.name] = x[(slice(None),) * axis + (slice(0, x.shape[axis] - n),)]
        rows = self.logits.shape[1]
        if rows <= n:
            raise K3ExportError(f"cannot take back {n} tokens: the call returned the logits of its last {rows} "
                                "position(s) only (logits_to_keep), none of them kept")
        cut = (lambda a: None if a is None else a[:, :a.shape[1] - n])
        return StepOutput(logits=self.logits[:, :rows - n], state=state, tokens=cut(self.tokens), mask=cut(self.mask),
                          runner=self.runner, fed=self.fed - n)

    def kept(self) -> State:
        """This output's state as a `State` (copied to host numpy in the manifest dtypes, with the last logits)."""
        from k3export.artifacts import State

        if self.runner is None or self.tokens is None or self.mask is None:
            raise K3ExportError("this output does not know the tokens its state covers (it was not made by a "
                                "runner's prefill / Decoding from a known start): nothing to save")
        return State.capture(self.runner.manifest, self.state, self.tokens, self.mask, self.runner.identity(),
                             self.logits[:, -1])

    def save(self, path: str | Path) -> Path:
        """Write the state to `path` (a ``.k3state`` file, atomically); returns the path."""
        return self.kept().save(path)


def to_numpy(x: Tensor, dtype: Any = np.float64) -> np.ndarray:
    """Any tensor (torch incl. bfloat16/CUDA, numpy incl. ml_dtypes) -> numpy array of `dtype`."""
    if hasattr(x, "detach"):  # torch
        import torch

        t = x.detach()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return t.cpu().numpy().astype(dtype, copy=False)
    return np.asarray(x).astype(dtype, copy=False)


def as_ids(input_ids: Tensor) -> np.ndarray:
    """Token ids as int64 [B, T]; a 1-D [B] array is one decode token per sequence."""
    ids = to_numpy(input_ids, np.int64)
    if ids.ndim == 1:
        ids = ids[:, None]
    if ids.ndim != 2:
        raise K3ExportError(f"input_ids must be [batch, tokens], got shape {list(ids.shape)}")
    return ids


class Runner(abc.ABC):
    """Base class. Subclasses implement `forward`; `prefill`/`step` are the two ways a loop calls it."""

    #: short runtime name used in reports ("torch", "triton", "ort", "trt", ...)
    name: str = "runner"
    #: the state manifest (names, shapes, dtypes) this runner reads and writes
    manifest: StateManifest
    #: most decode steps worth running (slow runtimes such as the Triton interpreter); None = no limit
    max_steps: int | None = None
    #: logits of the last this many positions only (0: every position, what validation compares); a runtime that
    #: cannot (a TensorRT engine, onnxruntime-genai) returns them all. Generation sets 1.
    logits_to_keep: int = 0
    #: the default tolerances of this runtime's own arithmetic where they are not validate's for the dtype it
    #: computes in: {dtype name: {"rms_rel": ..., "max_abs_rel": ..., "atol": ...}} (`k3export.validate.compare`)
    tolerances: dict[str, dict[str, float]] = {}

    def initial_state(self, batch: int) -> dict[str, Tensor]:
        return self.manifest.initial_state(batch)

    @abc.abstractmethod
    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray) -> StepOutput:
        """Run [B, T] int64 ids from `state` with the int64 mask [B, past + T] of every token so far."""

    def prefill(self, input_ids: Tensor, state: Start = None) -> StepOutput:
        """Run `input_ids` [B, T] from `state` (None: the initial state; a `State`, a `StepOutput` or a state
        dict). `state` is never changed: a second call from it computes the same."""
        return Decoding(self, state).feed(input_ids)

    def fork(self, state: Start) -> StepOutput:
        """An independent copy of `state` (no tensor shared): two continuations of one prefix."""
        if state is None:
            raise K3ExportError("fork() needs a state (a State, a StepOutput or a state dict)")
        start = Decoding(self, state)
        return StepOutput(logits=_copy(getattr(state, "logits", None)), state=_copy(start.state),
                          tokens=_copy(start.tokens), mask=_copy(start.mask), runner=self)

    def identity(self) -> str:
        """sha256 naming what this runner computes with (its export, checkpoint or pipeline): what a saved state
        records it belongs to."""
        raise K3ExportError(f"runtime {self.name} cannot name what it runs: its state cannot be saved")

    def step(self, input_ids: Tensor, state: dict[str, Tensor]) -> StepOutput:
        ids = as_ids(input_ids)
        if ids.shape[1] != 1:
            raise K3ExportError(f"step() takes one token per sequence, got {ids.shape[1]}")
        return Decoding(self, state).feed(ids)

    def describe(self) -> str:
        return self.name

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release sessions/engines (optional)."""


Start = Any  # None | State | StepOutput | dict[str, Tensor]: what a decoding starts from


def _copy(x: Any) -> Any:
    """A deep copy of a tensor / array / dict of them (torch clones keep dtype and device)."""
    if x is None:
        return None
    if isinstance(x, Mapping):  # a dict, or a runner's own mapping (OpenVINO's `CarriedState`): a plain dict
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, tuple):  # a runtime's own handle (genai's generator): not copyable, refused when fed back
        return x
    if hasattr(x, "clone"):
        return x.clone()
    return np.array(x, copy=True)


class Decoding:
    """One batch being decoded by one runner: carries its state, the attention mask and the tokens so far.

    `feed` runs any number of new tokens (a prefill, a prefill chunk or one decode step) with the mask of those
    new tokens (default all ones) appended to the mask so far. A start `state` (`Runner.prefill`) may be a saved
    `State` (checked to belong to the runner's export: one line otherwise), a `StepOutput` or a state dict."""

    def __init__(self, runner: Runner, state: Start = None) -> None:
        self.runner = runner
        self.state: dict[str, Tensor] | None = None
        self.mask: np.ndarray | None = None
        self.tokens: np.ndarray | None = np.zeros((0, 0), np.int64)  # None: the state's tokens are unknown
        if state is None:
            return
        if isinstance(state, StepOutput):
            self.state, self.mask, self.tokens = state.state, state.mask, state.tokens
            if self.mask is None:
                self.mask = _ones(runner, self.state)
            return
        if isinstance(state, Mapping):  # a bare state: the tokens it carries were all real, and are unknown here
            self.state, self.mask, self.tokens = state, _ones(runner, state), None
            return
        if not hasattr(state, "tensors"):
            raise K3ExportError(f"a decoding starts from a State, a StepOutput or a state dict, not "
                                f"{type(state).__name__}")
        state.check_belongs(runner.manifest, runner.identity(), f"runtime {runner.name}")  # a saved `State`
        self.state, self.mask, self.tokens = dict(state.tensors), state.mask, state.tokens

    def feed(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> StepOutput:
        ids = as_ids(input_ids)
        B, T = ids.shape
        new = np.ones((B, T), np.int64) if attention_mask is None else to_numpy(attention_mask, np.int64)
        if new.shape != (B, T):
            raise K3ExportError(f"attention_mask of the new tokens must be {[B, T]}, got {list(new.shape)}")
        if self.mask is not None and self.mask.shape[0] != B:
            raise K3ExportError(f"batch {B} does not match the carried state's batch {self.mask.shape[0]} (the "
                                "batch layout it was computed with)")
        mask = new if self.mask is None else np.concatenate([self.mask, new], axis=1)
        state = self.runner.initial_state(B) if self.state is None else self.state
        out = self.runner.forward(ids, state, mask)
        tokens = None
        if self.tokens is not None:
            tokens = ids if self.tokens.size == 0 and self.mask is None else np.concatenate([self.tokens, ids], 1)
        self.state, self.mask, self.tokens = out.state, mask, tokens
        out.tokens, out.mask, out.runner, out.fed = tokens, mask, self.runner, T
        return out


def _ones(runner: Runner, state: dict[str, Tensor]) -> np.ndarray:
    past = runner.manifest.past_length(state)
    batch = next(iter(state.values())).shape[0] if state else 0
    return np.ones((batch, past), dtype=np.int64)


class RunnerWrapper(Runner):
    """A runner that delegates to another one; subclasses alter inputs or outputs (used by mutation tests,
    by the bf16-state drift bench, ...)."""

    def __init__(self, inner: Runner, name: str | None = None) -> None:
        self.inner = inner
        self.manifest = inner.manifest
        self.max_steps = inner.max_steps
        self.name = name or inner.name

    def initial_state(self, batch: int) -> dict[str, Tensor]:
        return self.inner.initial_state(batch)

    def identity(self) -> str:
        return self.inner.identity()

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray) -> StepOutput:
        return self.inner.forward(input_ids, state, attention_mask)

    @property  # type: ignore[override]
    def logits_to_keep(self) -> int:
        return self.inner.logits_to_keep

    @logits_to_keep.setter
    def logits_to_keep(self, n: int) -> None:
        self.inner.logits_to_keep = n

    def describe(self) -> str:
        return f"{self.name} ({self.inner.describe()})"

    def close(self) -> None:
        self.inner.close()
