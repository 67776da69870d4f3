"""Declarative tensor-name maps: one table per checkpoint layout, and the tensors a config expects.

A layout is an ordered list of rules; the first rule whose pattern matches a stored tensor name decides
its kind and its name in *our* layout (the parameter names of `K3ForCausalLM`):

* ``dense``        - a plain tensor, copied (and cast to the output dtype);
* ``mxfp4_packed`` - ``<module>.weight_packed`` of a routed expert, decoded together with its scales into
                     ``<module>.weight``;
* ``mxfp4_scale``  - ``<module>.weight_scale``, consumed by its packed partner;
* ``skip``         - not part of the text model (``vision_tower.*``, ``mm_projector.*``), counted per group;
* ``weight_scale`` / ``weight_scale_2`` / ``input_scale`` - in the NVFP4 layout, a scale of ``<module>.weight``:
                     the scan pairs them (an NVFP4 expert, or an FP8 block weight; `k3export.converters.checkpoints.
                     nvfp4`), the weight keeping kind ``dense`` until then.

Layouts: ``kimi_k3`` (released ``moonshotai/Kimi-K3``: everything under ``language_model.``, MXFP4 routed
experts, vision tensors), ``kimi_k3_nvfp4`` (``nvidia/Kimi-K3-NVFP4``: the released names, NVFP4 routed
experts, FP8 block attention weights; chosen by the config's Model-Optimizer quantization, `quantization_format`),
``kimi_linear`` (the Hub's Kimi-Linear checkpoints and the folders transformers'
``KimiLinearForCausalLM.save_pretrained`` writes: our names, dense experts; transformers stores a dense layer's
MLP under ``block_sparse_moe``) and ``k3`` (ours: our names; experts dense or, after ``--keep-mxfp4``, still
packed). The tensors a config expects are the contract's (`k3export.modeling.contract.param_specs`).

A few tensors are stored in more than one layout across K3-family checkpoints. They are read by the shape found on
disk, never guessed from config flags (`accepted_shapes`, `fit_stored`); a shape that fits no known layout is
refused naming the tensor and the shapes accepted. ``A_log``: K3 stores [max(H, head_dim)] (the first H used),
Kimi-Linear [1, 1, H, 1].

A text-only load skips the vision tensors here (counted per group). `K3ForConditionalGeneration.from_pretrained`
reads them itself, checked by name and shape (`k3export.modeling.modeling_k3_vision.load_vision_weights`); an image
+ text conversion (`k3export.converters.checkpoints.plan.make_plan`) carries them under their stored names and
writes the text tensors back under `TEXT_PREFIX`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from k3export.errors import CheckpointError
from k3export.modeling.contract import param_specs

DENSE, PACKED, SCALE, SKIP = "dense", "mxfp4_packed", "mxfp4_scale", "skip"
QSCALE, QSCALE_2, INPUT_SCALE = "weight_scale", "weight_scale_2", "input_scale"
#: kinds of a scanned tensor (`plan.SourceTensor.kind`) decoded from Model-Optimizer's formats
NVFP4, FP8_BLOCK = "nvfp4", "fp8_block"
#: ``hf_quant_config.json``: Model-Optimizer's description of a quantized checkpoint, beside config.json
HF_QUANT_CONFIG = "hf_quant_config.json"
#: where the released image + text layout keeps the text model (`K3ForConditionalGeneration.language_model`)
TEXT_PREFIX = "language_model."

_EXPERT = r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]"


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str
    target: str = r"\g<name>"  # our name, as a re.sub template over the match
    group: str = ""  # for skip rules: the name counted in plans and manifests

    def compiled(self) -> re.Pattern[str]:
        return _compile(self.pattern)


_CACHE: dict[str, re.Pattern[str]] = {}


def _compile(pattern: str) -> re.Pattern[str]:
    rx = _CACHE.get(pattern)
    if rx is None:
        rx = _CACHE[pattern] = re.compile(pattern)
    return rx


@dataclass(frozen=True)
class Layout:
    name: str
    rules: tuple[Rule, ...]
    description: str = ""

    def classify(self, stored: str) -> tuple[str, str, str]:
        """(kind, our name, skip group) of a stored tensor name; raises for a name no rule knows."""
        for rule in self.rules:
            m = rule.compiled().fullmatch(stored)
            if m is not None:
                return rule.kind, (m.expand(rule.target) if rule.kind != SKIP else ""), rule.group
        raise CheckpointError(f"tensor {stored!r} does not belong to the {self.name} layout ({self.description})")


_VISION = (
    Rule(r"vision_tower\..*", SKIP, group="vision_tower"),
    Rule(r"mm_projector\..*", SKIP, group="mm_projector"),
    Rule(r"multi_modal_projector\..*", SKIP, group="mm_projector"),
)


def _text_rules(prefix: str) -> tuple[Rule, ...]:
    p = re.escape(prefix)
    return (
        Rule(rf"{p}(?P<name>{_EXPERT})\.weight_packed", PACKED, r"\g<name>.weight"),
        Rule(rf"{p}(?P<name>{_EXPERT})\.weight_scale", SCALE, r"\g<name>.weight"),
        Rule(rf"{p}(?P<name>(?:model|lm_head)\..+)", DENSE),
    )


def _modelopt_rules(prefix: str) -> tuple[Rule, ...]:
    p = re.escape(prefix)
    text = r"(?:model|lm_head)\..+"
    return (
        Rule(rf"{p}(?P<name>{text})\.weight_scale_2", QSCALE_2, r"\g<name>.weight"),
        Rule(rf"{p}(?P<name>{text})\.weight_scale", QSCALE, r"\g<name>.weight"),
        Rule(rf"{p}(?P<name>{text})\.input_scale", INPUT_SCALE, r"\g<name>.weight"),
        Rule(rf"{p}(?P<name>{text})", DENSE),
    )


# transformers' KimiLinearForCausalLM.save_pretrained renames every '.mlp.' to '.block_sparse_moe.' on the way out
# (its conversion mapping, reversed), so a dense layer's MLP is stored under block_sparse_moe there.
_TRANSFORMERS_DENSE_MLP = Rule(
    r"model\.layers\.(?P<layer>\d+)\.block_sparse_moe\.(?P<proj>gate_proj|up_proj|down_proj)\.weight", DENSE,
    r"model.layers.\g<layer>.mlp.\g<proj>.weight")

#: one layout per model type k3export reads (`k3export.modeling.configuration_k3.MODEL_TYPES`), by that name
LAYOUTS: dict[str, Layout] = {
    "kimi_k3": Layout("kimi_k3", _VISION + _text_rules(TEXT_PREFIX),
                      "released Kimi K3: text tensors under 'language_model.', MXFP4 routed experts"),
    "kimi_linear": Layout("kimi_linear", _VISION + (_TRANSFORMERS_DENSE_MLP,) + _text_rules(""),
                          "Kimi-Linear (the Hub's, or transformers' save_pretrained): 'model.*' and 'lm_head.*' "
                          "tensors"),
    "k3": Layout("k3", _text_rules(""), "k3export: 'model.*' and 'lm_head.*' tensors"),
}
#: the layouts of checkpoints Model-Optimizer quantized (`quantization_format` "nvfp4"), by model type
NVFP4_LAYOUTS: dict[str, Layout] = {
    "kimi_k3": Layout("kimi_k3_nvfp4", _VISION + _modelopt_rules(TEXT_PREFIX),
                      "NVIDIA's Kimi-K3-NVFP4: text tensors under 'language_model.', NVFP4 routed experts, FP8 block "
                      "weights"),
}


def layout_for(config_json: dict[str, Any], quant: str | None = None) -> Layout:
    """The layout of a checkpoint, from its ``config.json`` as `k3export.files.check_config_json` accepts it: its
    ``model_type`` is one of ``MODEL_TYPES``, which are the names of `LAYOUTS`; `quant` its `quantization_format`
    (``"nvfp4"``: `NVFP4_LAYOUTS`)."""
    model_type = config_json["model_type"]
    if quant == "nvfp4":
        if model_type not in NVFP4_LAYOUTS:
            raise CheckpointError(f"config.json: Model-Optimizer NVFP4 checkpoints are read in the released K3 "
                                  f"layout (model_type {', '.join(NVFP4_LAYOUTS)}), not {model_type!r}")
        return NVFP4_LAYOUTS[model_type]
    return LAYOUTS[model_type]


def quantization_config(config_json: dict[str, Any]) -> Any:
    """The ``quantization_config`` of a config.json (top level, else the text config's), or None."""
    q = config_json.get("quantization_config")
    if q is None and isinstance(config_json.get("text_config"), dict):
        q = config_json["text_config"].get("quantization_config")
    return q


#: Model-Optimizer's per-module formats k3export reads (``quant_algo``), and NVFP4's group size
MODELOPT_ALGOS = ("NVFP4", "FP8_PB_WO")


def _is_modelopt(q: Any) -> bool:
    return isinstance(q, dict) and str(q.get("quant_method", "")).startswith("modelopt")


def check_modelopt(q: Any, where: str = "config.json: quantization_config") -> None:
    """Validate Model-Optimizer's quantization description (config.json's ``quantization_config``, flat or with
    ``hf_quant_config.json``'s ``quantization`` object inside; or that file's content): ``quant_algo``
    ``MIXED_PRECISION`` with ``quantized_layers`` each ``NVFP4`` (group 16) or ``FP8_PB_WO``, or ``NVFP4`` alone."""
    if not isinstance(q, dict):
        raise CheckpointError(f"{where} must be an object")
    body = q.get("quantization", q)
    if not isinstance(body, dict):
        raise CheckpointError(f"{where}.quantization must be an object")
    algo = body.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = body.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise CheckpointError(f"{where}: quant_algo MIXED_PRECISION needs quantized_layers (an object)")
        entries = list(layers.items())
    elif algo == "NVFP4":
        entries = [("*", body)]
    else:
        raise CheckpointError(f"{where}: unknown quant_algo {algo!r}; k3export reads Model-Optimizer's "
                              "MIXED_PRECISION (NVFP4 experts, FP8_PB_WO attention) and NVFP4")
    for module, entry in entries:
        sub = entry.get("quant_algo") if isinstance(entry, dict) else None
        if sub not in MODELOPT_ALGOS:
            raise CheckpointError(f"{where}: module {module!r} has quant_algo {sub!r}; k3export reads "
                                  f"{' and '.join(MODELOPT_ALGOS)}")
        group = entry.get("group_size")
        if sub == "NVFP4" and group is not None and group != 16:
            raise CheckpointError(f"{where}: module {module!r} has NVFP4 group_size {group!r}; NVFP4 uses 16")


def quantization_format(config_json: dict[str, Any], folder: Any = None) -> str | None:
    """``"mxfp4"`` (compressed-tensors, the released K3), ``"nvfp4"`` (Model-Optimizer: its ``quant_method`` in
    config.json, or a ``hf_quant_config.json`` in `folder`) or None (unquantized), each validated
    (`check_quantization`, `check_modelopt`)."""
    q = quantization_config(config_json)
    if q is None and folder is not None:
        from pathlib import Path

        from k3export.files import read_json
        from k3export.safety import confined_file

        path = Path(folder) / HF_QUANT_CONFIG
        if path.is_file():
            confined_file(Path(folder), HF_QUANT_CONFIG, "quantization config", error=CheckpointError,
                          label="model folder")
            q = read_json(path, CheckpointError, f"{folder}/{HF_QUANT_CONFIG}")
            check_modelopt(q, f"{folder}/{HF_QUANT_CONFIG}")
            return "nvfp4"
    if _is_modelopt(q):
        check_modelopt(q)
        return "nvfp4"
    return "mxfp4" if check_quantization(config_json) is not None else None


def check_quantization(config_json: dict[str, Any]) -> int | None:
    """Validate ``quantization_config``; return the MXFP4 group size, or None for an unquantized checkpoint or one
    Model-Optimizer quantized (`quantization_format` tells them apart)."""
    q = quantization_config(config_json)
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError("config.json: quantization_config must be an object")
    if _is_modelopt(q):
        check_modelopt(q)
        return None
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise CheckpointError(f"config.json: unknown quant_method {method!r} in quantization_config; "
                              "k3export reads 'compressed-tensors' (format 'mxfp4-pack-quantized') and "
                              "Model-Optimizer's ('modelopt': NVFP4 experts, FP8 block weights)")
    formats = set()
    if q.get("format") is not None:
        formats.add(q["format"])
    group_sizes = set()
    for gname, group in (q.get("config_groups") or {}).items():
        if not isinstance(group, dict):
            raise CheckpointError(f"config.json: quantization_config.config_groups.{gname} must be an object")
        if group.get("format") is not None:
            formats.add(group["format"])
        weights = group.get("weights") or {}
        if weights.get("group_size") is not None:
            group_sizes.add(weights["group_size"])
        if weights.get("num_bits", 4) != 4 or weights.get("type", "float") != "float":
            raise CheckpointError(f"config.json: quantization_config.config_groups.{gname} quantizes to "
                                  f"{weights.get('num_bits')}-bit {weights.get('type')}; only MXFP4 is supported")
    if q.get("group_size") is not None:
        group_sizes.add(q["group_size"])
    bad = sorted(str(f) for f in formats if f != "mxfp4-pack-quantized")
    if bad or not formats:
        raise CheckpointError(f"config.json: unknown quantization format {bad or None} in quantization_config; "
                              "k3export reads 'mxfp4-pack-quantized'")
    if group_sizes - {32}:
        raise CheckpointError(f"config.json: quantization group_size {sorted(group_sizes)}; MXFP4 uses 32")
    return 32


def expected_tensors(config: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter of `K3ForCausalLM(config)` and its shape, in our names (routed experts dense): the contract's
    parameter specs (`k3export.modeling.contract.param_specs`)."""
    return {spec.name: spec.shape for spec in param_specs(config)}


def accepted_shapes(name: str, expected: tuple[int, ...], config: Any) -> tuple[tuple[int, ...], ...]:
    """The stored shapes tensor `name` (ours) may have: `expected` first, then the other layouts of the same values
    (``A_log``: K3's padded [max(H, head_dim)] and Kimi-Linear's [1, 1, H, 1])."""
    expected = tuple(expected)
    if name.endswith("A_log"):
        heads, head_dim = config.kda_num_heads, config.kda_head_dim
        return tuple(dict.fromkeys([expected, (max(heads, head_dim),), (1, 1, heads, 1)]))
    return (expected,)


def check_stored_shape(name: str, stored_name: str, shape: tuple[int, ...], expected: tuple[int, ...], config: Any,
                       where: str, packed: tuple[int, ...] | None = None) -> None:
    """The one shape check of a stored tensor (every reader of a checkpoint comes here): one `CheckpointError`
    line when `shape` (stored; an MXFP4 pair's dense shape, `packed` its bytes' shape) fits no layout of the
    tensor (`accepted_shapes`), naming it and every shape accepted."""
    accepted = accepted_shapes(name, expected, config)
    if tuple(shape) not in accepted:
        need = f"config.json needs {list(accepted[0])}" + (
            f" (or, in another checkpoint layout, {' or '.join(str(list(s)) for s in accepted[1:])})"
            if len(accepted) > 1 else "")
        what = f"packed {list(packed)} = " if packed is not None else ""
        raise CheckpointError(f"{where}: tensor {stored_name!r} has wrong shape {what}{list(shape)}; {need}")


def fit_stored(name: str, value: Any, expected: tuple[int, ...]) -> Any:
    """`value`, stored in a shape `check_stored_shape` accepted, in the `expected` (our) layout. ``A_log``: both
    layouts hold the H per-head values first; K3's unused padding is written as zeros."""
    expected = tuple(expected)
    if tuple(value.shape) == expected:
        return value
    if not name.endswith("A_log"):
        raise CheckpointError(f"tensor {name!r}: no layout reads stored shape {list(value.shape)} as "
                              f"{list(expected)}")
    heads = expected[2] if len(expected) == 4 else value.numel()
    per_head = value.reshape(-1)[:heads]
    if len(expected) == 4:
        return per_head.reshape(expected).contiguous()
    out = per_head.new_zeros(expected)
    out[:heads] = per_head
    return out


def is_expert(name: str) -> bool:
    return _compile(rf"{_EXPERT}\.weight").fullmatch(name) is not None


