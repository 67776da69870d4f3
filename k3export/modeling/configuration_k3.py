# Copyright 2026 the k3export authors. Apache-2.0.
"""Configuration of Kimi K3 text models (and Kimi-Linear, which is K3 with its additions switched off).

Field names are the ones of the released ``moonshotai/Kimi-K3`` ``text_config``. K3 features default to *off*,
so a Kimi-Linear config needs no translation; ``K3Config.k3()`` / ``K3Config.tiny()`` switch them on.

`K3Config.from_released_dict` reads every ``config.json`` layout users have:

* ours (``model_type`` ``k3``), as `save_pretrained` writes it;
* the released K3 (``kimi_k3``): the text model nested under ``text_config``;
* the Hub's remote-code Kimi-Linear (``moonshotai/Kimi-Linear-48B-A3B-Instruct``, ``kimi_linear``): flat, with
  ``linear_attn_config`` and keys its code never reads (``rope_theta``, a legacy ``head_dim``, ...);
* transformers' own ``KimiLinearConfig.save_pretrained`` (``kimi_linear``): ``linear_attn_config`` spread over
  ``linear_*`` keys and ``layer_types``, ``first_k_dense_replace`` as ``mlp_layer_types``, plus derived keys
  (``qk_head_dim``, ``head_dim`` = ``qk_rope_head_dim``).

The differences are data (the tables below), as in transformers' ``attribute_map`` and conversion mappings.
Redundant keys are folded into the primary fields and checked against them: a mismatch is a `K3ConfigError`
naming both. In a released or Kimi-Linear config every field that sets a shape or a numeric constant must be
present (those layouts' own defaults disagree with each other); presets and ``K3Config(...)`` keep defaults.
Every field is type-, finiteness- and range-checked before anything is sized from it.

This file is copied next to saved checkpoints (``trust_remote_code``): it imports only transformers and stdlib.

Long file: the text config, its validation and its adapters for three released layouts (K3, Kimi-Linear, the
kimi_k3 top level), plus the vision config: one home for every field a checkpoint's config.json can hold, and
copied next to checkpoints as one file for ``trust_remote_code``.
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Callable

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

# ---------------------------------------------------------------------------------- layouts, as data
#: other spellings of our fields (transformers' KimiLinearConfig.attribute_map, DeepSeek-style configs)
_RENAMES = {
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_routed_experts": "num_experts",
    "num_local_experts": "num_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
}
#: transformers' flat spelling of ``linear_attn_config`` entries
_LINEAR_RENAMES = {
    "linear_head_dim": "head_dim",
    "linear_num_heads": "num_heads",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
}
#: the config.json model types k3export reads: ours, the released K3 (nested text_config) and Kimi-Linear
MODEL_TYPES = ("k3", "kimi_k3", "kimi_linear")
#: transformers' ``layer_types`` values -> ours
_LAYER_TYPES = {"full_attention": "mla", "linear_attention": "kda"}
#: transformers' ``mlp_layer_types`` values -> ours
_MLP_LAYER_TYPES = {"dense": "dense", "sparse": "moe"}
#: keys that say something about a model K3 is not (rotary, grouped-query, dropout, training, a retired option):
#: they change nothing a NoPE, bias-free K3 / Kimi-Linear computes, and are dropped
_IGNORED = (
    "ops_backend", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "model_max_length",
    "num_key_value_heads", "attention_dropout", "pretraining_tp", "output_router_logits", "use_grouped_topk",
)
#: keys that other layouts may carry but where k3export implements one value only
_FIXED = {"attention_bias": False, "moe_layer_freq": 1, "num_nextn_predict_layers": 0}
#: keys that are functions of our fields (transformers' KimiLinearConfig writes both): checked, then dropped
_DERIVED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "qk_head_dim": ("qk_nope_head_dim + qk_rope_head_dim", lambda c: c.qk_nope_head_dim + c.qk_rope_head_dim),
    "head_dim": ("qk_rope_head_dim", lambda c: c.qk_rope_head_dim),
}
#: keys that only transformers' own KimiLinearConfig writes (how `from_released_dict` tells it from remote code)
_TRANSFORMERS_KEYS = frozenset(["layer_types", "mlp_layer_types", "qk_head_dim", *_LINEAR_RENAMES])
#: what each foreign layout must spell out (after folding): every field that sets a shape or a numeric constant
_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token", "num_shared_experts",
    "moe_intermediate_size", "first_k_dense_replace", "routed_scaling_factor", "rms_norm_eps", "mla_use_nope",
)
_REQUIRED_LINEAR = ("head_dim", "num_heads", "short_conv_kernel_size")
#: fields a layout leaves out because its code fixes them
_IMPLIED = {"transformers": {"mla_use_nope": True}}
#: metadata keys of a config.json that are not model fields
_METADATA = ("model_type", "architectures", "auto_map", "quantization_config", "transformers_version", "torch_dtype",
             "dtype", "vision_config", "_name_or_path", "_commit_hash")

# ---------------------------------------------------------------------------------- field checks
_MAX_DIM = 2**31 - 1  # every size must fit an int32 dimension (ONNX / TensorRT shapes)
_MAX_LAYERS = 4096  # per-layer lists are built from num_hidden_layers: refuse absurd counts before building them
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
    "v_head_dim", "num_experts", "num_experts_per_token", "moe_intermediate_size", "kda_chunk_size",
    "num_expert_group", "topk_group",
)
_NON_NEGATIVE_INTS = ("qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace", "attn_res_block_size")
_OPTIONAL_POSITIVE_INTS = ("q_lora_rank", "routed_expert_hidden_size")
_POSITIVE_FLOATS = ("routed_scaling_factor", "activation_situ_beta", "activation_situ_linear_beta")
_BOOLS = ("mla_use_nope", "mla_use_output_gate", "latent_moe_use_norm", "moe_renormalize", "use_cache",
          "tie_word_embeddings")
_STRINGS = {"hidden_act": ("silu", "situ"), "moe_router_activation_func": ("sigmoid",)}
#: what a config.json's ``dtype`` / ``torch_dtype`` may say: the float types a checkpoint loads in (transformers
#: turns the name into ``getattr(torch, name)``, so anything else fails deep inside it)
DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_KEYS = ("dtype", "torch_dtype")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _fail(msg: str) -> None:
    raise K3ConfigError(f"K3Config: {msg}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, high: int = _MAX_DIM) -> None:
    if not _is_int(value):
        _fail(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        _fail(f"{name} must be in {low}..{high}, got {value}")


def _check_real(name: str, value: Any, positive: bool = True) -> None:
    if not _is_real(value) or not math.isfinite(value):
        _fail(f"{name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        _fail(f"{name} must be > 0, got {value!r}")


def _check_dtype(name: str, value: Any) -> None:
    """``dtype`` / ``torch_dtype`` (metadata, but transformers and the loader read it): None or one of `DTYPES`
    (``torch.`` prefix allowed); a torch.dtype object (set in code, not read from a file) passes."""
    if value is None or (type(value).__module__ == "torch" and type(value).__name__ == "dtype"):
        return
    if not isinstance(value, str) or value.removeprefix("torch.") not in DTYPES:
        _fail(f"{name} must be one of {', '.join(DTYPES)}, got {value!r}")


def _check_token_ids(ids: dict[str, Any], vocab_size: int) -> None:
    """Each of `ids` (bos / eos / pad) None or a token id in [0, vocab_size); eos may be a list of them."""
    for name, value in ids.items():
        values = value if name == "eos_token_id" and isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if v is None and values is not value:
                continue
            where = f"{name}[{i}]" if values is value else name
            if not _is_int(v) or not 0 <= v < vocab_size:
                _fail(f"{where} must be a token id in [0, vocab_size) = [0, {vocab_size}), got {v!r}")


def _same(a: Any, b: Any) -> bool:
    """Equal, with a bool never equal to a number (``True == 1`` in Python, not in a config)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _fold_spellings(d: dict[str, Any], given: Callable[[str], bool]) -> None:
    """Fold other layouts' spellings in `d` into our fields, in place. ``given(name)``: whether the caller set
    our field `name` (then the other spelling must agree with it; otherwise it provides the value)."""
    for key in _IGNORED:
        d.pop(key, None)
    for key, only in _FIXED.items():
        if key in d and not _same(d.pop(key), only):
            _fail(f"{key}={only!r} is the only value k3export implements")
    for alias, name in _RENAMES.items():
        if alias in d:
            value = d.pop(alias)
            if given(name) and not _same(d.get(name), value):
                _fail(f"{alias} ({value!r}) disagrees with {name} ({d.get(name)!r}); they are the same field")
            d[name] = value
    lac = d.get("linear_attn_config")
    if lac is not None and not isinstance(lac, dict):
        _fail(f"linear_attn_config must be an object, got {type(lac).__name__}")
    lac = dict(lac or {})
    folded = False
    for key, name in _LINEAR_RENAMES.items():
        if key in d:
            value = d.pop(key)
            if name in lac and not _same(lac[name], value):
                _fail(f"{key} ({value!r}) disagrees with linear_attn_config.{name} ({lac[name]!r})")
            lac[name], folded = value, True
    per_layer: dict[str, list[str]] = {}
    for key, names in (("layer_types", _LAYER_TYPES), ("mlp_layer_types", _MLP_LAYER_TYPES)):
        if key not in d:
            continue
        types = d.pop(key)
        if not isinstance(types, list):
            _fail(f"{key} must be a list, got {type(types).__name__}")
        for i, t in enumerate(types):
            if t not in names:
                _fail(f"{key}[{i}] is {t!r}; k3export reads {sorted(names)}")
        n = d.get("num_hidden_layers")
        if given("num_hidden_layers") and n != len(types):
            _fail(f"{key} has {len(types)} entries but num_hidden_layers is {n!r}")
        d["num_hidden_layers"] = len(types)
        per_layer[key] = [names[t] for t in types]
    if "layer_types" in per_layer:
        types = per_layer["layer_types"]
        for name, kind in (("full_attn_layers", "mla"), ("kda_layers", "kda")):
            layers = [i + 1 for i, t in enumerate(types) if t == kind]
            stated = lac.get(name)
            if stated is not None and not (isinstance(stated, list) and all(_is_int(i) for i in stated)
                                           and sorted(stated) == layers):
                _fail(f"layer_types puts {kind.upper()} on layers {layers} (1-based) but "
                      f"linear_attn_config.{name} is {lac[name]!r}")
            lac[name], folded = layers, True
    if "mlp_layer_types" in per_layer:
        types = per_layer["mlp_layer_types"]
        k = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if "dense" in types[k:]:
            _fail(f"mlp_layer_types {types} has a dense layer after an MoE one; k3export reads dense layers "
                  "first, then MoE (first_k_dense_replace)")
        if given("first_k_dense_replace") and not _same(d.get("first_k_dense_replace"), k):
            _fail(f"mlp_layer_types starts with {k} dense layers but first_k_dense_replace is "
                  f"{d.get('first_k_dense_replace')!r}")
        d["first_k_dense_replace"] = k
    if folded:
        d["linear_attn_config"] = lac


