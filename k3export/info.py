"""Analytic model statistics from a config alone: parameter counts and decode-state sizes.

Nothing is instantiated, so this works for the full 2.8T-parameter release; tests check the counts
against ``sum(p.numel())`` of a real tiny model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3export.modeling.configuration_k3 import K3Config

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass
class ParameterCounts:
    total: int = 0
    active: int = 0  # read per token: routed experts count top-k of num_experts
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int, active: int | None = None) -> None:
        self.total += n
        self.active += n if active is None else active
        self.by_kind[kind] = self.by_kind.get(kind, 0) + n


def _glu_mlp(d: int, i: int) -> int:
    return 3 * d * i


def count_parameters(config: K3Config) -> ParameterCounts:
    """Total and active-per-token parameter counts, grouped by kind (embedding, kda, mla, moe_routed, ...)."""
    c = config
    d = c.hidden_size
    counts = ParameterCounts()
    counts.add("embedding", c.vocab_size * d)
    counts.add("lm_head", 0 if c.tie_word_embeddings else c.vocab_size * d)
    counts.add("norm", d)
    if c.use_attn_res:
        counts.add("attn_res", 2 * d)
    H, K, ker = c.kda_num_heads, c.kda_head_dim, c.kda_conv_kernel
    hk = H * K
    lac = c.linear_attn_config
    kda = 3 * d * hk + 3 * hk * ker + d * K + K * hk + hk + d * H + K + hk * d
    kda += max(H, K) if lac["gate_lower_bound"] is not None else H
    kda += d * hk if lac["use_full_rank_gate"] else d * K + K * hk
    Hm, qk = c.num_attention_heads, c.qk_head_dim
    mla = d * Hm * qk if c.q_lora_rank is None else d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * Hm * qk
    mla += d * c.mla_latent_dim + c.kv_lora_rank + c.kv_lora_rank * Hm * (c.qk_nope_head_dim + c.v_head_dim)
    mla += Hm * c.v_head_dim * d + (d * Hm * c.v_head_dim if c.mla_use_output_gate else 0)
    expert = _glu_mlp(c.expert_input_size, c.moe_intermediate_size)
    for i in range(c.num_hidden_layers):
        counts.add("layer_norms", 2 * d + (4 * d if c.use_attn_res else 0))
        if c.attn_types[i] == "kda":
            counts.add("kda", kda)
        else:
            counts.add("mla", mla)
        if c.mlp_types[i] == "dense":
            counts.add("dense_mlp", _glu_mlp(d, c.intermediate_size))
            continue
        counts.add("router", c.num_experts * d + c.num_experts)
        counts.add("moe_routed", c.num_experts * expert, active=c.num_experts_per_token * expert)
        if c.use_latent_moe:
            counts.add("moe_latent", 2 * d * c.routed_expert_hidden_size
                       + (c.routed_expert_hidden_size if c.latent_moe_use_norm else 0))
        if c.num_shared_experts:
            counts.add("moe_shared", _glu_mlp(d, c.moe_intermediate_size * c.num_shared_experts))
    return counts


@dataclass
class StateBytes:
    per_token: int  # grows with context: MLA latent caches
    constant: int  # independent of context: KDA conv + recurrent states
    context: int
    batch: int

    @property
    def per_sequence(self) -> int:
        return self.constant + self.per_token * self.context


def decode_state_bytes(config: K3Config, context: int, batch: int = 1, dtype: str = "bf16") -> StateBytes:
    """Bytes of carried decode state (per batch element x `batch`): KDA recurrent state is fp32,
    conv states and MLA latents use the activation dtype."""
    c, b = config, DTYPE_BYTES[dtype]
    n_kda = c.attn_types.count("kda")
    n_mla = c.attn_types.count("mla")
    hk = c.kda_num_heads * c.kda_head_dim
    constant = n_kda * (3 * hk * (c.kda_conv_kernel - 1) * b + c.kda_num_heads * c.kda_head_dim * c.kda_head_dim * 4)
    per_token = n_mla * c.mla_latent_dim * b
    return StateBytes(per_token=per_token * batch, constant=constant * batch, context=context, batch=batch)
