"""Declarative tensor-name maps: one table per checkpoint layout, and the tensors a config expects.

A layout is an ordered list of rules; the first rule whose pattern matches a stored tensor name decides
its kind and its name in *our* layout (the parameter names of `K3ForCausalLM`):

* ``dense``        - a plain tensor, copied (and cast to the output dtype);
* ``mxfp4_packed`` - ``<module>.weight_packed`` of a routed expert, decoded together with its scales into
                     ``<module>.weight``;
* ``mxfp4_scale``  - ``<module>.weight_scale``, consumed by its packed partner;
* ``skip``         - not part of the text model (``vision_tower.*``, ``mm_projector.*``), counted per group.

Layouts: ``kimi_k3`` (released ``moonshotai/Kimi-K3``: everything under ``language_model.``, MXFP4 routed
experts, vision tensors), ``kimi_linear`` (original Kimi-Linear checkpoints: our names, dense experts) and
``k3`` (ours: our names; experts dense or, after ``--keep-mxfp4``, still packed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from k3export.errors import CheckpointError

DENSE, PACKED, SCALE, SKIP = "dense", "mxfp4_packed", "mxfp4_scale", "skip"

# Parameters our model keeps in float32 whatever the output dtype (mirrors K3PreTrainedModel).
FP32_PARAMETERS = ("e_score_correction_bias", "dt_bias", "A_log", "q_conv1d", "k_conv1d", "v_conv1d")

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


LAYOUTS: dict[str, Layout] = {
    "kimi_k3": Layout("kimi_k3", _VISION + _text_rules("language_model."),
                      "released Kimi K3: text tensors under 'language_model.', MXFP4 routed experts"),
    "kimi_linear": Layout("kimi_linear", _VISION + _text_rules(""),
                          "Kimi-Linear: 'model.*' and 'lm_head.*' tensors"),
    "k3": Layout("k3", _text_rules(""), "k3export: 'model.*' and 'lm_head.*' tensors"),
}


def layout_for(config_json: dict[str, Any]) -> Layout:
    """The layout of a checkpoint, from its ``config.json``."""
    model_type = config_json.get("model_type")
    if model_type not in LAYOUTS:
        raise CheckpointError(f"config.json has model_type {model_type!r}; k3export reads "
                              f"{', '.join(repr(k) for k in LAYOUTS)}")
    return LAYOUTS[model_type]


def check_quantization(config_json: dict[str, Any]) -> int | None:
    """Validate ``quantization_config``; return the MXFP4 group size, or None for an unquantized checkpoint."""
    q = config_json.get("quantization_config")
    if q is None and isinstance(config_json.get("text_config"), dict):
        q = config_json["text_config"].get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError("config.json: quantization_config must be an object")
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise CheckpointError(f"config.json: unknown quant_method {method!r} in quantization_config; "
                              "k3export reads 'compressed-tensors' (format 'mxfp4-pack-quantized')")
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
    """Every parameter of `K3ForCausalLM(config)` and its shape, in our names (routed experts dense)."""
    c = config
    d, V = c.hidden_size, c.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, d)}
    H, K = c.kda_num_heads, c.kda_head_dim
    hk = H * K
    lac = c.linear_attn_config
    for i, (attn, mlp) in enumerate(zip(c.attn_types, c.mlp_types)):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        if c.use_attn_res:
            for which in ("self_attention", "mlp"):
                out[p + f"{which}_res_proj.weight"] = (1, d)
                out[p + f"{which}_res_norm.weight"] = (d,)
        a = p + "self_attn."
        if attn == "kda":
            for n in "qkv":
                out[a + f"{n}_proj.weight"] = (hk, d)
                out[a + f"{n}_conv1d.weight"] = (hk, 1, c.kda_conv_kernel)
            out[a + "f_a_proj.weight"] = (K, d)
            out[a + "f_b_proj.weight"] = (hk, K)
            out[a + "dt_bias"] = (hk,)
            out[a + "A_log"] = (max(H, K),) if lac["gate_lower_bound"] is not None else (1, 1, H, 1)
            out[a + "b_proj.weight"] = (H, d)
            if lac["use_full_rank_gate"]:
                out[a + "g_proj.weight"] = (hk, d)
            else:
                out[a + "g_a_proj.weight"] = (K, d)
                out[a + "g_b_proj.weight"] = (hk, K)
            out[a + "o_norm.weight"] = (K,)
            out[a + "o_proj.weight"] = (d, hk)
        else:
            Hm, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
            if c.q_lora_rank is None:
                out[a + "q_proj.weight"] = (Hm * qk, d)
            else:
                out[a + "q_a_proj.weight"] = (c.q_lora_rank, d)
                out[a + "q_a_layernorm.weight"] = (c.q_lora_rank,)
                out[a + "q_b_proj.weight"] = (Hm * qk, c.q_lora_rank)
            out[a + "kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, d)
            out[a + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
            out[a + "kv_b_proj.weight"] = (Hm * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            if c.mla_use_output_gate:
                out[a + "g_proj.weight"] = (Hm * c.v_head_dim, d)
            out[a + "o_proj.weight"] = (d, Hm * c.v_head_dim)
        if mlp == "dense":
            m = p + "mlp."
            out[m + "gate_proj.weight"] = (c.intermediate_size, d)
            out[m + "up_proj.weight"] = (c.intermediate_size, d)
            out[m + "down_proj.weight"] = (d, c.intermediate_size)
        else:
            m = p + "block_sparse_moe."
            out[m + "gate.weight"] = (c.num_experts, d)
            out[m + "gate.e_score_correction_bias"] = (c.num_experts,)
            if c.use_latent_moe:
                r = c.routed_expert_hidden_size
                out[m + "routed_expert_down_proj.weight"] = (r, d)
                if c.latent_moe_use_norm:
                    out[m + "routed_expert_norm.weight"] = (r,)
                out[m + "routed_expert_up_proj.weight"] = (d, r)
            if c.num_shared_experts:
                s = c.moe_intermediate_size * c.num_shared_experts
                out[m + "shared_experts.gate_proj.weight"] = (s, d)
                out[m + "shared_experts.up_proj.weight"] = (s, d)
                out[m + "shared_experts.down_proj.weight"] = (d, s)
            e_in, e_mid = c.expert_input_size, c.moe_intermediate_size
            for e in range(c.num_experts):
                x = m + f"experts.{e}."
                out[x + "w1.weight"] = (e_mid, e_in)
                out[x + "w2.weight"] = (e_in, e_mid)
                out[x + "w3.weight"] = (e_mid, e_in)
    out["model.norm.weight"] = (d,)
    if c.use_attn_res:
        out["model.output_attn_res_proj.weight"] = (1, d)
        out["model.output_attn_res_norm.weight"] = (d,)
    out["lm_head.weight"] = (V, d)
    return out


def is_expert(name: str) -> bool:
    return _compile(rf"{_EXPERT}\.weight").fullmatch(name) is not None


def keeps_fp32(name: str) -> bool:
    """Whether our model keeps this parameter in float32 regardless of the requested dtype."""
    parts = name.split(".")
    return any(p in parts for p in FP32_PARAMETERS)
