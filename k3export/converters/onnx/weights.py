# Copyright 2026 the k3export authors. Apache-2.0.
"""Weight sources and the streaming external-data writer.

Every initializer is external data in shards ``model.onnx.data.00000``, ``.00001``, ... laid out in declaration
order by `shards.plan_shards` (4 KiB-aligned, a new shard past ``max_shard_bytes``). Bytes are written one source
tensor at a time (stacked expert weights one expert at a time), so peak memory is one source tensor, whatever the
model size. ``model.onnx`` itself holds no weight bytes and stays far below 2 GB.

Without weights the same layout is computed and recorded in the initializers, but no shard is written: the
references point at absent files (see ``runtime_config.json``: ``weights_materialized: false``).

Sources: `ModuleSource` (an in-memory model), `SafetensorsSource` (our dense layout) and `CheckpointSource`
(any layout `scan_checkpoint` reads, from its header map, streaming: the released K3, ours with ``--keep-mxfp4``,
Kimi-Linear, NVIDIA's NVFP4 release). MXFP4 experts come out of `CheckpointSource` as their packed bytes and scales
(``experts.{e}.w1.weight_packed`` / ``.weight_scale``, uint8, byte for byte, for FLOAT4E2M1 / FLOAT8E8M0
initializers) or decoded (``experts.{e}.w1.weight``, for a dense export); NVFP4 experts as their packed bytes,
E4M3 scales and fp32 global scale (``.weight_packed`` / ``.weight_scale`` / ``.weight_scale_2``) or decoded; FP8
block weights ``<name>.weight`` decoded, or as their E4M3 values (``<name>.weight.fp8``) and their tile scales
expanded for a blocked ``DequantizeLinear`` (``<name>.weight.fp8_scale``, `fp8`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import onnx
import torch
from onnx import TensorProto

from k3export.errors import CheckpointError, ExportError

from .builder import WeightSpec
from .shards import plan_shards, write_shards


class WeightSource(Protocol):
    def get(self, name: str) -> torch.Tensor: ...


class ModuleSource:
    """Parameters and buffers of an in-memory `K3ForCausalLM`."""

    def __init__(self, model: torch.nn.Module, allow_nonfinite: bool = False) -> None:
        self.tensors = dict(model.state_dict())
        self.allow_nonfinite = allow_nonfinite

    def get(self, name: str) -> torch.Tensor:
        from k3export.converters.checkpoints.safetensors_io import all_finite

        if name not in self.tensors:
            raise ExportError(f"the model has no tensor {name!r}")
        tensor = self.tensors[name]
        if not self.allow_nonfinite and not all_finite(tensor):
            raise ExportError(f"the model's tensor {name!r} holds NaN or Inf (--allow-nonfinite exports it anyway)")
        return tensor


class CheckpointSource:
    """Tensors of a checkpoint folder through `scan_checkpoint`'s header map, read one at a time (no model is built).

    ``name`` is ours. A dense tensor comes back as stored. An MXFP4 expert ``....w1.weight`` comes back decoded
    (`decode_mxfp4`, exact in bfloat16); ``....w1.weight_packed`` / ``....w1.weight_scale`` come back as the
    checkpoint's raw uint8 bytes ([out, in/2] and [out, in/32]), for an export that keeps MXFP4."""

    def __init__(self, folder: str | os.PathLike[str], allow_nonfinite: bool = False,
                 config_json: dict[str, Any] | None = None) -> None:
        from k3export.converters.checkpoints.plan import scan_checkpoint

        self.folder = Path(folder)
        self.scan = scan_checkpoint(self.folder, config_json=config_json)  # config_json: when the caller read it
        self.finite = not allow_nonfinite  # refuse NaN / Inf weights and NaN (0xFF) MXFP4 scales while streaming

    @property
    def has_mxfp4(self) -> bool:
        """Whether the routed experts are stored in MXFP4 (released layout, or ours converted with --keep-mxfp4)."""
        from k3export.converters.checkpoints.layouts import PACKED

        return any(t.kind == PACKED for t in self.scan.tensors.values())

    @property
    def has_nvfp4(self) -> bool:
        """Whether the routed experts are stored in NVFP4 (NVIDIA's release, or ``convert --experts nvfp4``)."""
        from k3export.converters.checkpoints.layouts import NVFP4

        return any(t.kind == NVFP4 for t in self.scan.tensors.values())

    @property
    def fp8_names(self) -> frozenset[str]:
        """Our names of the weights stored in block FP8 (NVIDIA's attention projections, ``FP8_PB_WO``)."""
        from k3export.converters.checkpoints.layouts import FP8_BLOCK

        return frozenset(name for name, t in self.scan.tensors.items() if t.kind == FP8_BLOCK)

    def get(self, name: str) -> torch.Tensor:
        from k3export.converters.checkpoints.layouts import DENSE, FP8_BLOCK, NVFP4, PACKED, fit_stored
        from k3export.converters.checkpoints.mxfp4 import decode_mxfp4
        from k3export.converters.checkpoints.safetensors_io import all_finite

        base, _, suffix = name.rpartition(".")
        nv = self.scan.tensors.get(base + ".weight")
        if nv is not None and nv.kind == NVFP4 and suffix in ("weight_packed", "weight_scale", "weight_scale_2"):
            # NVFP4's bytes as stored: packed E2M1, E4M3 block scales, the fp32 global scale (a scalar)
            file, stored = {"weight_packed": (nv.file, nv.stored), "weight_scale": (nv.scale_file, nv.scale_stored),
                            "weight_scale_2": (nv.scale2_file, nv.scale2_stored)}[suffix]
            value = self.scan.readers[file or nv.file].read(stored or "")
            return value.reshape(()) if suffix == "weight_scale_2" else value
        fp8 = self.scan.tensors.get(base)
        if fp8 is not None and fp8.kind == FP8_BLOCK and suffix in ("fp8", "fp8_scale"):
            return self._fp8(fp8, suffix)
        if suffix in ("weight_packed", "weight_scale"):
            t = self.scan.tensors.get(base + ".weight")
            if t is None or t.kind != PACKED:
                raise CheckpointError(f"{self.folder}: {base}.weight is not stored in MXFP4, so it has no {suffix} "
                                      "(export its experts dense: --experts dense)")
            if suffix == "weight_packed":
                return self.scan.readers[t.file].read(t.stored)
            return self._scales(t)
        t = self.scan.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        if t.kind == PACKED:
            data = self.scan.readers[t.file].read(t.stored)
            return decode_mxfp4(data, self._scales(t), name=t.stored)
        if t.kind != DENSE:  # NVFP4 expert, FP8 block weight: decoded in fp32, then checked
            value = self.scan.read_value(t, torch.float32)
            if self.finite and not all_finite(value):
                raise CheckpointError(f"{self.folder / t.file}: tensor {t.stored!r} decodes to NaN or Inf "
                                      "(--allow-nonfinite exports it anyway)")
            return value
        data = self.scan.readers[t.file].read(t.stored, finite=self.finite)
        return fit_stored(name, data, t.model_shape)

    def _fp8(self, t, suffix: str) -> torch.Tensor:
        """An FP8 block weight's E4M3 values as stored (``fp8``) or its tile scales expanded for the blocked
        ``DequantizeLinear`` (``fp8_scale``, `nvfp4.fp8_row_scales`); NaN (E4M3 0x7F / 0xFF) refused."""
        from k3export.converters.checkpoints.nvfp4 import fp8_row_scales
        from k3export.converters.checkpoints.safetensors_io import all_finite

        if suffix == "fp8":
            value = self.scan.readers[t.file].read(t.stored)
            file, stored = t.file, t.stored
            bad = self.finite and bool(((value.view(torch.uint8) & 0x7F) == 0x7F).any())  # E4M3's only NaN
        else:
            assert t.scale_file is not None and t.scale_stored is not None
            value = self.scan.readers[t.scale_file].read(t.scale_stored)
            file, stored = t.scale_file, t.scale_stored
            bad = self.finite and not all_finite(value)
        if bad:
            raise CheckpointError(f"{self.folder / file}: tensor {stored!r} holds NaN or Inf "
                                  "(--allow-nonfinite exports it anyway)")
        return value if suffix == "fp8" else fp8_row_scales(value, *t.shape)

    def _scales(self, t) -> torch.Tensor:
        assert t.scale_file is not None and t.scale_stored is not None
        scales = self.scan.readers[t.scale_file].read(t.scale_stored)
        if self.finite and scales.numel() and int(scales.max()) == 0xFF:
            raise CheckpointError(f"{self.folder / t.scale_file}: tensor {t.scale_stored!r} holds the E8M0 NaN scale "
                                  "(byte 0xFF); --allow-nonfinite exports it anyway")
        return scales

    def close(self) -> None:
        self.scan.close()


