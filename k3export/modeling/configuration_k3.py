# Copyright 2026 the k3export authors. Apache-2.0.
"""Configuration of Kimi K3 text models (and Kimi-Linear, which is K3 with its additions switched off).

Field names are the ones of the released ``moonshotai/Kimi-K3`` ``text_config`` so that the released dict
(and a flat Kimi-Linear ``config.json``) loads as is. K3 features default to *off*; a Kimi-Linear config
therefore needs no translation, and ``K3Config.k3()`` / ``K3Config.tiny()`` switch them on.

This file is copied next to saved checkpoints (``trust_remote_code``): it imports only transformers.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig


class K3ConfigError(ValueError):
    """An inconsistent K3 configuration; the message names the field."""


_LINEAR_ATTN_DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "num_heads": 32,
    "short_conv_kernel_size": 4,
    "use_full_rank_gate": False,
    "gate_lower_bound": None,
    "full_attn_layers": None,
    "kda_layers": None,
}

# Aliases used by transformers' KimiLinearConfig and DeepSeek-style configs -> our (released) names.
_ALIASES = {
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_routed_experts": "num_experts",
    "num_local_experts": "num_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
}


class K3Config(PretrainedConfig):
    r"""Configuration of a K3 (or Kimi-Linear) decoder.

    Layer lists in ``linear_attn_config`` are 1-based, as released. ``attn_res_block_size`` = 0 or None
    disables Attention Residuals (plain residual stream). ``routed_expert_hidden_size`` = None means the
    routed experts run on the full hidden size (no latent projections). ``linear_attn_config.gate_lower_bound``
    = None selects Kimi-Linear's softplus forget gate, a negative number K3's bounded sigmoid gate.
    ``ops_backend`` picks the implementation of the k3 ops: ``"torch"``, ``"triton"`` or ``"auto"``
    (triton on CUDA when available, torch otherwise).
    """

    model_type = "k3"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 2304,
        intermediate_size: int = 9216,
        num_hidden_layers: int = 27,
        num_attention_heads: int = 32,
        hidden_act: str = "silu",
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: float = 25.0,
        q_lora_rank: int | None = None,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = False,
        num_experts: int = 256,
        num_experts_per_token: int = 8,
        num_shared_experts: int = 1,
        moe_intermediate_size: int = 1024,
        routed_expert_hidden_size: int | None = None,
        latent_moe_use_norm: bool = False,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        routed_scaling_factor: float = 2.446,
        first_k_dense_replace: int = 1,
        num_expert_group: int = 1,
        topk_group: int = 1,
        attn_res_block_size: int | None = None,
        rms_norm_eps: float = 1e-5,
        linear_attn_config: dict[str, Any] | None = None,
        kda_chunk_size: int = 64,
        ops_backend: str = "auto",
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        bos_token_id: int | None = 163584,
        eos_token_id: int | list[int] | None = 163586,
        pad_token_id: int | None = 163839,
        **kwargs: Any,
    ) -> None:
        aliased = {
            "num_experts_per_token": num_experts_per_token, "num_shared_experts": num_shared_experts,
            "num_experts": num_experts, "moe_renormalize": moe_renormalize, "num_expert_group": num_expert_group,
        }
        for alias, name in _ALIASES.items():
            value = kwargs.pop(alias, None)
            if value is not None:
                aliased[name] = value
        num_experts_per_token, num_shared_experts = aliased["num_experts_per_token"], aliased["num_shared_experts"]
        num_experts, moe_renormalize = aliased["num_experts"], aliased["moe_renormalize"]
        num_expert_group = aliased["num_expert_group"]
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.hidden_act = hidden_act
        self.activation_situ_beta = float(activation_situ_beta)
        self.activation_situ_linear_beta = float(activation_situ_linear_beta)
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.moe_renormalize = moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.first_k_dense_replace = first_k_dense_replace
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.attn_res_block_size = attn_res_block_size or 0
        self.rms_norm_eps = float(rms_norm_eps)
        self.kda_chunk_size = kda_chunk_size
        self.ops_backend = ops_backend
        self.initializer_range = initializer_range
        self.use_cache = use_cache

        lac = dict(_LINEAR_ATTN_DEFAULTS)
        lac.update(copy.deepcopy(linear_attn_config) if linear_attn_config else {})
        if lac["full_attn_layers"] is None and lac["kda_layers"] is None:
            # Kimi-Linear's default pattern: every 4th layer (1-based) is MLA, the last one too.
            full = [i for i in range(1, num_hidden_layers + 1) if i % 4 == 0 or i == num_hidden_layers]
            lac["full_attn_layers"] = full
            lac["kda_layers"] = [i for i in range(1, num_hidden_layers + 1) if i not in full]
        elif lac["full_attn_layers"] is None:
            lac["full_attn_layers"] = [i for i in range(1, num_hidden_layers + 1) if i not in lac["kda_layers"]]
        elif lac["kda_layers"] is None:
            lac["kda_layers"] = [i for i in range(1, num_hidden_layers + 1) if i not in lac["full_attn_layers"]]
        lac["full_attn_layers"] = [int(i) for i in lac["full_attn_layers"]]
        lac["kda_layers"] = [int(i) for i in lac["kda_layers"]]
        self.linear_attn_config = lac

        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )
        self.validate_k3()

    # ------------------------------------------------------------------ derived views
    @property
    def attn_types(self) -> list[str]:
        """Per layer (0-based): ``"kda"`` or ``"mla"``."""
        full = set(self.linear_attn_config["full_attn_layers"])
        return ["mla" if i + 1 in full else "kda" for i in range(self.num_hidden_layers)]

    @property
    def mlp_types(self) -> list[str]:
        """Per layer (0-based): ``"dense"`` or ``"moe"``."""
        return ["dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_hidden_layers)]

    @property
    def kda_num_heads(self) -> int:
        return int(self.linear_attn_config["num_heads"])

    @property
    def kda_head_dim(self) -> int:
        return int(self.linear_attn_config["head_dim"])

    @property
    def kda_conv_kernel(self) -> int:
        return int(self.linear_attn_config["short_conv_kernel_size"])

    @property
    def use_attn_res(self) -> bool:
        return bool(self.attn_res_block_size)

    @property
    def use_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_input_size(self) -> int:
        """Width the routed experts read and write: the latent size for LatentMoE, else hidden_size."""
        return self.routed_expert_hidden_size if self.use_latent_moe else self.hidden_size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Values cached per token per MLA layer: [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ------------------------------------------------------------------ validation
    def validate_k3(self) -> None:
        """Raise `K3ConfigError` naming the first inconsistent field."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise K3ConfigError(f"K3Config: {msg}")

        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
            "moe_intermediate_size", "kda_chunk_size",
        ]
        for name in positive:
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"{name} must be a positive integer, got {value!r}")
        need(isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0,
             f"qk_rope_head_dim must be a non-negative integer, got {self.qk_rope_head_dim!r}")
        need(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0),
             f"q_lora_rank must be None or a positive integer, got {self.q_lora_rank!r}")
        need(self.hidden_act in ("silu", "situ"), f"hidden_act must be 'silu' or 'situ', got {self.hidden_act!r}")
        if self.hidden_act == "situ":
            need(self.activation_situ_beta > 0 and self.activation_situ_linear_beta > 0,
                 "activation_situ_beta and activation_situ_linear_beta must be > 0")
        need(self.mla_use_nope, "mla_use_nope=False (rotary MLA) is not supported: K3 and Kimi-Linear are NoPE")
        need(self.num_experts_per_token <= self.num_experts,
             f"num_experts_per_token ({self.num_experts_per_token}) must be <= num_experts ({self.num_experts})")
        need(isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0,
             f"num_shared_experts must be a non-negative integer, got {self.num_shared_experts!r}")
        need(self.moe_router_activation_func == "sigmoid",
             f"moe_router_activation_func must be 'sigmoid', got {self.moe_router_activation_func!r}")
        need(self.num_expert_group == 1 and self.topk_group == 1,
             f"grouped routing (num_expert_group={self.num_expert_group}, topk_group={self.topk_group}) "
             "is not supported; K3 and Kimi-Linear use 1")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
             f"first_k_dense_replace ({self.first_k_dense_replace}) must be in [0, num_hidden_layers]")
        need(self.routed_expert_hidden_size is None
             or (isinstance(self.routed_expert_hidden_size, int) and self.routed_expert_hidden_size > 0),
             f"routed_expert_hidden_size must be None or a positive integer, got {self.routed_expert_hidden_size!r}")
        need(not self.latent_moe_use_norm or self.use_latent_moe,
             "latent_moe_use_norm=True needs routed_expert_hidden_size (the latent width)")
        need(isinstance(self.attn_res_block_size, int) and self.attn_res_block_size >= 0,
             f"attn_res_block_size must be a non-negative integer or None, got {self.attn_res_block_size!r}")
        need(self.ops_backend in ("auto", "torch", "triton"),
             f"ops_backend must be 'auto', 'torch' or 'triton', got {self.ops_backend!r}")

        lac = self.linear_attn_config
        unknown = set(lac) - set(_LINEAR_ATTN_DEFAULTS)
        need(not unknown, f"linear_attn_config has unknown keys {sorted(unknown)}")
        for name in ("head_dim", "num_heads", "short_conv_kernel_size"):
            need(isinstance(lac[name], int) and lac[name] > 0,
                 f"linear_attn_config.{name} must be a positive integer, got {lac[name]!r}")
        bound = lac["gate_lower_bound"]
        need(bound is None or (isinstance(bound, (int, float)) and bound < 0),
             f"linear_attn_config.gate_lower_bound must be None or negative, got {bound!r}")
        full, kda = lac["full_attn_layers"], lac["kda_layers"]
        n = self.num_hidden_layers
        for name, layers in (("full_attn_layers", full), ("kda_layers", kda)):
            out_of_range = [i for i in layers if not 1 <= i <= n]
            need(not out_of_range,
                 f"linear_attn_config.{name} has layers {out_of_range} outside 1..{n} (the lists are 1-based)")
            need(len(set(layers)) == len(layers), f"linear_attn_config.{name} repeats a layer")
        both = sorted(set(full) & set(kda))
        need(not both, f"layers {both} are in both full_attn_layers and kda_layers")
        missing = sorted(set(range(1, n + 1)) - set(full) - set(kda))
        need(not missing, f"layers {missing} are in neither full_attn_layers nor kda_layers "
                          f"(the two lists must partition 1..{n})")

    # ------------------------------------------------------------------ presets and adapters
    @classmethod
    def k3(cls, **overrides: Any) -> K3Config:
        """The released Kimi K3 text model (93 layers, 896 experts, 2.78T parameters)."""
        full = list(range(4, 93, 4)) + [93]
        kwargs: dict[str, Any] = dict(
            vocab_size=163840, hidden_size=7168, intermediate_size=33792, num_hidden_layers=93,
            num_attention_heads=96, hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            mla_use_nope=True, mla_use_output_gate=True, num_experts=896, num_experts_per_token=16,
            num_shared_experts=2, moe_intermediate_size=3072, routed_expert_hidden_size=3584,
            latent_moe_use_norm=True, moe_renormalize=True, moe_router_activation_func="sigmoid",
            routed_scaling_factor=1.0, first_k_dense_replace=1, attn_res_block_size=12, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
            linear_attn_config=dict(
                head_dim=128, num_heads=96, short_conv_kernel_size=4, use_full_rank_gate=True,
                gate_lower_bound=-5.0, full_attn_layers=full,
                kda_layers=[i for i in range(1, 94) if i not in full],
            ),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def tiny(cls, **overrides: Any) -> K3Config:
        """A few-MB K3 with the released structure and every K3 feature on (for tests and demos).

        6 layers: dense FFN on layer 0, MLA on layers 3 and 6 (1-based), Attention-Residual blocks of 2
        layers so that the block bank is exercised.
        """
        kwargs: dict[str, Any] = dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            mla_use_nope=True, mla_use_output_gate=True, num_experts=8, num_experts_per_token=2,
            num_shared_experts=2, moe_intermediate_size=32, routed_expert_hidden_size=48,
            latent_moe_use_norm=True, moe_renormalize=True, routed_scaling_factor=1.0,
            first_k_dense_replace=1, attn_res_block_size=2, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            kda_chunk_size=16,
            linear_attn_config=dict(
                head_dim=16, num_heads=4, short_conv_kernel_size=4, use_full_rank_gate=True,
                gate_lower_bound=-5.0, full_attn_layers=[3, 6], kda_layers=[1, 2, 4, 5],
            ),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def tiny_kimi_linear(cls, **overrides: Any) -> K3Config:
        """A tiny Kimi-Linear (every K3 addition off), matching transformers' KimiLinearForCausalLM."""
        kwargs: dict[str, Any] = dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, hidden_act="silu", q_lora_rank=None, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2,
            num_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.446,
            first_k_dense_replace=1, bos_token_id=1, eos_token_id=2, pad_token_id=0, kda_chunk_size=16,
            linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4,
                                    full_attn_layers=[2, 4], kda_layers=[1, 3]),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_released_dict(cls, config: dict[str, Any], **overrides: Any) -> K3Config:
        """Build from a ``config.json`` dict: a released K3 one (text model under ``text_config``),
        a flat Kimi-Linear one, or one of ours."""
        if not isinstance(config, dict):
            raise K3ConfigError(f"config must be a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if "text_config" in config:
            text = dict(config["text_config"])
            if model_type not in ("kimi_k3", "k3", None):
                raise K3ConfigError(f"config.json has model_type {model_type!r}; expected 'kimi_k3' with a text_config")
        else:
            text = dict(config)
            if model_type not in ("k3", "kimi_linear", "kimi_k3"):
                raise K3ConfigError(
                    f"config.json has model_type {model_type!r}; k3export reads 'k3', 'kimi_k3' (released K3) "
                    "or 'kimi_linear'")
        for key in ("model_type", "architectures", "auto_map", "quantization_config", "transformers_version",
                    "torch_dtype", "dtype", "vision_config"):
            text.pop(key, None)
        text.update(overrides)
        return cls(**text)
