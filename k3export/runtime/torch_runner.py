"""PyTorch runners: the eager reference (`TorchRunner`) and the same model on the Triton kernels (`TritonRunner`).

Both name their state as the contract does (`K3Cache.to_states` / `K3Cache.from_states`), so it compares by
name with an export's. Over a `K3ForConditionalGeneration` (`load_vision_model`) a runner takes the prefill's
images (``forward(..., images=loop.Images)``, `takes_images`); its state and manifest are the text model's.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3export.artifacts import StateManifest
from k3export.dtypes import dtype as as_dtype
from k3export.errors import K3ExportError

from .base import Runner, RuntimeUnavailable, StepOutput, Tensor


def load_model(model_dir: str | os.PathLike[str], dtype: str | None = None, device: str = "cpu"):
    """The checkpoint folder `model_dir` (any layout) as `K3ForCausalLM` in eval mode, in `dtype` (default: the
    checkpoint's). Read by the checked reader `export` streams from, found as `K3ForCausalLM.from_pretrained` finds
    it (the ``k3export.loaders:layouts`` entry point, `loading_k3.layout_loader`): every shard header, tensor name,
    shape and dtype is checked before anything is allocated, so a bad folder is one line naming the file and
    tensor, never a half-checked model."""
    from k3export.modeling.loading_k3 import layout_loader

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise K3ExportError(f"{path}: not a model folder (no config.json)")
    loader = layout_loader()
    if loader is None:
        raise RuntimeUnavailable("k3export's checkpoint reader is not registered: install k3export "
                                 "(`pip install -e .`) so that its 'k3export.loaders' entry points exist")
    return loader(path, torch_dtype="auto" if dtype is None else as_dtype(dtype).torch, device=device)


def load_vision_model(model_dir: str | os.PathLike[str], dtype: str | None = None, device: str = "cpu"):
    """The image + text checkpoint folder `model_dir` (config.json with a ``vision_config``) as
    `K3ForConditionalGeneration` in eval mode (`K3ForConditionalGeneration.from_pretrained`: every vision tensor
    checked from the shard headers before anything is read, the text model through the same checked loader)."""
    from k3export.modeling.modeling_k3_vision import K3ForConditionalGeneration

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise K3ExportError(f"{path}: not a model folder (no config.json)")
    kwargs = {} if dtype is None else {"torch_dtype": as_dtype(dtype).torch}
    return K3ForConditionalGeneration.from_pretrained(path, **kwargs).to(device)


def cast_model(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """`model` computing in `dtype` (any spelling): the model itself when it already does, else a copy (the
    caller's model is never changed). Casting down to bf16 / fp16 keeps the contract's fp32 parameters
    (`keeps_fp32`) in fp32, as a checkpoint of that dtype stores them, so a bf16 copy of an fp32 model upcast from
    a bf16 checkpoint holds exactly the checkpoint's values."""
    import copy

    from k3export.modeling.contract import keeps_fp32

    want = as_dtype(dtype).torch
    if model.get_input_embeddings().weight.dtype == want:
        return model
    out = copy.deepcopy(model).to(want)
    if want in (torch.bfloat16, torch.float16):
        source = dict(model.named_parameters())
        for name, p in out.named_parameters():
            if keeps_fp32(name):
                p.data = source[name].data.float().clone()
    return out.eval()


def _backend(name: str) -> Any:
    """`k3export.ops.backend.use_backend(name)` when the ops (and so their kernels) are loaded, else a no-op."""
    if "k3export.ops" not in sys.modules:
        return contextlib.nullcontext()
    from k3export.ops.backend import use_backend

    return use_backend(name)


class TorchRunner(Runner):
    """PyTorch eager over `K3ForCausalLM` + `K3Cache`: the reference every other runtime is compared with."""

    name = "torch"
    backend = "torch"  # the plain PyTorch functions, whatever kernels are plugged in

    def __init__(self, model: torch.nn.Module, *, name: str | None = None, device: str | None = None,
                 hidden: bool = True) -> None:
        self.model = model.eval()
        #: a `K3ForConditionalGeneration` takes images; its state is its text model's
        self.takes_images = hasattr(model, "get_image_features")
        self.config = model.config.text_config if self.takes_images else model.config
        self.device = torch.device(device) if device else next(model.parameters()).device
        self.model.to(self.device)
        self.dtype = as_dtype(model.get_input_embeddings().weight.dtype)
        self.hidden = hidden
        self.manifest = StateManifest.from_config(self.config, self.dtype, debug_outputs=hidden)
        if name:
            self.name = name

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], dtype: str | None = None, device: str = "cpu",
                        **kwargs: Any) -> TorchRunner:
        return cls(load_model(model_dir, dtype, device), **kwargs)

    def identity(self) -> str:
        """sha256 of the config, the dtype and every parameter's name, shape and a strided sample of its values
        (hashing every weight of a K3-size model per saved state would cost more than the state)."""
        cached = self.__dict__.get("_identity")
        if cached is None:
            import hashlib

            h = hashlib.sha256(self.config.to_json_string(use_diff=False).encode() + self.dtype.name.encode())
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    flat = p.detach().reshape(-1)
                    sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy()
                    h.update(f"{name}{list(p.shape)}".encode() + sample.tobytes())
            cached = self.__dict__["_identity"] = h.hexdigest()
        return cached

    def _tensor(self, x: Tensor, dtype: str) -> torch.Tensor:
        dt = as_dtype(dtype).torch
        if isinstance(x, torch.Tensor):
            return x.to(device=self.device, dtype=dt)
        return torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32))).to(self.device, dt)

    def initial_state(self, batch: int) -> dict[str, Tensor]:
        return {s.name: torch.zeros(s.concrete_shape(batch, 0), dtype=as_dtype(s.dtype).torch, device=self.device)
                for s in self.manifest.states}

    def image_inputs(self, images: Any) -> dict[str, torch.Tensor]:
        """The model's image inputs from `loop.Images` (pixel_values flattened per patch or not)."""
        if not self.takes_images:
            raise K3ExportError(f"{self.name}: {type(self.model).__name__} has no vision tower; images need a "
                                "checkpoint with one (K3ForConditionalGeneration)")
        v = self.model.config.vision_config
        px = images.pixel_values
        px = px if isinstance(px, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(px))
        if px.dim() == 2:  # [patches, C * p * p], as the vision graph takes them
            px = px.reshape(px.shape[0], v.in_channels, v.patch_size, v.patch_size)
        grid = images.grid_thws
        grid = grid if isinstance(grid, torch.Tensor) else torch.as_tensor(np.asarray(grid), dtype=torch.long)
        return {"pixel_values": px.to(self.device), "grid_thws": grid}

    @torch.no_grad()
    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray,
                images: Any = None) -> StepOutput:
        from k3export.modeling import K3Cache

        missing = [s.name for s in self.manifest.states if s.name not in state]
        if missing:
            raise K3ExportError(f"{self.name}: state {missing[0]!r} missing from the fed state")
        cache = K3Cache.from_states(self.config, {s.name: self._tensor(state[s.name], s.dtype)
                                                  for s in self.manifest.states})
        ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long, device=self.device)
        mask = None if attention_mask.all() else torch.as_tensor(attention_mask, device=self.device)
        extra = {} if images is None else self.image_inputs(images)
        with _backend(self.backend):
            out = self.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True,
                             output_hidden_states=self.hidden, logits_to_keep=self.logits_to_keep, **extra)
        hidden = list(out.hidden_states) if out.hidden_states is not None else None
        return StepOutput(logits=out.logits, state=out.cache.to_states(), hidden=hidden)

    def describe(self) -> str:
        return f"{self.name} (PyTorch eager, {self.device.type}, {self.dtype.name})"


