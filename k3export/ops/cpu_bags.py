"""CPU decode products through ``embedding_bag``: the kernels of the modeling file's ``linears`` hook (one fp32 row)
and of its ``moe_experts`` hook (no more token-slots than experts).

One row times a weight stored [in, out] is a bag: ``embedding_bag`` sums the weight's rows scaled by the row's
entries where they lie, one bag per thread. That is one pass at the memory's pace with no weight-sized temporary
(``vecdot`` multiplies into one before it sums, which evicts the caches a decode step's small operators live in;
BLAS reads a lone row slower). Side by side: docs/speed.md, "One-row products through embedding_bag".

* `linears`: a weight moves into an [in, out] storage on its first one-row call and the parameter becomes its
  transposed view; linears that read one input (a group) move into one [in, sum(out)] storage, side by side, read
  by one bag call (each call costs ~10 us besides its reads; 42 fewer a big_cfg step). Prefill's ``F.linear``
  takes the transposed storage as it is. A group is placed again when a member's weight was replaced (checked at
  every call), and a member called alone takes ``F.linear`` on its block (bags would copy it). `state_dict` gives
  such weights back contiguous, as a checkpoint holds them. Below `ROW_MIN_NUMEL` elements BLAS is as quick.
* `moe_experts`: each token-slot is one bag per weight over its expert's rows of a stack stored [E, in, out]
  (`expert_stacks` keeps CPU stacks so): every expert read in place, no per-expert launch, no host sync.

Both decline (the PyTorch function runs) outside the ``auto`` backend, where autograd would record, and outside
the shapes above; `linears` also for another dtype than fp32.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3export.ops import backend
from k3export.ops.naive import situ_glu_naive

ROW_MIN_NUMEL = 1 << 16  # below it BLAS is as quick
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # linears given the state-dict hook


def linears(x: torch.Tensor, modules: Sequence[nn.Module]) -> Any:
    """`modeling_k3.linears` for one fp32 row on CPU: x through each linear of `modules` (bias-free), their
    weights read by one bag call; NotImplemented otherwise."""
    if not (x.dtype is torch.float32 and x.is_cpu) or backend.get_backend() != "auto":
        return NotImplemented
    ws = [m._parameters["weight"] for m in modules]  # not Module.__getattr__: ~100 calls a step
    grad = torch.is_grad_enabled()
    for m, w in zip(modules, ws):
        if (m._parameters.get("bias") is not None or w.dtype is not torch.float32 or x.numel() != w.shape[1]
                or (grad and w.requires_grad)):
            return NotImplemented
    if sum(w.numel() for w in ws) < ROW_MIN_NUMEL:
        return NotImplemented
    if len(ws) == 1:
        w = ws[0]
        if w.stride(0) != 1:
            _store_inputs_first(modules[0], w)
        if w.stride(1) != w.shape[0]:  # a block of a group's storage: bags would copy it
            return NotImplemented
        return [row_linear(x, w)]
    fused = _side_by_side(ws)
    if fused is None:
        fused = _place_side_by_side(modules, ws)
    return list(row_linear(x, fused.t()).split([w.shape[0] for w in ws], -1))


def row_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One row x [..., in] times w [out, in] stored [in, out], as bags (one per thread, of equal size)."""
    out_f, in_f = w.shape
    bags = _bag_count(in_f, torch.get_num_threads())
    # detached: a weight that requires grad sends embedding_bag down its slower autograd-ready path (~3 us a call)
    y = _bags(w.detach().t(), _arange(in_f), _bag_offsets(bags, in_f // bags), x.reshape(-1))
    return y.sum(0).view(*x.shape[:-1], out_f)


def moe_experts(z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: Any, w3: Any, w2: Any,
                act: str, beta1: float, beta2: float) -> Any:
    """`modeling_k3.moe_experts` for no more token-slots than experts, on CPU stacks stored [E, in, out] in z's
    dtype: row s of each product is w[e[s]] @ x[s], one bag per slot (bags run in parallel); NotImplemented
    otherwise."""
    ws = (w1, w3, w2)
    if (not all(isinstance(w, torch.Tensor) for w in ws) or not z.is_cpu or backend.get_backend() != "auto"
            or not 0 < indices.numel() <= w1.shape[0] or not z.dtype == w1.dtype == w3.dtype == w2.dtype
            or not all(_slot_layout(w) for w in ws)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (z, *ws)))):
        return NotImplemented
    N, k = indices.shape
    e = indices.reshape(-1)
    x = z.repeat_interleave(k, dim=0) if k > 1 else z  # slot (n, j) reads token n
    rows = _slot_rows(e, w1.shape[2])
    gate, up = _slot_linear(x, w1, rows), _slot_linear(x, w3, rows)
    h = situ_glu_naive(gate, up, beta1, beta2, dtype=torch.float32) if act == "situ" else F.silu(gate) * up
    y = _slot_linear(h, w2, rows if w2.shape[2] == w1.shape[2] else _slot_rows(e, w2.shape[2]))
    y = y if y.dtype is torch.float32 else y.float()
    return (y * weights.reshape(-1, 1)).view(N, k, -1).sum(1)


