"""Deliberately wrong artifacts, to prove that validation fails closed and localises the fault.

Model mutations return a mutated COPY of a `K3ForCausalLM` (wrap it in a `TorchRunner` to get a wrong
"runtime"); runner mutations wrap a runner; `mutate_onnx_initializer` writes a modified copy of an ONNX
export. Layers are 0-based.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3export.artifacts import MODEL_FILE, load_export, write_bytes_atomic
from k3export.errors import K3ExportError
from k3export.runtime.base import Runner, RunnerWrapper, StepOutput, Tensor


def _layer(model: Any, layer: int) -> Any:
    layers = model.model.layers
    if not 0 <= layer < len(layers):
        raise K3ExportError(f"layer {layer} outside 0..{len(layers) - 1}")
    return layers[layer]


@torch.no_grad()
def perturb_weight(model: Any, layer: int, param: str = "self_attn.v_proj.weight", rel: float = 0.1,
                   seed: int = 0) -> Any:
    """Copy of `model` with `model.layers.{layer}.{param}` += rel * std(W) * noise."""
    m = copy.deepcopy(model)
    w = dict(_layer(m, layer).named_parameters())[param]
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(w.shape, generator=gen, dtype=torch.float32)
    w.add_((noise * rel * w.float().std()).to(w.dtype))
    return m


def flip_decay_sign(model: Any, layer: int) -> Any:
    """Copy whose KDA layer `layer` uses -g (a growth instead of a decay) as its log-decay."""
    m = copy.deepcopy(model)
    attn = _layer(m, layer).self_attn
    if not hasattr(attn, "forget_gate"):
        raise K3ExportError(f"layer {layer} is not a KDA layer")
    original = attn.forget_gate
    attn.forget_gate = lambda x: -original(x)
    return m


@torch.no_grad()
def drop_router_bias(model: Any, layer: int) -> Any:
    """Copy whose MoE router in layer `layer` selects experts without e_score_correction_bias."""
    m = copy.deepcopy(model)
    moe = getattr(_layer(m, layer), "block_sparse_moe", None)
    if moe is None:
        raise K3ExportError(f"layer {layer} has no MoE router (dense FFN)")
    moe.gate.e_score_correction_bias.zero_()
    return m


def _transpose_last2(x: Tensor) -> Tensor:
    if isinstance(x, torch.Tensor):
        return x.transpose(-1, -2).contiguous()
    return np.ascontiguousarray(np.swapaxes(np.asarray(x), -1, -2))


class TransposedStateRunner(RunnerWrapper):
    """Feeds the recurrent state of the given KDA layers back transposed ([K, V] -> [V, K]), the classic
    layout bug of a decode loop (K == V, so shapes still match and nothing crashes)."""

    def __init__(self, inner: Runner, layers: list[int], name: str | None = None) -> None:
        super().__init__(inner, name)
        wanted = set(layers)
        self.names = [s.name for s in inner.manifest.states if s.kind == "recurrent_state" and s.layer in wanted]
        if not self.names:
            raise K3ExportError(f"no KDA recurrent state in layers {sorted(wanted)}")

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray) -> StepOutput:
        fed = dict(state)
        for n in self.names:
            fed[n] = _transpose_last2(fed[n])
        return self.inner.forward(input_ids, fed, attention_mask)


class StateCastRunner(RunnerWrapper):
    """Stores the carried state in a lower precision between calls (rounds it to `dtype` before it is fed
    back): e.g. a bfloat16 recurrent state, for the drift benchmark."""

    def __init__(self, inner: Runner, dtype: torch.dtype = torch.bfloat16, kinds: tuple[str, ...] | None = None,
                 name: str | None = None) -> None:
        super().__init__(inner, name)
        self.dtype = dtype
        self.names = {s.name for s in inner.manifest.states if kinds is None or s.group in kinds}

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray) -> StepOutput:
        fed = {}
        for n, v in state.items():
            if n in self.names:
                t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))
                v = t.to(self.dtype).to(t.dtype)
            fed[n] = v
        return self.inner.forward(input_ids, fed, attention_mask)


class InPlaceStateRunner(RunnerWrapper):
    """Writes each call's new state back into the state it was given, where the shapes agree (the constant-size
    KDA conv and recurrent states): a runtime that reuses its input buffers as outputs (an IO binding of past to
    present). Its own decode loop still looks right; a second continuation of the same state does not."""

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray) -> StepOutput:
        out = self.inner.forward(input_ids, state, attention_mask)
        for name, new in out.state.items():
            old = state.get(name)
            if old is not None and tuple(old.shape) == tuple(new.shape):
                if isinstance(old, torch.Tensor):
                    old.copy_(new if isinstance(new, torch.Tensor) else torch.as_tensor(np.asarray(new)))
                else:
                    np.copyto(old, np.asarray(new, dtype=old.dtype) if not isinstance(new, torch.Tensor)
                              else new.detach().float().cpu().numpy().astype(old.dtype))
        return out


class WindowSlotOffByOne(RunnerWrapper):
    """Returns its state window shifted by one slot (slot j holds slot j - 1's state): a rollback through the window
    also drops the last accepted token, the off-by-one a window's indexing invites."""

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray) -> StepOutput:
        out = self.inner.forward(input_ids, state, attention_mask)
        if out.window is not None:
            out.window = {k: np.roll(np.asarray(v), 1, axis=0) for k, v in out.window.items()}
        return out


