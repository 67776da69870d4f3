"""The kernel of the modeling file's ``expert_weights`` hook: a MoE layer's expert weights as three stacks
[E, out, in] that the experts' parameters are views of.

`moe_experts`' kernels read stacks: the Triton kernel the [E, out, in] tensors, and on CPU the decode path of
`k3export.ops.cpu_bags`, which reads rows of a stack stored [E, in, out]. So the first call of a layer moves its
experts' parameters into stacks in that device's layout, one expert at a time, each parameter becoming its row
(its old storage is freed as soon as it is copied): the weights are held once, and an edit in place is an edit
of the stacks. Where the allocator returns freed blocks and commits pages as they are written (glibc above its
mmap threshold), a process never holds a layer's experts twice (59 GB of bf16 per K3 layer); CUDA commits a
stack up front. `state_dict` then gives the parameters as contiguous copies, as a checkpoint holds them
(transformers' tied-weight check and safetensors need that).

Later calls return the stacks after O(1) checks, so a decode step does not touch every expert's parameter. A
parameter or module assigned into the layer through ``nn.Module`` (attribute assignment, ``register_parameter``,
``add_module``, ``load_state_dict(assign=True)``) marks its stacks stale (torch's global registration hooks), and
so does a removed expert or a model moved to another device or dtype (its first expert weight moves): the next
call stacks again. A lone ``param.data = ...`` on one expert is not seen: assign a parameter, or edit in place.

The kernel declines (the modeling file hands the parameters as they are, read in place) under the ``torch``
backend, where autograd would record, for float64 (the reference dtype) and for experts not laid out as K3's.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from k3export.ops import backend

WEIGHTS = ("w1", "w3", "w2")  # gate, up, down: the order of `moe_experts`' arguments
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(eq=False)
class _Layer:
    """The stacks of one experts list and what they were built from."""

    stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    params: list[torch.Tensor]  # w1, w3, w2 of each expert in turn
    first: int  # params[0].data_ptr() when stacked
    stale: bool = False

    def current(self, experts: nn.Module) -> bool:
        return not self.stale and 3 * len(experts) == len(self.params) and self.params[0].data_ptr() == self.first


_LAYERS: weakref.WeakKeyDictionary[nn.Module, _Layer] = weakref.WeakKeyDictionary()  # experts list -> stacks
# the experts list, each expert and each of their linears -> the `_Layer` that a registration into it makes stale
_OWNERS: weakref.WeakKeyDictionary[nn.Module, _Layer] = weakref.WeakKeyDictionary()
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # experts lists given the state-dict hook


def expert_weights(experts: nn.Module) -> Any:
    """`modeling_k3.expert_weights`: (w1, w3, w2) stacked [E, out, in] (on CPU stored [E, in, out]), the
    parameters their views; NotImplemented where the kernel declines (see the module docstring)."""
    if backend.get_backend() == "torch":
        return NotImplemented
    layer = _LAYERS.get(experts)
    if layer is None or not layer.current(experts):
        layer = _stack(experts)
        if layer is None:
            return NotImplemented
    w = layer.params[0]
    if w.dtype not in _FLOATS or (w.requires_grad and torch.is_grad_enabled()):
        return NotImplemented
    return layer.stacks


def cpu_layout(device: torch.device) -> bool:
    """Whether stacks on `device` are stored [E, in, out] (CPU, for `cpu_bags`' per-slot rows) rather than in the
    checkpoint's [E, out, in] (accelerators)."""
    return device.type == "cpu"


def _stack(experts: nn.Module) -> _Layer | None:
    """Stack `experts`' weights (or find them stacked already: a deep copy of stacked experts is) and record it."""
    try:
        mods = [e._modules for e in experts._modules.values()]
        ws = [m[n]._parameters["weight"] for m in mods for n in WEIGHTS]
    except (AttributeError, KeyError, TypeError):
        return None
    if not ws or any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in ws):
        return None
    groups = [ws[i::3] for i in range(3)]
    if any(len({(w.shape, w.dtype, w.device) for w in g}) != 1 for g in groups):
        return None
    if ws[0].dtype not in _FLOATS or (ws[0].requires_grad and torch.is_grad_enabled()):
        return None  # nothing moves for a call the kernel declines
    stacks = tuple(_rows_of(g) for g in groups)
    if any(s is None for s in stacks):
        stacks = _stack_in_place(ws)
    layer = _Layer(stacks, ws, ws[0].data_ptr())  # type: ignore[arg-type]
    _watch()
    _LAYERS[experts] = layer
    for m in (experts, *experts._modules.values(), *(sub for m in mods for sub in m.values())):
        _OWNERS[m] = layer
    if experts not in _HOOKED:
        experts.register_state_dict_post_hook(_contiguous_experts)
        _HOOKED.add(experts)
    return layer


def _rows_of(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """The stack [E, out, in] whose rows the weights `ws` are, in this device's layout, or None."""
    out_f, in_f = ws[0].shape
    strides = (in_f * out_f, 1, out_f) if cpu_layout(ws[0].device) else (in_f * out_f, in_f, 1)
    base, step = ws[0].data_ptr(), in_f * out_f * ws[0].element_size()
    if any(w.data_ptr() != base + e * step or w.stride() != strides[1:] for e, w in enumerate(ws)):
        return None
    with torch.inference_mode(False):  # an ordinary view, usable outside inference mode too
        return ws[0].detach().as_strided((len(ws), out_f, in_f), strides)


def _stack_in_place(ws: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w3, w2) stacks of the weights `ws` (w1, w3, w2 of each expert in turn), which become the parameters'
    storage; filled one expert at a time, each parameter moved as soon as it is copied."""
    stacks = []
    # not inference tensors even under inference_mode: they become the parameters' storage
    with torch.inference_mode(False), torch.no_grad():
        for group in (ws[0::3], ws[1::3], ws[2::3]):
            out_f, in_f = group[0].shape
            if cpu_layout(group[0].device):
                stack = group[0].new_empty(len(group), in_f, out_f).transpose(1, 2)
            else:
                stack = group[0].new_empty(len(group), out_f, in_f)
            for w, view in zip(group, stack):
                view.copy_(w)
                w.data = view
            stacks.append(stack)
    return tuple(stacks)  # type: ignore[return-value]


def _contiguous_experts(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """Expert weights that are views of a stack [E, in, out] go into a state dict as contiguous [out, in] copies.
    Only this list's own keys are looked up: the dict holds every layer's tensors (247k expert weights in K3)."""
    for e in module._modules:
        for w in WEIGHTS:
            name = f"{prefix}{e}.{w}.weight"
            t = state_dict.get(name)
            if t is not None and not t.is_contiguous():
                state_dict[name] = t.contiguous()


def _registered(module: nn.Module, name: str, value: Any) -> None:
    """torch's global registration hook: a parameter or module assigned into stacked experts makes them stale."""
    layer = _OWNERS.get(module)
    if layer is not None:
        layer.stale = True


@functools.cache
def _watch() -> None:
    """Install the registration hooks, once per process (on the first stacking)."""
    nn.modules.module.register_module_parameter_registration_hook(_registered)
    nn.modules.module.register_module_module_registration_hook(_registered)


#: name -> kernel for `k3export.modeling.modeling_k3.register_kernel`
KERNELS = {"expert_weights": expert_weights}