def plan_layout(specs: list[WeightSpec], max_shard_bytes: int) -> list[tuple[WeightSpec, str, int]]:
    """(spec, shard file name, offset) for every weight, in order."""
    return [(spec, loc, off) for spec, (loc, off) in zip(specs, plan_shards([s.nbytes for s in specs],
                                                                             max_shard_bytes))]


def initializer(spec: WeightSpec, location: str, offset: int) -> TensorProto:
    t = TensorProto()
    t.name = spec.name
    t.data_type = spec.dtype.onnx
    t.dims.extend(spec.shape)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(spec.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _raw(tensor: torch.Tensor, spec: WeightSpec, part: str, shape: tuple[int, ...]) -> memoryview:
    if spec.dtype.torch_name is None:  # FLOAT4E2M1 / FLOAT8E8M0: the source's bytes as they are (packed last axis)
        packed = (*shape[:-1], shape[-1] * spec.dtype.bits // 8)
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != packed:
            raise CheckpointError(f"tensor {part!r} is {tensor.dtype} {tuple(tensor.shape)}; {spec.dtype.name} "
                                  f"{shape} needs its raw bytes as uint8 {packed}")
        return memoryview(tensor.detach().cpu().contiguous().reshape(-1).numpy())
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"tensor {part!r} has shape {tuple(tensor.shape)}, the config implies {shape}")
    t = tensor.detach().to(device="cpu", dtype=spec.dtype.torch).contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_weights(layout: list[tuple[WeightSpec, str, int]], folder: Path, source: WeightSource,
                  progress: Callable[[int, int], None] | None = None, resume_key: str | None = None) -> list[str]:
    """Stream every weight's bytes into its shard at its offset; returns the shard names written. `progress` is
    called with (bytes written, bytes in all) after each weight. With `resume_key` (a hash of everything that
    determines the bytes) each finished shard is recorded under `RESUME_DIR` with its size and sha256, and a shard
    that a run with the same key finished, whose file still matches, is kept instead of written again."""
    quantized: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # a projection's codes and scales, until both are out

    def write(fh, spec: WeightSpec) -> None:
        if spec.quant is not None:
            from .quantize import dense_weight, quantize_blocks

            q, key = spec.quant, spec.quant.dense.name
            if key not in quantized:
                quantized[key] = quantize_blocks(dense_weight(spec, source.get), q.bits, q.block_size)
            blocks, scales = quantized[key]
            fh.write(memoryview(np.ascontiguousarray(blocks if q.role == "blocks" else scales).reshape(-1)))
            if q.role == "scales":
                quantized.pop(key)
            return
        for i, part in enumerate(spec.parts):
            fh.write(_raw(source.get(part), spec, part, spec.part_shape(i)))

    write_shards(folder, [(spec, spec.nbytes) for spec, _, _ in layout], [(loc, off) for _, loc, off in layout],
                 write, resume_key=resume_key, progress=progress)
    return sorted({loc for _, loc, _ in layout})


def check_no_raw(model: onnx.ModelProto) -> None:
    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            raise ExportError(f"initializer {t.name} is not external data")