class K3Config(PretrainedConfig):
    r"""Configuration of a K3 (or Kimi-Linear) decoder.

    Layer lists in ``linear_attn_config`` are 1-based, as released. ``attn_res_block_size`` = 0 or None
    disables Attention Residuals (plain residual stream). ``routed_expert_hidden_size`` = None means the
    routed experts run on the full hidden size (no latent projections). ``linear_attn_config.gate_lower_bound``
    = None selects Kimi-Linear's softplus forget gate, a negative number K3's bounded sigmoid gate.
    Other layouts' keys are accepted as keyword arguments too (see the module docstring).
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
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        bos_token_id: int | None = 163584,
        eos_token_id: int | list[int] | None = 163586,
        pad_token_id: int | None = 163839,
        **kwargs: Any,
    ) -> None:
        arguments = dict(locals())
        values = {**{name: arguments[name] for name in _DEFAULTS}, **kwargs}
        # Other layouts' spellings arrive in kwargs; one of our fields counts as set when it is not at its default.
        _fold_spellings(values, given=lambda name: name in kwargs or (
            name in _DEFAULTS and not _same(values[name], _DEFAULTS[name])))
        kwargs = {k: v for k, v in values.items() if k not in _DEFAULTS}
        derived = {k: kwargs.pop(k) for k in list(kwargs) if k in _DERIVED or _is_derived_property(k)}
        kwargs.pop("model_type", None)  # the class says it; another layout's value must not stick to the instance
        for key in _DTYPE_KEYS:  # before transformers' getattr(torch, name), which has no "torch." prefix
            _check_dtype(key, kwargs.get(key))
            if isinstance(kwargs.get(key), str):
                kwargs[key] = kwargs[key].removeprefix("torch.")
        for name in _DEFAULTS:
            if name not in ("bos_token_id", "eos_token_id", "pad_token_id", "linear_attn_config"):
                setattr(self, name, values[name])
        if self.attn_res_block_size is None:
            self.attn_res_block_size = 0
        self._check_fields()
        # before transformers' __init__, which only warns about an id outside the vocabulary
        _check_token_ids({name: values[name] for name in _TOKEN_ID_KEYS}, self.vocab_size)
        self.linear_attn_config = _linear_attn_config(values["linear_attn_config"], self.num_hidden_layers)
        for name in ("rms_norm_eps", "routed_scaling_factor", "activation_situ_beta", "activation_situ_linear_beta"):
            setattr(self, name, float(getattr(self, name)))

        super().__init__(
            tie_word_embeddings=values["tie_word_embeddings"],
            bos_token_id=values["bos_token_id"],
            eos_token_id=values["eos_token_id"],
            pad_token_id=values["pad_token_id"],
            **kwargs,
        )
        self.validate_k3()
        for key, value in derived.items():
            what, derive = _DERIVED.get(key, (f"the value the other fields give {key}", lambda c, k=key: getattr(c, k)))
            expected = derive(self)
            if not _same(value, expected):
                _fail(f"{key} ({value!r}) disagrees with {what} ({expected!r})")

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> K3Config:
        """transformers' loader: other layouts' spellings are folded exactly (a key is set when it is present)."""
        config_dict = dict(config_dict)
        _fold_spellings(config_dict, given=config_dict.__contains__)
        return super().from_dict(config_dict, **kwargs)

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
    def _check_fields(self) -> None:
        """Types, finiteness and ranges of the scalar fields (before anything is sized from them)."""
        _check_int("num_hidden_layers", self.num_hidden_layers, 1, _MAX_LAYERS)
        for name in _POSITIVE_INTS:
            _check_int(name, getattr(self, name), 1)
        for name in _NON_NEGATIVE_INTS:
            _check_int(name, getattr(self, name), 0)
        for name in _OPTIONAL_POSITIVE_INTS:
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name in _POSITIVE_FLOATS:
            _check_real(name, getattr(self, name))
        _check_real("rms_norm_eps", self.rms_norm_eps)
        if not self.rms_norm_eps < 1:
            _fail(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        _check_real("initializer_range", self.initializer_range, positive=False)
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, allowed in _STRINGS.items():
            if getattr(self, name) not in allowed:
                _fail(f"{name} must be {' or '.join(map(repr, allowed))}, got {getattr(self, name)!r}")

    def validate_k3(self) -> None:
        """Raise `K3ConfigError` naming the first invalid or inconsistent field."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                _fail(msg)

        self._check_fields()
        need(self.mla_use_nope, "mla_use_nope=False (rotary MLA) is not supported: K3 and Kimi-Linear are NoPE")
        need(self.num_experts_per_token <= self.num_experts,
             f"num_experts_per_token ({self.num_experts_per_token}) must be <= num_experts ({self.num_experts})")
        need(self.num_expert_group == 1 and self.topk_group == 1,
             f"grouped routing (num_expert_group={self.num_expert_group}, topk_group={self.topk_group}) "
             "is not supported; K3 and Kimi-Linear use 1")
        _check_token_ids({name: getattr(self, name, None) for name in _TOKEN_ID_KEYS}, self.vocab_size)
        need(self.first_k_dense_replace <= self.num_hidden_layers,
             f"first_k_dense_replace ({self.first_k_dense_replace}) must be in [0, num_hidden_layers]")
        need(not self.latent_moe_use_norm or self.use_latent_moe,
             "latent_moe_use_norm=True needs routed_expert_hidden_size (the latent width)")
        _linear_attn_config(self.linear_attn_config, self.num_hidden_layers)

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
        """Build from a ``config.json`` dict in any layout of the module docstring.

        A released or Kimi-Linear config must give every field of ``_REQUIRED`` (the error names the first
        missing one); ours may leave fields at their defaults."""
        if not isinstance(config, dict):
            raise K3ConfigError(f"config must be a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if "text_config" in config:
            if model_type not in ("kimi_k3", "k3", None):
                raise K3ConfigError(f"config.json has model_type {model_type!r}; expected 'kimi_k3' with a text_config")
            if not isinstance(config["text_config"], dict):
                raise K3ConfigError("config.json: text_config must be an object")
            text, layout = dict(config["text_config"]), "kimi_k3"
        else:
            if model_type not in MODEL_TYPES:
                raise K3ConfigError(
                    f"config.json has model_type {model_type!r}; k3export reads 'k3', 'kimi_k3' (released K3) "
                    "or 'kimi_linear'")
            text, layout = dict(config), model_type
        for key in _DTYPE_KEYS:  # metadata, dropped below, but the loader and transformers read it
            for where, d in (("", config), ("text_config.", config.get("text_config") or {})):
                _check_dtype(where + key, d.get(key))
        for key in _METADATA:
            text.pop(key, None)
        text.update(overrides)
        if layout != "k3":
            if _TRANSFORMERS_KEYS & set(text):
                layout = "transformers"
            else:
                text.pop("head_dim", None)  # the remote code's legacy hidden_size // heads, which it never reads
        _fold_spellings(text, given=text.__contains__)
        if layout != "k3":
            for name, value in _IMPLIED.get(layout, {}).items():
                text.setdefault(name, value)
            _require(text, layout)
        return cls(**text)


def _require(text: dict[str, Any], layout: str) -> None:
    where = {"kimi_k3": "the released K3 text_config", "transformers": "transformers' KimiLinearConfig",
             "kimi_linear": "a Kimi-Linear config"}[layout]
    lac = text.get("linear_attn_config") or {}
    missing = [name for name in _REQUIRED if name not in text]
    missing += [f"linear_attn_config.{name}" for name in _REQUIRED_LINEAR if name not in lac]
    if lac.get("full_attn_layers") is None and lac.get("kda_layers") is None:
        missing.append("linear_attn_config.full_attn_layers")
    if text.get("first_k_dense_replace") and "intermediate_size" not in text:
        missing.append("intermediate_size")
    if missing:
        more = f" (also missing: {', '.join(missing[1:6])}{', ...' if len(missing) > 6 else ''})" if missing[1:] else ""
        _fail(f"{missing[0]} is missing from {where}; k3export does not guess it{more}")


def _linear_attn_config(given: dict[str, Any] | None, n: int) -> dict[str, Any]:
    """``linear_attn_config`` with defaults filled in and every entry checked (layer lists 1-based, partitioning
    1..n; the other list is derived when only one is given, Kimi-Linear's pattern when neither is)."""
    if given is not None and not isinstance(given, dict):
        _fail(f"linear_attn_config must be an object, got {type(given).__name__}")
    lac = dict(_LINEAR_ATTN_DEFAULTS)
    lac.update(copy.deepcopy(given) if given else {})
    unknown = sorted(set(lac) - set(_LINEAR_ATTN_DEFAULTS))
    if unknown:
        _fail(f"linear_attn_config has unknown keys {unknown}")
    for name in ("head_dim", "num_heads", "short_conv_kernel_size"):
        _check_int(f"linear_attn_config.{name}", lac[name], 1)
    if not isinstance(lac["use_full_rank_gate"], bool):
        _fail(f"linear_attn_config.use_full_rank_gate must be true or false, got {lac['use_full_rank_gate']!r}")
    bound = lac["gate_lower_bound"]
    if bound is not None:
        _check_real("linear_attn_config.gate_lower_bound", bound, positive=False)
        if not bound < 0:
            _fail(f"linear_attn_config.gate_lower_bound must be None or negative, got {bound!r}")
    for name in ("full_attn_layers", "kda_layers"):
        layers = lac[name]
        if layers is None:
            continue
        if not isinstance(layers, (list, tuple)) or not all(_is_int(i) for i in layers):
            _fail(f"linear_attn_config.{name} must be a list of integer layer numbers, got {layers!r}")
        out_of_range = [i for i in layers if not 1 <= i <= n]
        if out_of_range:
            _fail(f"linear_attn_config.{name} has layers {out_of_range[:8]} outside 1..{n} (the lists are 1-based)")
        if len(set(layers)) != len(layers):
            _fail(f"linear_attn_config.{name} repeats a layer")
        lac[name] = list(layers)
    full, kda = lac["full_attn_layers"], lac["kda_layers"]
    if full is None and kda is None:  # Kimi-Linear's default pattern: every 4th layer (1-based) is MLA, the last too
        full = [i for i in range(1, n + 1) if i % 4 == 0 or i == n]
    if full is None:
        full = sorted(set(range(1, n + 1)) - set(kda))
    if kda is None:
        kda = sorted(set(range(1, n + 1)) - set(full))
    both = sorted(set(full) & set(kda))
    if both:
        _fail(f"layers {both[:8]} are in both full_attn_layers and kda_layers")
    missing = sorted(set(range(1, n + 1)) - set(full) - set(kda))
    if missing:
        _fail(f"layers {missing[:8]} are in neither full_attn_layers nor kda_layers "
              f"(the two lists must partition 1..{n})")
    lac["full_attn_layers"], lac["kda_layers"] = full, kda
    return lac


def _is_derived_property(name: str) -> bool:
    prop = K3Config.__dict__.get(name)
    return isinstance(prop, property) and prop.fset is None


def _signature_defaults() -> dict[str, Any]:
    return {p.name: p.default for p in inspect.signature(K3Config.__init__).parameters.values()
            if p.default is not inspect.Parameter.empty}


_DEFAULTS = _signature_defaults()


# ==================================================================================== vision (MoonViT-V2)
#: ``model_type`` of `K3VisionConfig` (TensorRT-LLM's in-tree mirror of the checkpoint's vision config uses it too)
VISION_MODEL_TYPE = "kimi_k3_vision"
#: the placeholder token the released K3 puts where image features go (``<|media_pad|>``)
MEDIA_PLACEHOLDER_TOKEN_ID = 163605
#: vision_config keys with the one value k3export implements (the released and development checkpoints' values)
_VISION_ONLY = {
    "activation_func": "gelu_pytorch_tanh", "norm_type": "rmsnorm", "mlp_type": "mlp2",
    "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear", "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu",
    "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
}
_VISION_POSITIVE_INTS = ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time",
                         "vt_hidden_size", "vt_intermediate_size", "vt_num_attention_heads", "vt_num_hidden_layers",
                         "qkv_hidden_size", "mm_hidden_size", "text_hidden_size", "in_channels")