class RollbackOneTooFar:
    """A rollback rule (`k3export.conversation.latest_prefix`'s signature) one position too far: when a saved state
    covers the change, it resumes from that state cut one token past the change (rebuilt from the last valid
    state with the old conversation's tokens), the bug that corrupts a multi-turn cache after an edit."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def __call__(self, saved: list[Any], ids: list[int]) -> Any:
        from k3export.conversation import common_prefix, latest_prefix

        base = latest_prefix(saved, ids)
        past = 0 if base is None else int(base.tokens.shape[1])
        for s in sorted(saved, key=lambda s: -s.tokens.shape[1]):
            old = s.tokens[0].tolist()
            n = common_prefix(old, ids)
            if past <= n < len(old):  # the change lies inside this state: keep one token of the old sequence
                return self.runner.prefill(np.asarray([old[past:n + 1]], np.int64), base)
        return base


def mutate_onnx_graph(src_dir: str | Path, dst_dir: str | Path, fn: Callable[[Any], None]) -> Path:
    """Copy an ONNX export folder to `dst_dir` with its graph changed in place by `fn(model)` (an
    ``onnx.ModelProto``, weights loaded).

    The copy stores every weight inside ``model.onnx`` (fine for small test models), so its runtime config lists
    no data files; the manifest is copied as it is. Returns the new folder.
    """
    import onnx

    src, dst = load_export(src_dir), Path(dst_dir)
    model = onnx.load(str(src.model_path), load_external_data=True)
    fn(model)
    for t in model.graph.initializer:  # everything inline in the copy
        if t.data_location == onnx.TensorProto.EXTERNAL:
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
    write_bytes_atomic(dst, MODEL_FILE, model.SerializeToString())
    src.manifest.write(dst)
    dataclasses.replace(src.runtime, model_file=MODEL_FILE, data_files=[]).write(dst)
    return dst


def mutate_onnx_initializer(src_dir: str | Path, dst_dir: str | Path, name: str,
                            fn: Callable[[np.ndarray], np.ndarray]) -> Path:
    """Copy an ONNX export folder to `dst_dir` with initializer `name` replaced by `fn(value)` (`mutate_onnx_graph`).
    """
    from onnx import numpy_helper

    def edit(model: Any) -> None:
        for init in model.graph.initializer:
            if init.name == name:
                value = numpy_helper.to_array(init)
                new = np.asarray(fn(value.copy()), dtype=value.dtype)
                if new.shape != value.shape:
                    raise K3ExportError(f"mutation of {name} changed its shape {value.shape} -> {new.shape}")
                init.CopyFrom(numpy_helper.from_array(new, name))
                return
        raise K3ExportError(f"{src_dir}: no initializer named {name!r}")

    return mutate_onnx_graph(src_dir, dst_dir, edit)


def flip_function_sign(src_dir: str | Path, dst_dir: str | Path, function: str, op_type: str) -> Path:
    """Copy an ONNX export folder to `dst_dir` whose model-local function `function` (a k3 op's body) negates the
    output of its first `op_type` node: a wrong sign in one exported op, every runtime that runs the body hit."""
    from onnx import helper

    def edit(model: Any) -> None:
        body = next((f for f in model.functions if f.name == function), None)
        if body is None:
            raise K3ExportError(f"{src_dir}: no function named {function!r}")
        at = next((i for i, n in enumerate(body.node) if n.op_type == op_type), None)
        if at is None:
            raise K3ExportError(f"{src_dir}: function {function!r} has no {op_type} node")
        node = body.node[at]
        out = node.output[0]
        node.output[0] = f"{out}_before_flip"
        body.node.insert(at + 1, helper.make_node("Neg", [node.output[0]], [out], name=f"{node.name}_flip"))

    return mutate_onnx_graph(src_dir, dst_dir, edit)
