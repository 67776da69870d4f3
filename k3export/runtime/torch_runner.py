"""PyTorch runners: the eager reference (`TorchRunner`) and the same model on the Triton kernels (`TritonRunner`).

Both map `K3Cache` (conv_states / recurrent_states / latents dicts) to and from the manifest's names, so
their state compares by name with an export's.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3export.errors import K3ExportError

from .base import Runner, RuntimeUnavailable, StepOutput, Tensor
from .manifest import StateManifest

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _TORCH_DTYPES.items()}[dtype]


def load_model(model_dir: str | os.PathLike[str], dtype: str | None = None, device: str = "cpu"):
    """`K3ForCausalLM.from_pretrained(model_dir)` in eval mode, with a clear error for a bad folder."""
    from k3export.modeling import K3ForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise K3ExportError(f"{path}: not a model folder (no config.json)")
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = _TORCH_DTYPES[dtype]
    try:
        model = K3ForCausalLM.from_pretrained(str(path), **kwargs)
    except TypeError:  # older transformers: torch_dtype
        model = K3ForCausalLM.from_pretrained(str(path), torch_dtype=kwargs.get("dtype"))
    return model.to(device).eval()


class TorchRunner(Runner):
    """PyTorch eager over `K3ForCausalLM` + `K3Cache`: the reference every other runtime is compared with."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, *, name: str | None = None, device: str | None = None,
                 hidden: bool = True) -> None:
        self.model = model.eval()
        self.config = model.config
        self.device = torch.device(device) if device else next(model.parameters()).device
        self.model.to(self.device)
        self.dtype = next(p for n, p in model.named_parameters() if n.endswith("embed_tokens.weight")).dtype
        self.manifest = StateManifest.from_config(self.config, _dtype_name(self.dtype))
        self.hidden = hidden
        if name:
            self.name = name

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], dtype: str | None = None, device: str = "cpu",
                        **kwargs: Any) -> TorchRunner:
        return cls(load_model(model_dir, dtype, device), **kwargs)

    # ------------------------------------------------------------------ state <-> K3Cache
    def _tensor(self, x: Tensor, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.to(device=self.device, dtype=dtype)
        return torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32))).to(self.device, dtype)

    def to_cache(self, state: dict[str, Tensor]):
        from k3export.modeling import K3Cache

        cache = K3Cache(self.config)
        conv: dict[int, dict[str, torch.Tensor]] = {}
        seen = 0
        for entry in self.manifest.states:
            if entry.name not in state:
                raise K3ExportError(f"{self.name}: state {entry.name!r} missing from the fed state")
            dt = torch.float32 if entry.kind == "recurrent_state" else self.dtype
            t = self._tensor(state[entry.name], dt)
            if entry.kind.startswith("conv_state"):
                conv.setdefault(entry.layer, {})[entry.kind[-1]] = t
            elif entry.kind == "recurrent_state":
                cache.recurrent_states[entry.layer] = t
            elif entry.kind == "latent":
                cache.latents[entry.layer] = t
                seen = t.shape[1]
        for layer, parts in conv.items():
            cache.conv_states[layer] = (parts["q"], parts["k"], parts["v"])
        cache._seen_tokens = seen
        return cache

    def from_cache(self, cache) -> dict[str, torch.Tensor]:
        out = {}
        for entry in self.manifest.states:
            if entry.kind.startswith("conv_state"):
                out[entry.name] = cache.conv_states[entry.layer]["qkv".index(entry.kind[-1])]
            elif entry.kind == "recurrent_state":
                out[entry.name] = cache.recurrent_states[entry.layer]
            else:
                out[entry.name] = cache.latents[entry.layer]
        return out

    def initial_state(self, batch: int) -> dict[str, Tensor]:
        out = {}
        for s in self.manifest.states:
            dt = torch.float32 if s.kind == "recurrent_state" else self.dtype
            out[s.name] = torch.zeros(s.concrete_shape(batch, 0), dtype=dt, device=self.device)
        return out

    # ------------------------------------------------------------------ run
    def _call_model(self, ids: torch.Tensor, cache) -> Any:
        return self.model(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=self.hidden)

    @torch.no_grad()
    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor]) -> StepOutput:
        ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long, device=self.device)
        out = self._call_model(ids, self.to_cache(state))
        hidden = list(out.hidden_states) if out.hidden_states is not None else None
        return StepOutput(logits=out.logits, state=self.from_cache(out.cache), hidden=hidden)

    def describe(self) -> str:
        return f"{self.name} (PyTorch eager, {self.device.type}, {_dtype_name(self.dtype)})"


def triton_status(device: str = "cpu") -> str | None:
    """None when the Triton-backed k3 ops can run on `device`; otherwise why not (one line)."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"triton is not importable ({exc.__class__.__name__}: {exc})"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return "Triton on CPU needs TRITON_INTERPRET=1 set before triton is imported"
    try:
        import k3export.ops  # noqa: F401
        for mod in ("kda", "situ_glu", "moe_route"):
            try:
                __import__(f"k3export.ops.{mod}")
            except ImportError:
                pass
    except Exception as exc:  # noqa: BLE001
        return f"k3export.ops failed to import ({exc.__class__.__name__}: {exc})"
    missing = [op for op in ("kda", "situ_glu", "moe_route") if not hasattr(getattr(torch.ops, "k3", None) or
                                                                                 object(), op)]
    if missing:
        return f"torch.ops.k3 lacks {', '.join(missing)} (k3export.ops does not register them yet)"
    return None


class TritonRunner(TorchRunner):
    """The same model with ``config.ops_backend = "triton"``: KDA, SiTU-GLU and routing run as torch.ops.k3.*
    Triton kernels (natively on CUDA; on CPU under ``TRITON_INTERPRET=1``, slowly: `max_steps` bounds the
    decode steps a validation asks of it)."""

    name = "triton"

    def __init__(self, model: torch.nn.Module, *, name: str | None = None, device: str | None = None,
                 hidden: bool = True, max_steps: int | None = None) -> None:
        dev = torch.device(device) if device else next(model.parameters()).device
        why = triton_status(dev.type)
        if why is not None:
            raise RuntimeUnavailable(f"triton runner: {why}")
        model = copy.deepcopy(model)
        model.config.ops_backend = "triton"  # one config object is shared by every module of the copy
        for module in model.modules():
            if hasattr(module, "config"):
                module.config = model.config
        super().__init__(model, name=name, device=str(dev), hidden=hidden)
        self.max_steps = max_steps

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], dtype: str | None = None, device: str = "cpu",
                        **kwargs: Any) -> TritonRunner:
        return cls(load_model(model_dir, dtype, device), **kwargs)

    def _call_model(self, ids: torch.Tensor, cache) -> Any:
        try:
            from k3export.ops.backend import use_backend
        except ImportError:  # pragma: no cover - ops without a backend switch
            return super()._call_model(ids, cache)
        with use_backend("triton"):
            return super()._call_model(ids, cache)

    def describe(self) -> str:
        interp = " interpreter" if self.device.type == "cpu" else ""
        return f"{self.name} (torch.ops.k3 Triton kernels{interp}, {self.device.type}, {_dtype_name(self.dtype)})"
