"""Analytic model statistics from a config alone: the layer layout, parameter counts and decode-state sizes; and
what a TensorRT engine's sidecar records (`engine_summary`).

Nothing is instantiated, so this works for the full 2.8T-parameter release; tests check the counts
against ``sum(p.numel())`` of a real tiny model.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k3export.dtypes import dtype as as_dtype
from k3export.modeling import contract
from k3export.modeling.configuration_k3 import K3Config, K3VisionConfig


#: the longest block `repeating_runs` looks for: a longer period is no pattern a reader takes in at a glance
MAX_BLOCK = 16


@dataclass(frozen=True)
class Run:
    """Layers ``start`` to ``stop - 1``: ``block`` (one kind per layer) ``repeats`` times over."""

    start: int
    block: tuple[str, ...]
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + len(self.block) * self.repeats

    def __str__(self) -> str:
        """``(kda, kda, kda, mla) x 23``, ``mla x 3``, ``kda``."""
        kinds = self.block[0] if len(self.block) == 1 else f"({', '.join(self.block)})"
        return kinds if self.repeats == 1 else f"{kinds} x {self.repeats}"


def repeating_runs(kinds: Sequence[str], max_block: int = MAX_BLOCK) -> list[Run]:
    """`kinds` as runs of repeated blocks, left to right: at each layer the block of at most `max_block` kinds whose
    repeats there cover the most layers (the shorter block on a tie); layers between repeats are one run of their
    kinds. K3's 93 attention kinds are two runs, ``(kda, kda, kda, mla) x 23`` and ``mla``."""
    runs: list[Run] = []
    i, n = 0, len(kinds)
    while i < n:
        best = Run(i, (kinds[i],), 1)
        for width in range(1, min(max_block, n - i) + 1):
            block = tuple(kinds[i:i + width])
            repeats = 1
            while tuple(kinds[i + repeats * width:i + (repeats + 1) * width]) == block:
                repeats += 1
            if (repeats > 1 or width == 1) and width * repeats > len(best.block) * best.repeats:
                best = Run(i, block, repeats)
        if best.repeats == 1 and runs and runs[-1].repeats == 1:  # no repeat here either: one run of what is between
            last = runs.pop()
            best = Run(last.start, last.block + best.block, 1)
        runs.append(best)
        i = best.stop
    return runs


@dataclass(frozen=True)
class LayerLayout:
    """What each layer is: its attention kinds as `repeating_runs`, and one FFN kind for every layer but the
    ``ffn_exceptions`` (layer -> kind), e.g. K3's dense layer 0."""

    num_layers: int
    attention: list[Run]
    ffn: str
    ffn_exceptions: dict[int, str]


def layer_layout(config: K3Config) -> LayerLayout:
    """The `LayerLayout` of `config` (``attn_types`` and ``mlp_types``)."""
    ffn = Counter(config.mlp_types).most_common(1)[0][0] if config.mlp_types else ""
    return LayerLayout(num_layers=config.num_hidden_layers, attention=repeating_runs(config.attn_types), ffn=ffn,
                       ffn_exceptions={i: t for i, t in enumerate(config.mlp_types) if t != ffn})


@dataclass
class ParameterCounts:
    total: int = 0
    active: int = 0  # read per token: routed experts count top-k of num_experts
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int, active: int | None = None) -> None:
        self.total += n
        self.active += n if active is None else active
        self.by_kind[kind] = self.by_kind.get(kind, 0) + n


def count_parameters(config: K3Config) -> ParameterCounts:
    """Total and active-per-token parameter counts, grouped by kind (embedding, kda, mla, moe_routed, ...),
    summed over the contract's parameter specs (one routed expert counted once per MoE layer, times E)."""
    c = config
    counts = ParameterCounts()
    for spec in contract.head_param_specs(c):
        counts.add(spec.kind, spec.numel)
    expert = sum(s.numel for s in contract.expert_param_specs(c, 0, 0))
    for i in range(c.num_hidden_layers):
        for spec in contract.layer_param_specs(c, i, experts=False):
            counts.add(spec.kind, spec.numel)
        if c.mlp_types[i] == "moe":
            counts.add("moe_routed", c.num_experts * expert, active=c.num_experts_per_token * expert)
    return counts


def count_vision_parameters(config: K3VisionConfig) -> dict[str, int]:
    """Parameters of the vision tower and of its projector (``vision_tower``, ``mm_projector``), from the modules
    built on the meta device (the modules are the one home of their shapes). They run once per image, never per
    text token, so they add to a model's total and not to its active count."""
    import torch

    from k3export.modeling.modeling_k3_vision import K3PatchMergerMLPV2, K3VisionTower

    with torch.device("meta"):
        parts = {"vision_tower": K3VisionTower(config), "mm_projector": K3PatchMergerMLPV2(config)}
    return {name: sum(p.numel() for p in module.parameters()) for name, module in parts.items()}