def _vision_fail(msg: str) -> None:
    raise K3ConfigError(f"K3VisionConfig: vision_config.{msg}")


class K3VisionConfig(PretrainedConfig):
    r"""The released K3 ``vision_config``: the MoonViT-V2 tower (``vt_*``) and its PatchMergerMLPV2 projector
    (``mm_*`` / ``projector_*``). Defaults are the released ``moonshotai/Kimi-K3`` tower (27 layers, 1024 wide,
    12 heads of 128). ``qkv_hidden_size`` = None means ``vt_hidden_size``; ``mm_hidden_size`` = None likewise.
    Every field is checked; a value k3export does not implement is refused naming the field."""

    model_type = VISION_MODEL_TYPE

    def __init__(
        self,
        patch_size: int = 14,
        in_channels: int = 3,
        init_pos_emb_height: int = 64,
        init_pos_emb_width: int = 64,
        init_pos_emb_time: int = 4,
        pos_emb_type: str = "divided_fixed",
        pos_emb_interpolation_mode: str = "bilinear",
        vt_hidden_size: int = 1024,
        vt_intermediate_size: int = 4096,
        vt_num_attention_heads: int = 12,
        vt_num_hidden_layers: int = 27,
        qkv_hidden_size: int | None = 1536,
        activation_func: str = "gelu_pytorch_tanh",
        norm_type: str = "rmsnorm",
        mlp_type: str = "mlp2",
        attn_bias: bool = False,
        linear_bias: bool = False,
        patch_embed_proj_bias: bool = False,
        merge_kernel_size: list[int] | tuple[int, int] = (2, 2),
        merge_type: str = "sd2_tpool",
        mm_projector_type: str = "patchmergerv2",
        mm_hidden_size: int | None = None,
        projector_hidden_act: str = "gelu",
        projector_ln_eps: float = 1e-5,
        text_hidden_size: int = 7168,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("model_type", None)  # the dev checkpoint writes "" here; the class says what it is
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_type = pos_emb_type
        self.pos_emb_interpolation_mode = pos_emb_interpolation_mode
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.qkv_hidden_size = vt_hidden_size if qkv_hidden_size is None else qkv_hidden_size
        self.activation_func = activation_func
        self.norm_type = norm_type
        self.mlp_type = mlp_type
        self.attn_bias = attn_bias
        self.linear_bias = linear_bias
        self.patch_embed_proj_bias = patch_embed_proj_bias
        self.merge_kernel_size = list(merge_kernel_size) if isinstance(merge_kernel_size, (list, tuple)) \
            else merge_kernel_size
        self.merge_type = merge_type
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = vt_hidden_size if mm_hidden_size is None else mm_hidden_size
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps
        self.text_hidden_size = text_hidden_size
        self.validate_vision()
        self.projector_ln_eps = float(self.projector_ln_eps)
        super().__init__(**kwargs)

    # ------------------------------------------------------------------ derived views
    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_area(self) -> int:
        """Patches merged into one text token (kh * kw)."""
        return int(self.merge_kernel_size[0]) * int(self.merge_kernel_size[1])

    @property
    def projector_in_size(self) -> int:
        """Width of one merged token, the projector's input: kh * kw * mm_hidden_size."""
        return self.merge_area * self.mm_hidden_size

    @property
    def patch_pixels(self) -> int:
        """Values in one patch: in_channels * patch_size^2."""
        return self.in_channels * self.patch_size * self.patch_size

    # ------------------------------------------------------------------ validation
    def validate_vision(self) -> None:
        """Raise `K3ConfigError` naming the first invalid field (``vision_config.<field>``)."""
        for name in _VISION_POSITIVE_INTS:
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= _MAX_DIM:
                _vision_fail(f"{name} must be a positive integer, got {value!r}")
        if self.vt_num_hidden_layers > _MAX_LAYERS:
            _vision_fail(f"vt_num_hidden_layers must be in 1..{_MAX_LAYERS}, got {self.vt_num_hidden_layers}")
        for name, only in _VISION_ONLY.items():
            value = getattr(self, name)
            if not _same(value, only):
                _vision_fail(f"{name} is {value!r}; k3export implements {only!r} only (the released tower's)")
        mk = self.merge_kernel_size
        if not isinstance(mk, list) or len(mk) != 2 or not all(_is_int(k) and 1 <= k <= 64 for k in mk):
            _vision_fail(f"merge_kernel_size must be two positive integers [kh, kw], got {mk!r}")
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            _vision_fail(f"qkv_hidden_size ({self.qkv_hidden_size}) must be a multiple of vt_num_attention_heads "
                         f"({self.vt_num_attention_heads})")
        if self.head_dim % 4:
            _vision_fail(f"qkv_hidden_size / vt_num_attention_heads = {self.head_dim} must be a multiple of 4 "
                         "(2D rotary: half the pairs rotate with the column, half with the row)")
        if self.vt_hidden_size % 2:
            _vision_fail(f"vt_hidden_size ({self.vt_hidden_size}) must be even (the temporal sin/cos embedding)")
        if self.mm_hidden_size != self.vt_hidden_size:
            _vision_fail(f"mm_hidden_size ({self.mm_hidden_size}) must equal vt_hidden_size ({self.vt_hidden_size}): "
                         "the projector reads the tower's output")
        if not _is_real(self.projector_ln_eps) or not math.isfinite(self.projector_ln_eps) \
                or not 0 < self.projector_ln_eps < 1:
            _vision_fail(f"projector_ln_eps must be in (0, 1), got {self.projector_ln_eps!r}")

    @classmethod
    def tiny(cls, **overrides: Any) -> K3VisionConfig:
        """A 2-layer tower of every released feature at a few hundred kB (for tests and demos): 4-pixel patches,
        a 6x6 learned position grid (interpolated for any other grid), 2 frames of temporal embedding."""
        kwargs: dict[str, Any] = dict(
            patch_size=4, init_pos_emb_height=6, init_pos_emb_width=6, init_pos_emb_time=2, vt_hidden_size=32,
            vt_intermediate_size=64, vt_num_attention_heads=2, vt_num_hidden_layers=2, qkv_hidden_size=48,
            text_hidden_size=64)
        kwargs.update(overrides)
        return cls(**kwargs)


class K3VLConfig(PretrainedConfig):
    r"""The released K3's top-level config (``model_type`` ``kimi_k3``, ``KimiK3ForConditionalGeneration``): the
    text model in ``text_config`` (a `K3Config`, any layout `K3Config.from_released_dict` reads) and the vision
    tower in ``vision_config`` (a `K3VisionConfig`). Image features replace the embeddings of
    ``media_placeholder_token_id`` tokens. A text-only K3 stays a `K3Config`."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": K3Config, "vision_config": K3VisionConfig}

    def __init__(
        self,
        text_config: dict[str, Any] | K3Config | None = None,
        vision_config: dict[str, Any] | K3VisionConfig | None = None,
        media_placeholder_token_id: int = MEDIA_PLACEHOLDER_TOKEN_ID,
        ignore_index: int = -100,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("model_type", None)
        if text_config is None:
            text_config = K3Config.k3()
        elif isinstance(text_config, dict):
            text_config = K3Config.from_released_dict({"model_type": "kimi_k3", "text_config": text_config})
        elif not isinstance(text_config, K3Config):
            raise K3ConfigError(f"K3VLConfig: text_config must be an object, got {type(text_config).__name__}")
        if vision_config is None:
            vision_config = K3VisionConfig(text_hidden_size=text_config.hidden_size)
        elif isinstance(vision_config, dict):
            vision_config = K3VisionConfig(**vision_config)
        elif not isinstance(vision_config, K3VisionConfig):
            raise K3ConfigError(f"K3VLConfig: vision_config must be an object, got {type(vision_config).__name__}")
        self.text_config = text_config
        self.vision_config = vision_config
        self.media_placeholder_token_id = media_placeholder_token_id
        self.ignore_index = ignore_index
        if vision_config.text_hidden_size != text_config.hidden_size:
            raise K3ConfigError(f"K3VLConfig: vision_config.text_hidden_size ({vision_config.text_hidden_size}) "
                                f"must equal text_config.hidden_size ({text_config.hidden_size})")
        if not _is_int(media_placeholder_token_id) or not 0 <= media_placeholder_token_id < text_config.vocab_size:
            raise K3ConfigError(f"K3VLConfig: media_placeholder_token_id must be a token id in [0, "
                                f"text_config.vocab_size) = [0, {text_config.vocab_size}), "
                                f"got {media_placeholder_token_id!r}")
        for key in _DTYPE_KEYS:
            _check_dtype(key, kwargs.get(key))
            if isinstance(kwargs.get(key), str):
                kwargs[key] = kwargs[key].removeprefix("torch.")
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    @classmethod
    def from_released_dict(cls, config: dict[str, Any], **overrides: Any) -> K3VLConfig:
        """Build from a ``config.json`` dict with ``text_config`` and ``vision_config`` (the released and the
        development checkpoints, or ours); `overrides` go to the text model."""
        if not isinstance(config, dict):
            raise K3ConfigError(f"config must be a JSON object, got {type(config).__name__}")
        if config.get("model_type") != cls.model_type:
            raise K3ConfigError(f"config.json has model_type {config.get('model_type')!r}; a K3 with a vision tower "
                                f"has {cls.model_type!r}")
        if not isinstance(config.get("vision_config"), dict):
            raise K3ConfigError("config.json has no vision_config object: a text-only checkpoint (load it with "
                                "K3ForCausalLM)")
        text = K3Config.from_released_dict(config, **overrides)
        # quantization_config describes stored bytes, not the model k3export builds (its experts are decoded)
        top = {k: v for k, v in config.items()
               if k not in ("text_config", "vision_config", "model_type", "quantization_config",
                            "transformers_version", "_name_or_path", "_commit_hash")}
        return cls(text_config=text, vision_config=dict(config["vision_config"]), **top)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> K3VLConfig:
        """transformers' loader (AutoConfig, from_pretrained): every layout `from_released_dict` reads."""
        return_unused = kwargs.pop("return_unused_kwargs", False)
        config = cls.from_released_dict(dict(config_dict))
        for key in list(kwargs):
            if hasattr(config, key):
                setattr(config, key, kwargs.pop(key))
        return (config, kwargs) if return_unused else config

    @classmethod
    def tiny(cls, **overrides: Any) -> K3VLConfig:
        """`K3Config.tiny` with `K3VisionConfig.tiny` attached; placeholder token 3 (below the tiny vocabulary)."""
        text = overrides.pop("text_config", None) or K3Config.tiny()
        vision = overrides.pop("vision_config", None) or K3VisionConfig.tiny(text_hidden_size=text.hidden_size)
        return cls(text_config=text, vision_config=vision, **{"media_placeholder_token_id": 3, **overrides})
