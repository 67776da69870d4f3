# Copyright 2026 the k3export authors. Apache-2.0.
"""The K3 contract: every carried decode state and every parameter of a model, derived from its `K3Config`.

This is the one home of these facts. `K3Cache`, the ONNX graph builder, the state manifest, ``info``, every
runner, the TensorRT profiles and onnxruntime-genai's config all read them from here.

States follow onnxruntime-genai's layout (one graph serves genai and every other runtime):

* KDA layer i: ``past_key_values.{i}.conv_state`` [batch, 3*H*K, kernel-1] (the q, k, v short-conv inputs,
  concatenated in that order; activation dtype) and ``past_key_values.{i}.recurrent_state`` [batch, H, K, V]
  (float32).
* MLA layer i: the compressed latent [c_kv | k_pe] as a key/value pair of equal shape,
  ``past_key_values.{i}.key`` / ``.value`` [batch, 1, past_sequence_length, W] with W = ceil(latent / 2):
  key holds latent[:W], value latent[W:] (zero-padded to W when the latent width is odd).

Outputs carry the same names with ``present.{i}.`` and ``total_sequence_length`` for the past length.

A state window (``export --state-window W``, for speculative decoding's rollback) adds, for every constant-size
state, ``present_window.{i}.{kind}`` [W, *shape]: slot j holds the state after position T - 1 - W + j of the call
(T new tokens), so slot W - n is the state with the call's last n tokens taken back (a slot before the call's
first token holds the state it started from). The MLA latent needs no window: its rows are cut
(`StateSpec.grows`).
`cache_to_states` / `cache_from_states` map a `K3Cache` to and from these named tensors.
Dtypes are canonical names (``k3export.dtypes``); ``"activation"`` in a spec means the model's dtype.

This file is copied next to saved checkpoints with the modeling files. It imports nothing heavy at load (torch
only inside the two cache functions, the configuration only for type checking), so that a runtime reading these
names keeps torch and transformers out of its process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

    from .configuration_k3 import K3Config

# ----------------------------------------------------------------------------------------- dimension roles
BATCH = "batch"
PAST = "past_sequence_length"
TOTAL = "total_sequence_length"  # PAST + SEQ: a state output's length
SEQ = "sequence_length"  # new tokens in this call

STATE_INPUT = "past_key_values.{layer}.{kind}"
STATE_OUTPUT = "present.{layer}.{kind}"
STATE_WINDOW_OUTPUT = "present_window.{layer}.{kind}"
INPUT_IDS, ATTENTION_MASK, LOGITS = "input_ids", "attention_mask", "logits"
#: optional int64 scalar input of a whole decoder (an initializer-backed input, default 0): logits for the last
#: `logits_to_keep` positions only, 0 = every position (transformers' ``logits_to_keep``). A prefill that needs
#: only the next token feeds 1: at K3's vocabulary a 8k-token prompt's fp32 logits are 5.4 GB.
LOGITS_TO_KEEP = "logits_to_keep"

#: MLA attends at most this many queries at a time (PyTorch, and a ``Loop`` over blocks in the ONNX graph), so its
#: score buffers are [B, H, block, S], not [B, H, T, S]: at K3's 96 heads an 8k-token prompt's fp32 scores are
#: 25 GB each
MLA_QUERY_BLOCK = 128

ACTIVATION = "activation"
FLOAT32 = "float32"

#: parameters kept in float32 whatever the model dtype (by name suffix)
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias")


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_PARAM_SUFFIXES)


@dataclass(frozen=True)
class StateSpec:
    """One carried state tensor: graph input ``name``, graph output ``present``."""

    layer: int
    kind: str  # conv_state | recurrent_state | key | value
    role: str  # conv | recurrent | latent
    shape: tuple[int | str, ...]  # input shape; str dims are BATCH or PAST
    dtype: str  # ACTIVATION or a canonical dtype name

    @property
    def name(self) -> str:
        return STATE_INPUT.format(layer=self.layer, kind=self.kind)

    @property
    def present(self) -> str:
        return STATE_OUTPUT.format(layer=self.layer, kind=self.kind)

    @property
    def window(self) -> str:
        """The state-window output's name (constant-size states only)."""
        return STATE_WINDOW_OUTPUT.format(layer=self.layer, kind=self.kind)

    def window_shape(self, window: int) -> tuple[int | str, ...]:
        return (window, *self.shape)

    @property
    def present_shape(self) -> tuple[int | str, ...]:
        return tuple(TOTAL if d == PAST else d for d in self.shape)

    @property
    def grows(self) -> bool:
        """Whether the state's length grows with the context (MLA latents)."""
        return PAST in self.shape

    def resolved_dtype(self, activation: str) -> str:
        """The dtype of this state in a model computing in `activation`: fp32 states are fp32 at least (a float64
        reference keeps float64 states)."""
        if self.dtype == ACTIVATION or (self.dtype == FLOAT32 and activation == "float64"):
            return activation
        return self.dtype

    def concrete_shape(self, batch: int, past: int = 0) -> tuple[int, ...]:
        return tuple(batch if d == BATCH else past if d == PAST else int(d) for d in self.shape)

    def elements(self, past: int = 0) -> int:
        """Elements per sequence (batch 1) after `past` tokens."""
        n = 1
        for d in self.concrete_shape(1, past):
            n *= d
        return n