@dataclass
class StateBytes:
    per_token: int  # grows with context: MLA latent caches
    constant: int  # independent of context: KDA conv + recurrent states
    context: int
    batch: int

    @property
    def per_sequence(self) -> int:
        return self.constant + self.per_token * self.context


def decode_state_bytes(config: K3Config, context: int, batch: int = 1, dtype: str = "bf16",
                       layers: range | None = None) -> StateBytes:
    """Bytes of carried decode state of `layers` (default all) for `batch` sequences, from the contract's specs
    (a state's dtype is the activation `dtype` unless the contract fixes it, e.g. the fp32 KDA state)."""
    act = as_dtype(dtype).name
    per_token = constant = 0
    for spec in contract.state_specs(config, layers):
        size = as_dtype(spec.resolved_dtype(act)).itemsize
        if spec.grows:
            per_token += int(spec.elements(past=1) * size)
        else:
            constant += int(spec.elements() * size)
    return StateBytes(per_token=per_token * batch, constant=constant * batch, context=context, batch=batch)


# ---------------------------------------------------------------------------------------------- weight bytes by form
MXFP4_BITS = 4 + 8 / 32  # E2M1 values + one E8M0 scale per 32
NVFP4_BITS = 4 + 8 / 16  # E2M1 values + one E4M3 scale per 16 (plus two fp32 scalars a matrix)
#: the attention projections NVIDIA's NVFP4 recipe (``nvfp4_experts-fp8_pb_attention``) stores in block FP8: one
#: float8_e4m3fn per weight, one fp32 scale per 128x128 tile (Model-Optimizer's ``FP8_PB_WO``)
FP8_PB_PROJECTIONS = re.compile(r"model\.layers\.\d+\.self_attn\.(?:q_proj|k_proj|v_proj|g_proj|o_proj|b_proj|"
                                r"f_a_proj|f_b_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight")
FP8_TILE = 128
ORT_EXPERT_BITS = 8 + 32 / 32  # ONNX Runtime's lossless 8-bit form: uint8 2v + 128, one fp32 scale per 32


@dataclass
class WeightForms:
    """Weight bytes of a model (text decoder; no vision tower) in each form it takes on the way to a runtime.

    ``released_mxfp4``: the released checkpoint (routed experts MXFP4, 4.25 bits; other weights bf16, fp32 where
    the model keeps fp32). ``checkpoint_bf16``: our converted bf16 checkpoint (experts decoded). ``onnx_mxfp4`` /
    ``onnx_bf16``: the external data of ``export --dtype bf16`` with ``--experts mxfp4`` / ``dense`` (the same
    tensors, less those no output reads, `contract.unread_param_names`; 4 KiB alignment not counted).
    ``ort_mxfp4`` / ``ort_dense``: the weights ONNX Runtime's CPU provider holds running them (it computes bf16
    exports in fp32; MXFP4 experts in its 9-bit form, `k3export.converters.onnx.mxfp4`). ``nvidia_nvfp4``: NVIDIA's
    NVFP4 release (experts NVFP4, 4.5 bits plus ``weight_scale_2`` and ``input_scale`` a matrix; the
    `FP8_PB_PROJECTIONS` in block FP8; the rest as released)."""

    expert_params: int
    other_params: int
    fp32_params: int  # of other_params, those kept in fp32 in every form
    released_mxfp4: int
    checkpoint_bf16: int
    onnx_mxfp4: int
    onnx_bf16: int
    ort_mxfp4: int
    ort_dense: int
    nvidia_nvfp4: int = 0

    @property
    def params(self) -> int:
        return self.expert_params + self.other_params

    def rows(self) -> list[tuple[str, int, float]]:
        """(form, bytes, bits per parameter) in pipeline order, for tables."""
        forms = (("released checkpoint (MXFP4 experts)", self.released_mxfp4),
                 ("NVIDIA NVFP4 checkpoint (NVFP4 experts, FP8 attention)", self.nvidia_nvfp4),
                 ("bf16 checkpoint", self.checkpoint_bf16),
                 ("ONNX export, MXFP4 experts", self.onnx_mxfp4), ("ONNX export, bf16", self.onnx_bf16),
                 ("ONNX Runtime resident, MXFP4 export", self.ort_mxfp4),
                 ("ONNX Runtime resident, dense export", self.ort_dense))
        return [(label, n, 8 * n / max(self.params, 1)) for label, n in forms]