def triton_status(device: str = "cpu") -> str | None:
    """None when the Triton kernels of `k3export.ops` can run on `device`; otherwise why not (one line)."""
    from k3export.ops.backend import triton_available, triton_interpret

    if not triton_available():
        return "triton is not importable (pip install 'k3export[triton]')"
    if device == "cpu" and not triton_interpret():
        return "Triton on CPU needs TRITON_INTERPRET=1 set before triton is imported"
    return None


class TritonRunner(TorchRunner):
    """The same model with the Triton kernels of `k3export.ops` plugged in (``register_kernel``) and the ops
    backend set to ``"triton"`` around every call: KDA, SiTU-GLU and routing run as Triton kernels (natively on
    CUDA; on CPU under ``TRITON_INTERPRET=1``, slowly: `max_steps` bounds the decode steps a validation asks)."""

    name = "triton"
    backend = "triton"

    def __init__(self, model: torch.nn.Module, *, name: str | None = None, device: str | None = None,
                 hidden: bool = True, max_steps: int | None = None) -> None:
        dev = torch.device(device) if device else next(model.parameters()).device
        why = triton_status(dev.type)
        if why is not None:
            raise RuntimeUnavailable(f"triton runner: {why}")
        from k3export.kernels import plug_in

        plug_in()
        super().__init__(model, name=name, device=str(dev), hidden=hidden)
        self.max_steps = max_steps

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], dtype: str | None = None, device: str = "cpu",
                        **kwargs: Any) -> TritonRunner:
        return cls(load_model(model_dir, dtype, device), **kwargs)

    def describe(self) -> str:
        interp = " interpreter" if self.device.type == "cpu" else ""
        return f"{self.name} (k3export.ops Triton kernels{interp}, {self.device.type}, {self.dtype.name})"