def mla_kv_width(config: K3Config) -> int:
    """W: the last dim of an MLA layer's key and value halves of the latent."""
    return (config.mla_latent_dim + 1) // 2


def layer_state_specs(config: K3Config, layer: int) -> list[StateSpec]:
    c = config
    if c.attn_types[layer] == "kda":
        H, K = c.kda_num_heads, c.kda_head_dim
        return [
            StateSpec(layer, "conv_state", "conv", (BATCH, 3 * H * K, c.kda_conv_kernel - 1), ACTIVATION),
            StateSpec(layer, "recurrent_state", "recurrent", (BATCH, H, K, K), FLOAT32),
        ]
    w = mla_kv_width(c)
    return [StateSpec(layer, kind, "latent", (BATCH, 1, PAST, w), ACTIVATION) for kind in ("key", "value")]


def state_specs(config: K3Config, layers: range | None = None) -> list[StateSpec]:
    """Every carried state of `layers` (default: all), in layer order."""
    layers = range(config.num_hidden_layers) if layers is None else layers
    return [s for i in layers for s in layer_state_specs(config, i)]


def cache_to_states(cache: Any, specs: list[StateSpec] | None = None) -> dict[str, torch.Tensor]:
    """{state name: tensor} of a `K3Cache` in this layout (MLA latents split into key / value halves)."""
    import torch
    import torch.nn.functional as F

    out: dict[str, torch.Tensor] = {}
    w = mla_kv_width(cache.config)
    for spec in state_specs(cache.config) if specs is None else specs:
        if spec.kind == "conv_state":
            out[spec.name] = cache.conv_states[spec.layer]
        elif spec.kind == "recurrent_state":
            out[spec.name] = cache.recurrent_states[spec.layer]
        elif spec.kind in ("key", "value"):
            latent = cache.latents[spec.layer]
            half = latent[..., :w] if spec.kind == "key" else F.pad(latent[..., w:], (0, 2 * w - latent.shape[-1]))
            out[spec.name] = half.unsqueeze(1)
        elif spec.name in cache.carried:
            out[spec.name] = cache.carried[spec.name]
        else:  # a contract state no layer writes starts (and stays) at zero
            like = next(iter([*cache.conv_states.values(), *cache.latents.values()]))
            dtype = torch.float32 if spec.dtype == FLOAT32 else like.dtype
            out[spec.name] = like.new_zeros(spec.concrete_shape(like.shape[0]), dtype=dtype)
    return out