def weight_bytes_by_form(config: K3Config) -> WeightForms:
    """`WeightForms` of `config` from the contract's parameter specs (one expert per MoE layer, times E), so the
    k3 preset costs nothing to price. Checked against the graph builder's declared weights in the tests."""
    c = config
    expert = sum(s.numel for s in contract.expert_param_specs(c, 0, 0))
    unread = contract.unread_param_names(c)  # in the checkpoints, not in the exports
    experts = other = fp32 = skipped = skipped_bf16 = fp8_saved = 0
    layers = (s for i in range(c.num_hidden_layers) for s in contract.layer_param_specs(c, i, experts=False))
    for spec in (*contract.head_param_specs(c), *layers):
        other += spec.numel
        fp32 += spec.numel if spec.fp32 else 0
        if FP8_PB_PROJECTIONS.fullmatch(spec.name):  # 1 byte a weight, 4 a tile, in place of bf16's 2
            tiles = -(-spec.shape[0] // FP8_TILE) * -(-spec.shape[1] // FP8_TILE)
            fp8_saved += spec.numel - 4 * tiles
        if spec.name in unread:
            skipped += spec.numel
            skipped_bf16 += spec.numel * (4 if spec.fp32 else 2)
    experts = c.num_experts * expert * sum(t == "moe" for t in c.mlp_types)
    dense_bf16 = 2 * (other - fp32) + 4 * fp32
    mxfp4 = round(experts * MXFP4_BITS / 8)
    matrices = c.num_experts * len(contract.expert_param_specs(c, 0, 0)) * sum(t == "moe" for t in c.mlp_types)
    nvfp4 = round(experts * NVFP4_BITS / 8) + 8 * matrices
    return WeightForms(
        expert_params=experts, other_params=other, fp32_params=fp32,
        released_mxfp4=dense_bf16 + mxfp4, checkpoint_bf16=dense_bf16 + 2 * experts,
        onnx_mxfp4=dense_bf16 - skipped_bf16 + mxfp4, onnx_bf16=dense_bf16 - skipped_bf16 + 2 * experts,
        ort_mxfp4=4 * (other - skipped) + round(experts * ORT_EXPERT_BITS / 8),
        ort_dense=4 * (other - skipped + experts), nvidia_nvfp4=dense_bf16 - fp8_saved + nvfp4)


# ---------------------------------------------------------------------------------------------- bits per weight by part
#: the parts of a decoder's weights whose storage an export chooses separately: the dense projections
#: (``--quantize``), the routed experts (``--experts``) and the rest (embedding, routers, norms, biases, gates)
PARTS = ("dense projections", "routed experts", "embedding and other")
#: the export forms `bits_by_part` prices
PART_FORMS = ("fp32", "bf16", "fp32 --quantize int8", "fp32 --quantize int4")


@dataclass
class PartBits:
    part: str
    params: int
    bits: dict[str, float]  # form (`PART_FORMS`) -> bits per weight; routed experts: dense, MXFP4 in `mxfp4_bits`
    mxfp4_bits: float | None = None


def bits_by_part(config: K3Config, projections: Iterable[str], block_size: int = 32) -> list[PartBits]:
    """Bits per weight of each `PARTS` in each `PART_FORMS` (block-quantized projections: ``bits + 32 /
    block_size``, one fp32 scale a block; routed experts dense, or MXFP4 in every form). `projections`: the
    parameters ``--quantize`` stores quantized, the graph builder's answer
    (`k3export.converters.onnx.quantize.quantized_param_names`, which this module cannot import: the converters
    import it)."""
    c = config
    quantized = set(projections)
    proj = other = other_fp32 = 0
    layers = (s for i in range(c.num_hidden_layers) for s in contract.layer_param_specs(c, i, experts=False))
    for spec in (*contract.head_param_specs(c), *layers):
        if spec.name in quantized:
            proj += spec.numel
        else:
            other += spec.numel
            other_fp32 += spec.numel if spec.fp32 else 0
    experts = c.num_experts * sum(s.numel for s in contract.expert_param_specs(c, 0, 0)) * \
        sum(t == "moe" for t in c.mlp_types)
    other_bf16 = (16 * (other - other_fp32) + 32 * other_fp32) / max(other, 1)
    q8, q4 = 8 + 32 / block_size, 4 + 32 / block_size
    return [PartBits(PARTS[0], proj, dict(zip(PART_FORMS, (32.0, 16.0, q8, q4)))),
            PartBits(PARTS[1], experts, dict(zip(PART_FORMS, (32.0, 16.0, 32.0, 32.0))), mxfp4_bits=MXFP4_BITS),
            PartBits(PARTS[2], other, dict(zip(PART_FORMS, (32.0, other_bf16, 32.0, 32.0))))]


def export_bits_by_part(model_path: str | os.PathLike[str]) -> list[tuple[str, int, int]]:
    """(part, parameters, bytes) of each `PARTS` as an export's ``model.onnx`` stores it, from its initializers'
    declared shapes and types (no weight is read): quantized projections by their codes and scales, block-FP8 ones
    by their E4M3 values and scales, MXFP4 / NVFP4 experts by their values and scales; in an export without
    quantized projections, its 2-D ``*_proj`` / ``lm_head`` weights (joined ones too)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(model_path), load_external_data=False)
    params = dict.fromkeys(PARTS, 0)
    nbytes = dict.fromkeys(PARTS, 0)
    nbits = [({a.name: a.i for a in n.attribute}, n) for n in model.graph.node if n.op_type == "MatMulNBits"]
    weights_of = {n.input[1]: a["N"] * a["K"] for a, n in nbits}  # the weights a projection's codes stand for
    scales = {n.input[2] for _, n in nbits}
    for t in model.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        elem = helper.tensor_dtype_to_np_dtype(t.data_type) if t.data_type not in (23, 24) else None  # FP4, E8M0
        size = n // 2 if t.data_type == 23 else n if elem is None else n * elem.itemsize
        name = t.name
        if name in weights_of or name in scales:
            part, count = PARTS[0], weights_of.get(name, 0)
        elif name.endswith((".weight.fp8", ".weight.fp8_scale")):  # block-FP8 projections: values, row scales
            part, count = PARTS[0], (n if name.endswith(".fp8") else 0)
        elif ".experts." in name and "shared_experts" not in name:
            part, count = PARTS[1], (0 if name.endswith(("weight_scale", "weight_scale_2")) else n)
        elif not nbits and name.endswith(("_proj.weight", "lm_head.weight")) and "_res_proj" not in name \
                and len(t.dims) == 2:  # an export without quantized projections: its projections by name
            part, count = PARTS[0], n
        else:
            part, count = PARTS[2], n
        params[part] += count
        nbytes[part] += size
    return [(p, params[p], nbytes[p]) for p in PARTS if params[p] or nbytes[p]]


# ---------------------------------------------------------------------------------------------- TensorRT engines
def engine_summary(engine: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """(label, value) rows describing a TensorRT engine from its sidecar (``<engine>.json``): the TensorRT flavour
    and version it was built with, the target, the GPU it was built on, precision, profiles, the k3 plugins it embeds
    and how, the ops built from standard ops, and the layer counts. `ArtifactError` when the engine has no sidecar
    this k3export reads."""
    from k3export.artifacts import EngineSidecar
    from k3export.units import format_bytes

    path = Path(engine)
    car = EngineSidecar.read_for(path)
    flavour = {"tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT-RTX"}[car.tensorrt_flavour]
    cc = lambda c: "unknown" if c is None else f"{c[0]}.{c[1]}"  # noqa: E731
    rows = [("engine", f"{path} ({format_bytes(path.stat().st_size) if path.is_file() else 'missing'})"),
            ("built with", f"{flavour} {car.tensorrt_version}"),
            ("target", f"compute capability {cc(car.target_compute_capability or car.compute_capability)}"),
            ("built on", "no GPU" if car.compute_capability is None else f"{car.gpu} ({cc(car.compute_capability)})"),
            ("precision", f"{car.precision} ({car.dtype})")]
    if car.profiles:
        lim = car.profiles[0].limits
        rows.append(("profiles", f"{' and '.join(p.name for p in car.profiles)}: batch <= {lim.get('max_batch')}, "
                                 f"prefill <= {lim.get('max_seq')} new tokens, context <= {lim.get('max_context')}"))
    nodes = Counter(n.op for n in car.k3_nodes)
    if car.plugins is not None:
        how = {"IPluginV3": "class-based IPluginV3, PTX in the plugin fields; running needs Python and k3export",
               "tensorrt.plugin": "tensorrt.plugin AOT, PTX in the engine; runs without Python"}.get(car.plugin_api or "",
                                                                                                      "")
        rows.append(("k3 plugins", (", ".join(car.plugins) or "none") + (f" ({how})" if how and car.plugins else "")))
    rows.append(("k3 nodes", ", ".join(f"{op} x {n}" for op, n in sorted(nodes.items())) or "none"))
    if car.standard_ops:
        rows.append(("from standard ops", ", ".join(f"k3::{op}" for op in car.standard_ops)))
    if car.plugin_layers is not None:
        rows.append(("plugin layers", str(car.plugin_layers)))
    if car.network_layers is not None:
        rows.append(("network layers", str(car.network_layers)))
    if car.optimization_level is not None:
        rows.append(("optimisation level", str(car.optimization_level)))
    rows.append(("source graph", car.onnx))
    return rows