def _slot_layout(w: torch.Tensor) -> bool:
    """Whether w [E, out, in] is a view of a contiguous [E, in, out] stack."""
    return w.dim() == 3 and w.stride() == (w.shape[1] * w.shape[2], 1, w.shape[1])


def _slot_rows(e: torch.Tensor, in_f: int) -> torch.Tensor:
    """The table rows of the experts `e` [S] in a stack stored [E, in, out], `in_f` rows per slot: [S * in_f]."""
    return ((e * in_f).unsqueeze(-1) + _arange(in_f)).view(-1)


def _slot_linear(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Row s: w[e[s]] @ x[s] (`rows` = `_slot_rows(e, in)`), w [E, out, in] stored [E, in, out]: one bag per slot."""
    E, out_f, in_f = w.shape
    return _bags(w.as_strided((E * in_f, out_f), (out_f, 1)), rows, _bag_offsets(x.shape[0], in_f), x.reshape(-1))


def _bags(table: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Bag b: sum of table[rows[i]] * scale[i] over offsets[b] <= i < offsets[b + 1], [bags, table columns].
    `embedding_bag`'s ATen op: F.embedding_bag's argument checks and 2-D offsets cost ~4 us of each of a decode
    step's ~100 calls."""
    return torch.embedding_bag(table, rows, offsets, False, 0, False, scale)[0]


@functools.cache
def _bag_offsets(bags: int, size: int) -> torch.Tensor:
    """Offsets of `bags` bags of `size` rows each."""
    with torch.inference_mode(False):  # usable outside inference mode too
        return torch.arange(0, bags * size, size)


@functools.cache
def _arange(n: int) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.arange(n)


@functools.cache
def _bag_count(in_features: int, threads: int) -> int:
    """As many bags as threads, of equal size."""
    return max(n for n in range(1, max(threads, 1) + 1) if in_features % n == 0)


def _store_inputs_first(module: nn.Module, w: torch.Tensor) -> None:
    """Move the weight [out, in] into an [in, out] storage, in place: the parameter becomes its transposed view."""
    with torch.inference_mode(False), torch.no_grad():  # not an inference tensor: it is the parameter's storage
        w.data = w.t().contiguous().t()
    _hook(module)


def _side_by_side(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """The [in, sum(out)] storage whose column blocks the weights `ws` [out, in] are, in order, or None."""
    total = sum(w.shape[0] for w in ws)
    at, step = ws[0].data_ptr(), ws[0].element_size()
    for w in ws:
        if w.data_ptr() != at or w.stride() != (1, total) or w.dtype != ws[0].dtype:
            return None
        at += w.shape[0] * step
    return ws[0].detach().as_strided((ws[0].shape[1], total), (total, 1))


def _place_side_by_side(modules: Sequence[nn.Module], ws: list[torch.Tensor]) -> torch.Tensor:
    """One [in, sum(out)] storage holding the weights `ws` [out, in] side by side, which become its column blocks;
    each old storage is freed as soon as it is copied."""
    with torch.inference_mode(False), torch.no_grad():  # not an inference tensor: it is the parameters' storage
        fused = ws[0].new_empty(ws[0].shape[1], sum(w.shape[0] for w in ws))
        start = 0
        for w in ws:
            block = fused[:, start:start + w.shape[0]]
            block.copy_(w.t())
            w.data = block.t()
            start += w.shape[0]
    for m in modules:
        _hook(m)
    return fused


def _hook(module: nn.Module) -> None:
    if module not in _HOOKED:
        module.register_state_dict_post_hook(_contiguous_weight)
        _HOOKED.add(module)


def _contiguous_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A weight stored [in, out] or inside a group's storage goes into a state dict as a contiguous copy."""
    w = state_dict.get(prefix + "weight")
    if w is not None and not w.is_contiguous():
        state_dict[prefix + "weight"] = w.contiguous()


#: name -> kernel for `k3export.modeling.modeling_k3.register_kernel`
KERNELS = {"linears": linears, "moe_experts": moe_experts}