def cache_from_states(cache: Any, states: dict[str, torch.Tensor], specs: list[StateSpec] | None = None) -> Any:
    """The empty `K3Cache` `cache`, filled with `states` (named as `cache_to_states` names them); a missing state
    raises KeyError."""
    config = cache.config
    import torch

    latent_halves: dict[int, dict[str, torch.Tensor]] = {}
    for spec in state_specs(config) if specs is None else specs:
        t = states[spec.name]
        if spec.kind == "conv_state":
            cache.conv_states[spec.layer] = t
        elif spec.kind == "recurrent_state":
            cache.recurrent_states[spec.layer] = t
        elif spec.kind in ("key", "value"):
            latent_halves.setdefault(spec.layer, {})[spec.kind] = t.squeeze(1)
            cache._seen_tokens = t.shape[2]
        else:
            cache.carried[spec.name] = t
    for layer, kv in latent_halves.items():
        cache.latents[layer] = torch.cat([kv["key"], kv["value"]], dim=-1)[..., : config.mla_latent_dim]
    return cache


# ----------------------------------------------------------------------------------------- pipeline boundaries
STAGE_INPUT = "stage_in.{kind}"
STAGE_OUTPUT = "stage_out.{kind}"


@dataclass(frozen=True)
class BoundarySpec:
    """A tensor that crosses a pipeline cut before decoder layer `layer`: the running hidden state (the current
    Attention-Residual block's partial sum) and, with Attention Residuals, the completed block summaries."""

    layer: int
    kind: str  # hidden | attn_res_blocks
    shape: tuple[int | str, ...]  # activation dtype

    @property
    def input(self) -> str:
        return STAGE_INPUT.format(kind=self.kind)

    @property
    def output(self) -> str:
        return STAGE_OUTPUT.format(kind=self.kind)


def boundary_specs(config: K3Config, layer: int) -> list[BoundarySpec]:
    """What a stage starting at `layer` receives and the stage ending there sends (empty at 0 and at the end)."""
    if layer <= 0 or layer >= config.num_hidden_layers:
        return []
    out = [BoundarySpec(layer, "hidden", (BATCH, SEQ, config.hidden_size))]
    if config.use_attn_res:
        blocks = -(-layer // config.attn_res_block_size)  # blocks opened before `layer`
        out.append(BoundarySpec(layer, "attn_res_blocks", (blocks, BATCH, SEQ, config.hidden_size)))
    return out


# ----------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the checkpoint names it (without the released ``language_model.`` prefix)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # embedding, lm_head, norm, attn_res, layer_norms, kda, mla, dense_mlp, router, moe_routed, ...
    expert: int | None = None  # routed expert index

    @property
    def fp32(self) -> bool:
        return keeps_fp32(self.name)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _glu(prefix: str, d: int, inter: int, kind: str, names=("gate_proj", "up_proj", "down_proj"),
         expert: int | None = None) -> list[ParamSpec]:
    g, u, dn = names
    return [ParamSpec(f"{prefix}{g}.weight", (inter, d), kind, expert), ParamSpec(f"{prefix}{u}.weight", (inter, d),
            kind, expert), ParamSpec(f"{prefix}{dn}.weight", (d, inter), kind, expert)]


def expert_param_specs(config: K3Config, layer: int, expert: int) -> list[ParamSpec]:
    """w1 (gate), w3 (up), w2 (down) of one routed expert, as released (``experts.{e}.w1/w2/w3``)."""
    p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    D, inter = config.expert_input_size, config.moe_intermediate_size
    return [ParamSpec(p + "w1.weight", (inter, D), "moe_routed", expert),
            ParamSpec(p + "w2.weight", (D, inter), "moe_routed", expert),
            ParamSpec(p + "w3.weight", (inter, D), "moe_routed", expert)]


def layer_param_specs(config: K3Config, i: int, experts: bool = True) -> list[ParamSpec]:
    """Parameters of decoder layer `i` (routed experts last; ``experts=False`` leaves them out)."""
    c = config
    d = c.hidden_size
    p = f"model.layers.{i}."
    out = [ParamSpec(p + "input_layernorm.weight", (d,), "layer_norms"),
           ParamSpec(p + "post_attention_layernorm.weight", (d,), "layer_norms")]
    if c.use_attn_res:
        for which in ("self_attention_res", "mlp_res"):
            out += [ParamSpec(f"{p}{which}_proj.weight", (1, d), "layer_norms"),
                    ParamSpec(f"{p}{which}_norm.weight", (d,), "layer_norms")]
    a = p + "self_attn."
    if c.attn_types[i] == "kda":
        H, K, ker = c.kda_num_heads, c.kda_head_dim, c.kda_conv_kernel
        hk = H * K
        lac = c.linear_attn_config
        out += [ParamSpec(f"{a}{x}_proj.weight", (hk, d), "kda") for x in "qkv"]
        out += [ParamSpec(f"{a}{x}_conv1d.weight", (hk, 1, ker), "kda") for x in "qkv"]
        out += [ParamSpec(a + "f_a_proj.weight", (K, d), "kda"), ParamSpec(a + "f_b_proj.weight", (hk, K), "kda"),
                ParamSpec(a + "dt_bias", (hk,), "kda"),
                ParamSpec(a + "A_log", (max(H, K),) if lac["gate_lower_bound"] is not None else (1, 1, H, 1), "kda"),
                ParamSpec(a + "b_proj.weight", (H, d), "kda")]
        if lac["use_full_rank_gate"]:
            out.append(ParamSpec(a + "g_proj.weight", (hk, d), "kda"))
        else:
            out += [ParamSpec(a + "g_a_proj.weight", (K, d), "kda"), ParamSpec(a + "g_b_proj.weight", (hk, K), "kda")]
        out += [ParamSpec(a + "o_norm.weight", (K,), "kda"), ParamSpec(a + "o_proj.weight", (d, hk), "kda")]
    else:
        H, qk = c.num_attention_heads, c.qk_head_dim
        if c.q_lora_rank is None:
            out.append(ParamSpec(a + "q_proj.weight", (H * qk, d), "mla"))
        else:
            r = c.q_lora_rank
            out += [ParamSpec(a + "q_a_proj.weight", (r, d), "mla"), ParamSpec(a + "q_a_layernorm.weight", (r,), "mla"),
                    ParamSpec(a + "q_b_proj.weight", (H * qk, r), "mla")]
        out += [ParamSpec(a + "kv_a_proj_with_mqa.weight", (c.mla_latent_dim, d), "mla"),
                ParamSpec(a + "kv_a_layernorm.weight", (c.kv_lora_rank,), "mla"),
                ParamSpec(a + "kv_b_proj.weight", (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), "mla")]
        if c.mla_use_output_gate:
            out.append(ParamSpec(a + "g_proj.weight", (H * c.v_head_dim, d), "mla"))
        out.append(ParamSpec(a + "o_proj.weight", (d, H * c.v_head_dim), "mla"))
    if c.mlp_types[i] == "dense":
        return out + _glu(p + "mlp.", d, c.intermediate_size, "dense_mlp")
    m = p + "block_sparse_moe."
    out += [ParamSpec(m + "gate.weight", (c.num_experts, d), "router"),
            ParamSpec(m + "gate.e_score_correction_bias", (c.num_experts,), "router")]
    if c.use_latent_moe:
        D = c.routed_expert_hidden_size
        out += [ParamSpec(m + "routed_expert_down_proj.weight", (D, d), "moe_latent"),
                ParamSpec(m + "routed_expert_up_proj.weight", (d, D), "moe_latent")]
        if c.latent_moe_use_norm:
            out.append(ParamSpec(m + "routed_expert_norm.weight", (D,), "moe_latent"))
    if c.num_shared_experts:
        out += _glu(m + "shared_experts.", d, c.moe_intermediate_size * c.num_shared_experts, "moe_shared")
    if experts:
        for e in range(c.num_experts):
            out += expert_param_specs(c, i, e)
    return out


def head_param_specs(config: K3Config) -> list[ParamSpec]:
    """Parameters outside the decoder layers: embedding (stage 0), final norm, AttnRes output, lm_head (last stage)."""
    c = config
    d = c.hidden_size
    out = [ParamSpec("model.embed_tokens.weight", (c.vocab_size, d), "embedding"),
           ParamSpec("model.norm.weight", (d,), "norm")]
    if c.use_attn_res:
        out += [ParamSpec("model.output_attn_res_proj.weight", (1, d), "attn_res"),
                ParamSpec("model.output_attn_res_norm.weight", (d,), "attn_res")]
    if not c.tie_word_embeddings:
        out.append(ParamSpec("lm_head.weight", (c.vocab_size, d), "lm_head"))
    return out


def unread_param_names(config: K3Config) -> frozenset[str]:
    """Parameters no output depends on, which an export leaves out: layer 0's first Attention-Residual aggregation
    has a single source, so its softmax weight is 1 whatever its query (proj) and key norm hold."""
    if not config.use_attn_res:
        return frozenset()
    p = "model.layers.0.self_attention_res_"
    return frozenset((p + "proj.weight", p + "norm.weight"))


def parameter_count(config: K3Config) -> int:
    """Parameters of `K3ForCausalLM(config)`, each kind of layer and one routed expert priced once: cheap for any
    config, however many layers or experts it claims."""
    expert = sum(s.numel for s in expert_param_specs(config, 0, 0))
    n = sum(s.numel for s in head_param_specs(config))
    first: dict[tuple[str, str], int] = {}
    counts: dict[tuple[str, str], int] = {}
    for i, kind in enumerate(zip(config.attn_types, config.mlp_types)):
        first.setdefault(kind, i)
        counts[kind] = counts.get(kind, 0) + 1
    for kind, i in first.items():
        layer = sum(s.numel for s in layer_param_specs(config, i, experts=False))
        n += counts[kind] * (layer + (config.num_experts * expert if kind[1] == "moe" else 0))
    return n


def param_specs(config: K3Config) -> Iterator[ParamSpec]:
    """Every parameter of `K3ForCausalLM(config)`, by its checkpoint name (a generator: the full K3 has ~250k)."""
    yield from head_param_specs(config)
    for i in range(config.num_hidden_layers):
        yield from layer_param_specs(config, i)


__all__ = [
    "ACTIVATION", "ATTENTION_MASK", "BATCH", "BoundarySpec", "FLOAT32", "FP32_PARAM_SUFFIXES", "INPUT_IDS", "LOGITS",
    "LOGITS_TO_KEEP", "PAST", "ParamSpec", "SEQ", "STAGE_INPUT", "STAGE_OUTPUT", "STATE_INPUT", "STATE_OUTPUT",
    "StateSpec", "TOTAL", "boundary_specs", "cache_from_states", "cache_to_states", "expert_param_specs",
    "head_param_specs", "keeps_fp32", "layer_param_specs", "layer_state_specs", "mla_kv_width", "param_specs",
    "parameter_count", "state_specs", "unread_param_names",
]


# ----------------------------------------------------------------------------------------- image + text graphs
#: the decoder input of an image + text export, instead of ``input_ids``: the token embeddings with the projected
#: image features spliced in, activation dtype [batch, sequence_length, hidden] (the embedding graph's output)
INPUTS_EMBEDS = "inputs_embeds"
#: I/O of the vision graph (packed patches + grid in, merged projected tokens out) and of the embedding graph
#: (``input_ids`` + ``image_features`` in, `INPUTS_EMBEDS` out); onnxruntime-genai's default names for its vision
#: and embedding models
PIXEL_VALUES, IMAGE_GRID_THW, IMAGE_FEATURES = "pixel_values", "image_grid_thw", "image_features"
#: symbolic dims of the image graphs: packed patches, images (or video chunks), merged image tokens
NUM_PATCHES, NUM_IMAGES, NUM_IMAGE_TOKENS = "num_patches", "num_images", "num_image_tokens"
#: the roles of an export's graphs besides the decoder (runtime_config.json ``graphs``), in the order they run
VISION_ROLE, EMBEDDING_ROLE = "vision", "embedding"

__all__ += ["EMBEDDING_ROLE", "IMAGE_FEATURES", "IMAGE_GRID_THW", "INPUTS_EMBEDS", "NUM_IMAGES", "NUM_IMAGE_TOKENS",
            "NUM_PATCHES", "PIXEL_VALUES", "VISION_ROLE"]


# ----------------------------------------------------------------------------------------- the tower's inputs
class K3VisionInputError(ValueError):
    """Images that do not fit the tower or the prompt; the message says what was expected."""


def _field(config: Any, name: str) -> Any:
    """`name` of a `K3VisionConfig` or of its dict (an export's ``runtime_config.json`` ``vision_config``): a
    runtime reads the dict, so that feeding an image keeps transformers out of its process."""
    return config[name] if isinstance(config, dict) else getattr(config, name)


def grid_list(grid_thws: Any, config: Any, n_patches: int | None = None) -> list[tuple[int, int, int]]:
    """`grid_thws` ([images, 3]: a tensor, an array or nested sequences) as (frames, rows, columns) tuples, each
    checked against the tower of `config` (rows and columns a multiple of the merge kernel, frames at most
    ``init_pos_emb_time``) and, given `n_patches`, against the packed pixels."""
    import numbers

    rows = grid_thws.tolist() if hasattr(grid_thws, "tolist") else [list(g) for g in grid_thws]
    kh, kw = _field(config, "merge_kernel_size")
    frames = _field(config, "init_pos_emb_time")
    grids = []
    for i, g in enumerate(rows):
        if len(g) != 3 or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in g):
            raise K3VisionInputError(f"grid_thws[{i}] must be three positive integers (frames, rows, columns), "
                                     f"got {g!r}")
        t, h, w = (int(v) for v in g)
        g = [t, h, w]
        if h % kh or w % kw:
            raise K3VisionInputError(f"grid_thws[{i}] = {g}: rows and columns must be multiples of the merge kernel "
                                     f"{[kh, kw]} (the processor pads images to them)")
        if t > frames:
            raise K3VisionInputError(f"grid_thws[{i}] = {g}: {t} frames, but the tower embeds at most "
                                     f"init_pos_emb_time = {frames} per chunk")
        grids.append((t, h, w))
    total = sum(t * h * w for t, h, w in grids)
    if n_patches is not None and total != n_patches:
        raise K3VisionInputError(f"grid_thws covers {total} patches but pixel_values has {n_patches}")
    return grids


def vision_feeds(config: Any, pixel_values: Any, grid_thws: Any) -> dict[str, Any]:
    """The feeds of an export's vision graph (numpy, by `PIXEL_VALUES` / `IMAGE_GRID_THW`) from what
    `K3ImageProcessor` returns (``pixel_values`` [patches, C, p, p] or already [patches, C * p * p], ``grid_thws``
    [images, 3]; tensors or arrays), checked as the PyTorch tower checks them (`grid_list`): the graph cannot refuse
    a bad grid with a message. `config`: a `K3VisionConfig` or its dict."""
    import numpy as np

    px, grid = (np.asarray(x.detach().cpu()) if hasattr(x, "detach") else np.asarray(x)
                for x in (pixel_values, grid_thws))
    c, p = _field(config, "in_channels"), _field(config, "patch_size")
    if not (px.ndim == 4 and px.shape[1:] == (c, p, p)) and not (px.ndim == 2 and px.shape[1] == c * p * p):
        raise K3VisionInputError(f"pixel_values must be [patches, {c}, {p}, {p}] or [patches, {c * p * p}] "
                                 f"(packed patches), got {list(px.shape)}")
    if grid.ndim != 2 or grid.shape[1:] != (3,) or not len(grid):
        raise K3VisionInputError(f"grid_thws must be [images, 3] with at least one image, got {list(grid.shape)}")
    grid_list(grid.tolist(), config, px.shape[0])
    return {PIXEL_VALUES: np.ascontiguousarray(px.reshape(px.shape[0], -1)),
            IMAGE_GRID_THW: np.ascontiguousarray(grid.astype(np.int64))}


__all__ += ["K3VisionInputError", "grid_list", "vision_feeds"]
