# Copyright 2026 the k3export authors. Apache-2.0.
"""The K3 decoder as an ONNX graph, built layer by layer from the config (mirror of ``modeling_k3.py``).

One graph serves prefill and decode: ``input_ids`` [batch, sequence_length] plus every layer's carried state in,
``logits`` [batch, sequence_length, vocab] plus every updated state out (the optional ``logits_to_keep`` input
keeps the last positions only); names, shapes and dtypes of the states are the contract's
(``k3export.modeling.contract``). The past length is the latent cache's length (MLA layers), so no
position input is needed. ``attention_mask`` int64 [batch, total_sequence_length] (1 = real token, 0 = padding;
on by default) carries PyTorch's mask semantics: a padded token is a no-op for the KDA conv and recurrent state
wherever it sits (left padding, or right padding as onnxruntime-genai feeds a batch); MLA hides padded keys and a
fully masked query row gives 0. ``layers=range(a, b)`` builds one pipeline stage (``contract.boundary_specs``).
``inputs_embeds=True`` (an image + text export) takes ``inputs_embeds`` [batch, sequence_length, hidden] in the
activation dtype instead of ``input_ids`` (the embedding graph's output: token embeddings with the image features
spliced in); the graph then holds no embedding table.

Precision follows the PyTorch model: weights and activations in the export dtype, fp32 islands where the model
computes in fp32 (KDA gate/beta/state, short-conv arithmetic, router, SiTU-GLU, RMSNorm statistics, attention
scores and softmax, Attention Residuals). MLA attends over the compressed latent with weight absorption:
``kv_b_proj`` is split into W_uk / W_uv, q_nope is mapped into latent space (q W_uk) and the context read from
c_kv is mapped out through W_uv, so neither prefill nor decode expands per-head K/V. A prompt longer than
`MLA_QUERY_BLOCK` tokens attends in blocks of queries, so no [B, H, T, S] score tensor is made.

Each graph form (`forms`) writes some parts in other ops (KDA as ``LinearAttention-27`` or ``GatedDeltaNet``, MLA
as ``Attention``); those variants sit beside the part they replace.

Long file: one builder mirrors the model top to bottom, and every graph form's variant of a part sits beside it,
sharing its projections and masks.

Routed experts are sparse: the expert weights are stacked ``[E, out, in]`` (the checkpoint's per-expert layout, or
MXFP4 bytes + scales) and ``k3::moe_experts`` reads only the experts ``k3::moe_route`` selected (``bodies.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from k3export.artifacts.graph_forms import V_MAJOR
from k3export.dtypes import FLOAT32, DType, dtype as as_dtype
from k3export.modeling import contract
from k3export.modeling.configuration_k3 import K3Config
from k3export.modeling.contract import (ATTENTION_MASK, BATCH, INPUT_IDS, INPUTS_EMBEDS, LOGITS, LOGITS_TO_KEEP,
                                       MLA_QUERY_BLOCK, SEQ, TOTAL, StateSpec)

from .builder import GraphBuilder
from .forms import INT64_MAX, KDA_ONE_TOKEN, MLA_QUERY_BLOCKS, GraphForm, graph_form
from .bodies import MS_DOMAIN
from .functions import DOMAIN, PLUGIN_NAMESPACE

F32 = TensorProto.FLOAT


class K3GraphBuilder(GraphBuilder):
    """Builds the decoder graph of a `K3Config` for one export dtype (fp32, bf16 or fp16)."""

    def __init__(self, config: K3Config, dtype: Any, debug_outputs: bool = False,
                 attention_mask: bool = True, layers: range | None = None, experts: str = "dense",
                 form: str | GraphForm | None = None, inputs_embeds: bool = False, state_window: int = 0,
                 quantize: bool = False, fp8: frozenset[str] = frozenset()) -> None:
        super().__init__()
        #: the weights kept in block FP8 (`fp8`): joined only with each other, dequantised by `fp8.keep_fp8`
        self.fp8 = frozenset(fp8)
        self.quantize = quantize  # the projections will be quantized (`quantize`): the routers stay apart, in fp32
        self.config = config
        self.inputs_embeds = inputs_embeds  # the first stage takes inputs_embeds instead of input_ids
        self.form = graph_form(form)  # `forms`: the standard form has no If (MLA attends in one call)
        self.experts = experts  # "dense" | "mxfp4" | "nvfp4": how the routed experts' weights are declared
        # a pipeline stage builds a contiguous range of layers; the cut tensors are `contract.boundary_specs`
        self.layers = range(config.num_hidden_layers) if layers is None else layers
        if not (0 <= self.layers.start < self.layers.stop <= config.num_hidden_layers and self.layers.step == 1):
            raise ValueError(f"layers {self.layers} is not a non-empty contiguous range of 0..{config.num_hidden_layers}")
        self.use_attention_mask = attention_mask
        self.attn_mask: str | None = None      # the attention_mask graph input (int64 [B, past + T])
        self._cur_mask: dict[int, str] = {}   # mask of the new tokens, by elem type: [N, 1]
        self._mla_mask: tuple[str, str] | None = None
        self._visible: str | None = None
        self._last_real: str | None = None
        self.debug_outputs = debug_outputs
        self.debug_names: list[str] = []
        self._debug: list[tuple[str, str]] = []
        self.act: DType = as_dtype(dtype)
        self.dt = self.act.onnx
        self.states: list[StateSpec] = []  # the contract's specs, in the order the graph declares them
        #: W of the state window (`contract`'s ``present_window.*``); 0: none
        self.state_window = int(state_window)
        self._windows: list[tuple[str, StateSpec]] = []  # (value, spec) of each window output
        self._shapes: dict[tuple, str] = {}
        self._depth_values: dict[str, str] = {}  # AttnRes source -> its fp32 [1, N, d] form
        self._mask: str | None = None

    # ------------------------------------------------------------------ small helpers
    @contextmanager
    def branch(self) -> Iterator[list]:
        """`collecting` for an ``If`` branch: the values the builder memoises (shapes, masks) made inside stay
        there, so that nothing outside the branch reads them."""
        memos = ("_shapes", "_cur_mask", "_depth_values", "_mla_mask", "_visible", "_last_real")
        saved = {m: copy.copy(getattr(self, m)) for m in memos}
        with self.collecting() as nodes:
            yield nodes
        for m, value in saved.items():
            setattr(self, m, value)

    def merge_kind(self, spec: Any) -> object:
        return all(p in self.fp8 for p in spec.parts)

    def weight_dtype(self, name: str) -> DType:
        return FLOAT32 if contract.keeps_fp32(name) else self.act

    def w(self, name: str, shape: tuple[int, ...]) -> str:
        return self.weight(name, shape, self.weight_dtype(name))

    def cast(self, x: str, frm: int, to: int) -> str:
        return x if frm == to else self.op("Cast", [x], to=to)

    def round_trip(self, x: str) -> str:
        """fp32 value rounded to the model dtype and back (where the model does `.to(dtype)` then `.float()`)."""
        if self.dt == F32:
            return x
        return self.cast(self.cast(x, F32, self.dt), self.dt, F32)

    def w_as(self, name: str, shape: tuple[int, ...], to: int) -> str:
        src = self.w(name, shape)
        return self.cast(src, self.weight_dtype(name).onnx, to)

    def linear(self, x: str, name: str, out_f: int, in_f: int) -> str:
        """x [N, in] (model dtype) @ W^T, W stored as in the checkpoint [out, in]."""
        return self.op("Gemm", [x, self.w_as(name, (out_f, in_f), self.dt)], transB=1)

    def rmsnorm(self, x: str, name: str, dim: int, eps: float, x_dtype: int | None = None) -> str:
        x_dtype = self.dt if x_dtype is None else x_dtype
        scale = self.w_as(name, (dim,), x_dtype)
        return self.op("RMSNormalization", [x, scale], axis=-1, epsilon=float(eps), stash_type=1)

    def shape_of(self, dims: list) -> str:
        """A shape tensor from a mix of [batch, seq] pieces (names of int64 [k] tensors) and ints."""
        key = tuple(dims)
        if key not in self._shapes:  # one Concat per distinct shape, shared by every Reshape that needs it
            parts = [d if isinstance(d, str) else self.const([d]) for d in dims]
            self._shapes[key] = parts[0] if len(parts) == 1 else self.op("Concat", parts, axis=0)
        return self._shapes[key]

    def reshape(self, x: str, dims: list) -> str:
        return self.op("Reshape", [x, self.shape_of(dims)])

    def silu(self, x: str) -> str:
        return self.op("Mul", [x, self.op("Sigmoid", [x])])

    def glu(self, gate: str, up: str) -> str:
        c = self.config
        if c.hidden_act == "situ":
            return self.op("situ_glu", [gate, up], domain=DOMAIN, beta1=float(c.activation_situ_beta),
                           beta2=float(c.activation_situ_linear_beta), plugin_namespace=PLUGIN_NAMESPACE)
        return self.op("Mul", [self.silu(gate), up])

    # ------------------------------------------------------------------ the model
    def build(self) -> None:
        c = self.config
        d = c.hidden_size
        first, last = self.layers.start == 0, self.layers.stop == c.num_hidden_layers
        bank: list[str] = []
        if first and self.inputs_embeds:
            embeds = self.add_input(INPUTS_EMBEDS, self.dt, [BATCH, SEQ, d])
            self.bt = self.op("Slice", [self.op("Shape", [embeds]), self.const([0]), self.const([2])])   # [B, T]
            h = self.reshape(embeds, [-1, d])
        elif first:
            ids = self.add_input(INPUT_IDS, TensorProto.INT64, [BATCH, SEQ])
            self.bt = self.op("Shape", [ids])                                                 # [B, T]
            h = self.reshape(self.op("Gather", [self.w("model.embed_tokens.weight", (c.vocab_size, d)), ids]), [-1, d])
        else:
            cut = {b.kind: b for b in contract.boundary_specs(c, self.layers.start)}
            hidden = self.add_input(cut["hidden"].input, self.dt, list(cut["hidden"].shape))
            self.bt = self.op("Slice", [self.op("Shape", [hidden]), self.const([0]), self.const([2])])
            h = self.reshape(hidden, [-1, d])                                                 # [N, d], N = B*T
            if "attn_res_blocks" in cut:
                spec = cut["attn_res_blocks"]
                blocks = self.add_input(spec.input, self.dt, list(spec.shape))
                parts = self.op("Split", [blocks], n_out=spec.shape[0], axis=0, num_outputs=spec.shape[0])
                bank = [self.reshape(x, [-1, d]) for x in ([parts] if spec.shape[0] == 1 else parts)]
        self.b = self.op("Slice", [self.bt, self.const([0]), self.const([1])])
        self.t = self.op("Slice", [self.bt, self.const([1]), self.const([2])])
        if self.use_attention_mask:
            self.attn_mask = self.add_input(ATTENTION_MASK, TensorProto.INT64, [BATCH, TOTAL])

        if c.use_attn_res:
            block = c.attn_res_block_size
            prefix: str | None = h
            for i in self.layers:
                self.scope = f"layers.{i}"
                p = f"model.layers.{i}."
                x = self.aggregate(bank + [prefix], p + "self_attention_res") if bank else prefix
                if i % block == 0:
                    bank.append(prefix)
                    prefix = None                                          # zeros: 0 + a == a
                a = self.attention(i, x)
                prefix = a if prefix is None else self.op("Add", [prefix, a])
                y = self.aggregate(bank + [prefix], p + "mlp_res")
                prefix = self.op("Add", [prefix, self.ffn(i, y)])
                if self.debug_outputs:  # the equivalent plain residual stream, as output_hidden_states
                    total = bank[0] if bank else prefix
                    for v in bank[1:] + [prefix]:
                        total = self.op("Add", [total, v])
                    self._debug.append((total, f"hidden_states.{i}"))
            h = prefix
        else:
            for i in self.layers:
                self.scope = f"layers.{i}"
                h = self.op("Add", [h, self.attention(i, h)])
                h = self.op("Add", [h, self.ffn(i, h)])
                if self.debug_outputs:
                    self._debug.append((h, f"hidden_states.{i}"))
        self.scope = "final"
        declared = {s.name for s in self.states}
        for spec in contract.state_specs(c, self.layers):  # a contract state no layer updates is carried unchanged
            if spec.name not in declared:
                self.present(spec, self.state(spec.layer, spec.kind)[1])
        n_states = len(self.outputs)
        if last:
            if c.use_attn_res:
                h = self.aggregate(bank + [h], "model.output_attn_res")
            keep = self.add_optional_input(LOGITS_TO_KEEP, TensorProto.INT64, 0)  # the last `keep` positions, 0: all
            start = self.op("Neg", [self.op("Unsqueeze", [keep, self.const([0])])])
            h = self.reshape(self.op("Slice", [self.reshape(h, [self.b, -1, d]), start, self.const([INT64_MAX]),
                                               self.const([1])]), [-1, d])
            h = self.rmsnorm(h, "model.norm.weight", d, c.rms_norm_eps)
            logits = self.linear(h, "lm_head.weight", c.vocab_size, d)
            self.add_output(self.reshape(logits, [self.b, -1, c.vocab_size]), LOGITS, self.dt,
                            [BATCH, SEQ, c.vocab_size])
        else:
            cut = {b.kind: b for b in contract.boundary_specs(c, self.layers.stop)}
            self.add_output(self.reshape(h, [self.bt, d]), cut["hidden"].output, self.dt, list(cut["hidden"].shape))
            if "attn_res_blocks" in cut:
                spec = cut["attn_res_blocks"]
                stacked = self.op("Concat", [self.op("Unsqueeze", [self.reshape(x, [self.bt, d]), self.const([0])])
                                             for x in bank], axis=0)
                self.add_output(stacked, spec.output, self.dt, list(spec.shape))
        # the model's outputs (logits, or the cut tensors) first, then the states in layer order, then their windows
        self.outputs[:] = self.outputs[n_states:] + self.outputs[:n_states]
        for value, spec in self._windows:
            self.add_output(value, spec.window, as_dtype(spec.resolved_dtype(self.act.name)).onnx,
                            list(spec.window_shape(self.state_window)))
        for value, name in self._debug:  # then the optional per-layer debug outputs
            self.add_output(self.reshape(value, [self.bt, d]), name, self.dt, [BATCH, SEQ, d])
            self.debug_names.append(name)
        self.merge_projections()

    def aggregate(self, sources: list[str], prefix: str) -> str:
        """Attention Residuals: softmax over depth of (gamma*w).v_i/rms(v_i), values raw; fp32."""
        c = self.config
        d = c.hidden_size
        if self.form.ort_contrib:
            return self.aggregate_side_by_side(sources, prefix)
        for v in sources:
            if v not in self._depth_values:
                self._depth_values[v] = self.op("Unsqueeze", [self.cast(v, self.dt, F32), self.const([0])])
        vals = [self._depth_values[v] for v in sources]
        vals = vals[0] if len(vals) == 1 else self.op("Concat", vals, axis=0)         # [S, N, d]
        # keys . (gamma * w) = RMSNorm(values) with scale gamma * w, summed over d (the product folds at load)
        gw = self.op("Mul", [self.w_as(prefix + "_norm.weight", (d,), F32),
                             self.reshape(self.w_as(prefix + "_proj.weight", (1, d), F32), [d])])
        keys = self.op("RMSNormalization", [vals, gw], axis=-1, epsilon=float(c.rms_norm_eps), stash_type=1)
        logits = self.op("ReduceSum", [keys, self.const([-1])], keepdims=1)             # [S, N, 1]
        alpha = self.op("Softmax", [logits], axis=0)
        out = self.op("ReduceSum", [self.op("Mul", [alpha, vals]), self.const([0])], keepdims=0)
        return self.cast(out, F32, self.dt)

    def aggregate_side_by_side(self, sources: list[str], prefix: str) -> str:
        """`aggregate` in ONNX Runtime's contrib ops (the ort form), five nodes against seven: the S sources side by
        side [N, S*d] (no stacking axis, so no ``Unsqueeze``), each one's RMSNorm with the scale gamma*w
        (``BranchwiseRMSNorm``), the logits as one product with S blocks of d ones [S*d, S], softmax over depth,
        and the weighted sum (``HyperConnectionPreMix``). The library's `fusions.fuse_attn_res` matches `aggregate`'s
        pattern, not this one."""
        c = self.config
        d, S = c.hidden_size, len(sources)
        vals = [self.cast(v, self.dt, F32) for v in sources]
        flat = vals[0] if S == 1 else self.op("Concat", vals, axis=-1)                     # [N, S*d]
        gw = self.op("Mul", [self.w_as(prefix + "_norm.weight", (d,), F32),
                             self.reshape(self.w_as(prefix + "_proj.weight", (1, d), F32), [d])])
        keys = self.op("BranchwiseRMSNorm", [flat, gw], domain=MS_DOMAIN, num_branches=S,
                       epsilon=float(c.rms_norm_eps))
        logits = self.op("MatMul", [keys, self.const(np.kron(np.eye(S), np.ones((d, 1))), F32)])   # [N, S]
        alpha = self.op("Softmax", [logits], axis=-1)
        out = self.op("HyperConnectionPreMix", [flat, alpha], domain=MS_DOMAIN, num_branches=S, reduction_scale=1.0)
        return self.cast(out, F32, self.dt)

    def attention(self, i: int, x: str) -> str:
        c = self.config
        xn = self.rmsnorm(x, f"model.layers.{i}.input_layernorm.weight", c.hidden_size, c.rms_norm_eps)
        return self.mla(i, xn) if c.attn_types[i] == "mla" else self.kda(i, xn)

    def ffn(self, i: int, y: str) -> str:
        c = self.config
        p = f"model.layers.{i}."
        yn = self.rmsnorm(y, p + "post_attention_layernorm.weight", c.hidden_size, c.rms_norm_eps)
        if c.mlp_types[i] == "dense":
            return self.mlp(yn, p + "mlp.", c.hidden_size, c.intermediate_size)
        return self.moe(yn, p + "block_sparse_moe.")

    def mlp(self, x: str, p: str, d: int, inter: int) -> str:
        gate = self.linear(x, p + "gate_proj.weight", inter, d)
        up = self.linear(x, p + "up_proj.weight", inter, d)
        return self.linear(self.glu(gate, up), p + "down_proj.weight", d, inter)

    # ------------------------------------------------------------------ KDA
    def state(self, i: int, kind: str) -> tuple[StateSpec, str]:
        """Declare layer `i`'s contract state `kind` as a graph input; returns (spec, input name)."""
        spec = next(sp for sp in contract.layer_state_specs(self.config, i) if sp.kind == kind)
        elem = as_dtype(spec.resolved_dtype(self.act.name)).onnx
        self.states.append(spec)
        return spec, self.add_input(spec.name, elem, list(spec.shape))

    def present(self, spec: StateSpec, value: str) -> None:
        self.add_output(value, spec.present, as_dtype(spec.resolved_dtype(self.act.name)).onnx, list(spec.present_shape))

    def stacked(self, name: str, parts: list[str], part_shape: tuple[int, ...]) -> str:
        """Checkpoint tensors `parts` (same shape) one after the other along axis 0: one weight."""
        return self.weight(name, (len(parts) * part_shape[0], *part_shape[1:]), self.weight_dtype(parts[0]), parts,
                           (part_shape[0],) * len(parts))

    def short_conv(self, i: int, x: str) -> str:
        """Causal depthwise conv + SiLU of the q, k, v projections at once over [conv_state | x]; x [N, 3C] (model
        dtype) -> [B, T, 3C]. Channels last: one Mul per tap on shifted Slices, summed (ONNX Runtime's grouped
        ``Conv`` with 3C groups is slow at one token: decode is ~4% faster on big_cfg). The conv state is the
        contract's one tensor per layer, [B, 3C, kernel-1]."""
        c = self.config
        C3, kernel = 3 * c.kda_num_heads * c.kda_head_dim, c.kda_conv_kernel
        km1 = kernel - 1
        spec, state = self.state(i, "conv_state")
        if self.form.kda_ops or self.form.ort_contrib:
            return self.conv_op(i, x, spec, state)
        full = self.op("Concat", [self.op("Transpose", [state], perm=[0, 2, 1]), self.reshape(x, [self.bt, C3])],
                       axis=1)                                                            # [B, km1 + T, 3C]
        p = f"model.layers.{i}.self_attn."
        weight = self.reshape(self.stacked(p + "qkv_conv1d.weight", [f"{p}{w}_conv1d.weight" for w in "qkv"],
                                           (C3 // 3, 1, kernel)), [C3, kernel])
        taps = self.cast(self.op("Transpose", [weight], perm=[1, 0]), self.weight_dtype(p + "q_conv1d.weight").onnx,
                         F32)                                                             # [kernel, 3C]
        full32 = self.cast(full, self.dt, F32)
        terms = []
        for j in range(kernel):  # y[t] = sum_j w[j] * full[t + j]
            end = self.const([j - km1] if j < km1 else [INT64_MAX])
            shifted = self.op("Slice", [full32, self.const([j]), end, self.const([1])])
            tap = self.op("Slice", [taps, self.const([j]), self.const([j + 1]), self.const([0])])
            terms.append(self.op("Mul", [shifted, tap]))
        y = self.cast(self.silu(self.op("Sum", terms)), F32, self.dt)                    # [B, T, 3C]
        if self.attn_mask is None:
            window = self.op("Slice", [full, self.const([-km1]), self.const([INT64_MAX]), self.const([1])])
        else:  # the window that ends at each row's last real token (trailing padding leaves the state alone)
            idx = self.op("Add", [self.reshape(self.last_real(), [-1, 1, 1]), self.const([[j] for j in range(km1)])])
            idx = self.op("Expand", [idx, self.shape_of([self.b, km1, C3])])                 # [B, km1, 3C]
            window = self.op("GatherElements", [full, idx], axis=1)
        self.present(spec, self.op("Transpose", [window], perm=[0, 2, 1]))
        if self.state_window:
            self._windows.append((self.conv_window(full, km1, C3), spec))
        return y

    def conv_op(self, i: int, x: str, spec: StateSpec, state: str) -> str:
        """`short_conv` as one ``CausalConvWithState-27`` (the ort form: ``com.microsoft::CausalConvWithState``, the
        same inputs, outputs and maths at opset 24) (fp32, SiLU fused) over channels-first [B, 3C, T]: the
        op's state layout (B, C, kernel-1) is the contract's conv state, so it goes in and out as it is. With an
        attention mask the present is the window that ends at each row's last real token (right padding), which
        the op's own present (the last kernel-1 positions) is not: that window is gathered, as `short_conv` does."""
        c = self.config
        C3, kernel = 3 * c.kda_num_heads * c.kda_head_dim, c.kda_conv_kernel
        km1 = kernel - 1
        p = f"model.layers.{i}.self_attn."
        weight = self.stacked(p + "qkv_conv1d.weight", [f"{p}{w}_conv1d.weight" for w in "qkv"], (C3 // 3, 1, kernel))
        weight = self.cast(weight, self.weight_dtype(p + "q_conv1d.weight").onnx, F32)        # [3C, 1, kernel]
        xt = self.op("Transpose", [self.reshape(x, [self.bt, C3])], perm=[0, 2, 1])          # [B, 3C, T]
        y, last = self.op("CausalConvWithState", [self.cast(xt, self.dt, F32), weight, "",
                                                  self.cast(state, self.dt, F32)], n_out=2, activation="silu",
                          domain="" if self.form.kda_ops else MS_DOMAIN)
        y = self.op("Transpose", [self.cast(y, F32, self.dt)], perm=[0, 2, 1])             # [B, T, 3C]
        if self.attn_mask is None and not self.state_window:
            self.present(spec, self.cast(last, F32, self.dt))
            return y
        if self.attn_mask is not None and self.form.gated_delta_net and not self.state_window:
            # as the KDA core: one token (decode) keeps the op's present (a padded row the state it came with),
            # the gather is for longer calls only
            real = self.reshape(self.current_mask(TensorProto.BOOL), [-1, 1, 1])                # [B, 1, 1]
            with self.branch() as one_token:
                kept = self.op("Where", [real, self.cast(last, F32, self.dt), state])
            with self.branch() as many:
                gathered = self.conv_present(self.op("Concat", [state, xt], axis=2), km1, C3)
            self.present(spec, self.if_one_token(("conv_present_one", one_token, [kept]),
                                                 ("conv_present_gathered", many, [gathered]), [self.dt]))
            return y
        full = self.op("Concat", [state, xt], axis=2)                                     # [B, 3C, km1 + T]
        self.present(spec, self.cast(last, F32, self.dt) if self.attn_mask is None else
                     self.conv_present(full, km1, C3))
        if self.state_window:
            self._windows.append((self.conv_window(self.op("Transpose", [full], perm=[0, 2, 1]), km1, C3), spec))
        return y

    def conv_present(self, full: str, km1: int, C3: int) -> str:
        """The conv state that ends at each row's last real token: the window of `full` [B, 3C, km1 + T]."""
        idx = self.op("Add", [self.reshape(self.last_real(), [-1, 1, 1]), self.const([[list(range(km1))]])])
        idx = self.op("Expand", [idx, self.shape_of([self.b, C3, km1])])                     # [B, 3C, km1]
        return self.op("GatherElements", [full, idx], axis=2)

    def conv_window(self, full: str, km1: int, C3: int) -> str:
        """The conv state after each of the call's last W positions before its end, [W, B, 3C, km1]: slot j is the
        window of `full` [B, km1 + T, 3C] that starts at T - W + j, clamped to the last real token (as the present
        is) and to 0 (a slot before the call's first token: the state it started from)."""
        W = self.state_window
        starts = self.op("Unsqueeze", [self.op("Add", [self.t, self.const([j - W for j in range(W)])]),
                                       self.const([0])])                                  # [1, W]
        if self.attn_mask is not None:
            starts = self.op("Min", [starts, self.reshape(self.last_real(), [-1, 1])])    # [B, W]
        starts = self.op("Max", [starts, self.const(0)])
        idx = self.op("Add", [self.op("Unsqueeze", [starts, self.const([2])]), self.const([[list(range(km1))]])])
        idx = self.op("Expand", [self.reshape(idx, [-1, W * km1, 1]), self.shape_of([self.b, W * km1, C3])])
        slots = self.reshape(self.op("GatherElements", [full, idx], axis=1), [self.b, W, km1, C3])
        return self.op("Transpose", [slots], perm=[1, 0, 3, 2])

    def kda_windowed(self, inputs: list[str], s0: str, scale: float) -> tuple[str, str, str]:
        """`kda_window`, and in a form with branches an ``If`` that runs a one-token call (plain decode, a verify
        round with no draft) as one kda op: its window is the input state in every slot, what `kda_window` gives
        then, so the window costs such calls nothing."""
        if not self.form.branches:
            return self.kda_window(inputs, s0, scale)
        slots = self.op("Concat", [self.const([self.state_window]), self.op("Shape", [s0])], axis=0)
        with self.collecting() as one:
            o1, s1 = self.op("kda", [*inputs, s0], n_out=2, domain=DOMAIN, scale=scale,
                             plugin_namespace=PLUGIN_NAMESPACE)
            w1 = self.op("Expand", [self.op("Unsqueeze", [s0, self.const([0])]), slots])
        with self.collecting() as general:
            outs = self.kda_window(inputs, s0, scale)
        types = (self.dt, F32, F32)  # o, final state, window
        branch = [helper.make_graph(nodes, self.fresh(name), [],
                                    [helper.make_tensor_value_info(v, t, None) for v, t in zip(values, types)])
                  for nodes, name, values in ((one, KDA_ONE_TOKEN, (o1, s1, w1)), (general, "kda_window", outs))]
        one_token = self.op("Equal", [self.op("Squeeze", [self.t, self.const([0])]), self.const(1)])
        o, s1, window = self.op("If", [one_token], n_out=3, then_branch=branch[0], else_branch=branch[1])
        return o, s1, window

    def kda_window(self, inputs: list[str], s0: str, scale: float) -> tuple[str, str, str]:
        """`k3::kda` over the call that also gives the state after each of its last W positions before the end:
        (o, final state, window [W, B, H, K, V]). The call is fed W identity positions in front (g = 0: no decay,
        beta = 0: no write, which leave the state exactly as it was), then run as one op over its first T positions
        and one op per position over the last W; the window stacks the states between them. Only the kda op's own
        contract is used, so every runtime (function body, ORT kernel, TensorRT plugin) computes it."""
        W = self.state_window
        pads = [self.const([0, W, 0, 0, 0, 0, 0, 0]), self.const([0, W, 0, 0, 0, 0])]  # [B, T, H, K], beta [B, T, H]
        padded = [self.op("Pad", [x, pads[n == 4]]) for n, x in enumerate(inputs)]
        outs, states, state = [], [], s0
        for j in range(W + 1):  # positions [0, T) of the padded call, then T + j - 1 for j = 1 .. W
            start = self.const([0]) if j == 0 else self.op("Add", [self.t, self.const([j - 1])])
            end = self.t if j == 0 else self.op("Add", [self.t, self.const([j])])
            part = [self.op("Slice", [x, start, end, self.const([1])]) for x in padded]
            o, state = self.kda_core(part, state, scale)
            outs.append(o)
            states.append(state)
        o = self.op("Slice", [self.op("Concat", outs, axis=1), self.const([W]), self.const([INT64_MAX]),
                              self.const([1])])
        window = self.op("Concat", [self.op("Unsqueeze", [x, self.const([0])]) for x in states[:-1]], axis=0)
        return o, state, window

    def kda_core(self, inputs: list[str], s0: str, scale: float) -> tuple[str, str]:
        """(o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32) of the delta rule over q, k, v, g [B, T, H, *]
        and beta [B, T, H] from state `s0`: one ``k3::kda`` node, or in a form with `GraphForm.kda_ops` one
        ``LinearAttention-27`` in fp32 (decay per key dimension; its state is [B, H, K, V] as ours). Its
        ``decay`` and ``beta`` are of q's type, so a bf16 / fp16 export runs it in fp32, as the kda op does."""
        if not self.form.kda_ops:
            return self.op("kda", [*inputs, s0], n_out=2, domain=DOMAIN, scale=scale, plugin_namespace=PLUGIN_NAMESPACE)
        q, k, v, g, beta = inputs
        flat = [self.op("Reshape", [self.cast(x, dt, F32), self.const([0, 0, -1])])
                for x, dt in ((q, self.dt), (k, self.dt), (v, self.dt), (g, F32))]                # [B, T, H*D]
        H = self.config.kda_num_heads
        o, s1 = self.op("LinearAttention", [*flat[:3], s0, flat[3], beta], n_out=2, update_rule="gated_delta",
                        q_num_heads=H, kv_num_heads=H, scale=scale)
        return self.op("Reshape", [self.cast(o, F32, self.dt), self.op("Shape", [v])]), s1

    def l2norm(self, x: str) -> str:
        """fp32 in: x / sqrt(sum(x^2) + 1e-6) over the last dim."""
        ss = self.op("ReduceSum", [self.op("Mul", [x, x]), self.const([-1])], keepdims=1)
        return self.op("Div", [x, self.op("Sqrt", [self.op("Add", [ss, self.const(1e-6, F32)])])])

    def kda(self, i: int, x: str) -> str:
        c = self.config
        d, H, K = c.hidden_size, c.kda_num_heads, c.kda_head_dim
        HK = H * K
        p = f"model.layers.{i}.self_attn."
        if self.attn_mask is not None:  # padded tokens: zero input (and beta below), as the PyTorch model
            x = self.op("Mul", [x, self.current_mask(self.dt)])
        w_qkv = self.stacked(p + "qkv_proj.weight", [f"{p}{w}_proj.weight" for w in "qkv"], (HK, d))
        qkv = self.short_conv(i, self.op("Gemm", [x, w_qkv], transB=1))                  # [B, T, 3HK]
        # the forget gate's and beta's logits, fp32 [N, HK] and [N, H]
        f = self.cast(self.linear(self.linear(x, p + "f_a_proj.weight", K, d), p + "f_b_proj.weight", HK, K),
                      self.dt, F32)
        beta = self.cast(self.linear(x, p + "b_proj.weight", H, d), self.dt, F32)
        spec, s0 = self.state(i, "recurrent_state")
        if self.form.gated_delta_net and not self.state_window:
            o, s1 = self.gated_delta_net(i, qkv, f, beta, s0)
            self.present(spec, s1)
            return self.kda_output(i, x, o)
        q, k, v, g, beta = self.kda_inputs(i, qkv, f, beta)
        if self.state_window:
            o, s1, window = self.kda_windowed([q, k, v, g, beta], s0, float(K ** -0.5))
            self._windows.append((window, spec))
        else:
            o, s1 = self.kda_core([q, k, v, g, beta], s0, float(K ** -0.5))
        self.present(spec, s1)
        return self.kda_output(i, x, o)

    def kda_inputs(self, i: int, qkv: str, f: str, beta: str) -> list[str]:
        """(q, k, v [B, T, H, K] in the model dtype, q and k L2-normalised in fp32; the decay g [B, T, H, K] and
        beta [B, T, H] in fp32) of the delta rule from the conv's packed q, k, v [B, T, 3HK] and the gate's and
        beta's logits (`kda`); padded tokens get g = beta = 0 (no decay, no write)."""
        c = self.config
        H, K = c.kda_num_heads, c.kda_head_dim
        HK = H * K
        p = f"model.layers.{i}.self_attn."
        q, k, v = self.op("Split", [qkv, self.const([HK, HK, HK])], n_out=3, axis=-1)
        q = self.cast(self.l2norm(self.reshape(self.cast(q, self.dt, F32), [self.bt, H, K])), F32, self.dt)
        k = self.cast(self.l2norm(self.reshape(self.cast(k, self.dt, F32), [self.bt, H, K])), F32, self.dt)
        v = self.reshape(v, [self.bt, H, K])
        f = self.reshape(self.op("Add", [f, self.w(p + "dt_bias", (HK,))]), [self.bt, H, K])
        bound = c.linear_attn_config["gate_lower_bound"]
        if bound is not None:
            a_log = self.w(p + "A_log", (max(H, K),))
            a = self.reshape(self.op("Exp", [self.op("Slice", [a_log, self.const([0]), self.const([H])])]),
                             [1, 1, H, 1])
            g = self.op("Mul", [self.op("Sigmoid", [self.op("Mul", [a, f])]), self.const(float(bound), F32)])
        else:
            a = self.op("Exp", [self.w(p + "A_log", (1, 1, H, 1))])
            g = self.op("Mul", [self.op("Neg", [a]), self.op("Softplus", [f])])
        beta = self.op("Sigmoid", [beta])
        if self.attn_mask is not None:  # padded tokens: no write and no decay
            beta = self.op("Mul", [beta, self.current_mask(F32)])
            g = self.op("Mul", [g, self.reshape(self.current_mask(F32), [self.bt, 1, 1])])
        return [q, k, v, g, self.reshape(beta, [self.bt, H])]

    def kda_output(self, i: int, x: str, o: str) -> str:
        """o [B, T, H, V] (model dtype) -> the layer's output [N, d]: per-head RMSNorm, times sigmoid(gate), o_proj."""
        c = self.config
        d, H, K = c.hidden_size, c.kda_num_heads, c.kda_head_dim
        HK = H * K
        p = f"model.layers.{i}.self_attn."
        if c.linear_attn_config["use_full_rank_gate"]:
            gate = self.linear(x, p + "g_proj.weight", HK, d)
        else:
            gate = self.linear(self.linear(x, p + "g_a_proj.weight", K, d), p + "g_b_proj.weight", HK, K)
        if self.form.ort_contrib:  # per head (the scale's K columns of the [N, HK] rows), gate fused, fp32
            o = self.op("GatedRMSNorm", [self.reshape(self.cast(o, self.dt, F32), [-1, HK]),
                                         self.w_as(p + "o_norm.weight", (K,), F32), self.cast(gate, self.dt, F32)],
                        domain=MS_DOMAIN, activation="sigmoid", epsilon=float(c.rms_norm_eps))
            return self.linear(self.cast(o, F32, self.dt), p + "o_proj.weight", d, HK)
        on = self.rmsnorm(self.cast(o, self.dt, F32), p + "o_norm.weight", K, c.rms_norm_eps, x_dtype=F32)
        gate = self.op("Sigmoid", [self.reshape(self.cast(gate, self.dt, F32), [self.bt, H, K])])
        o = self.cast(self.reshape(self.op("Mul", [on, gate]), [-1, HK]), F32, self.dt)
        return self.linear(o, p + "o_proj.weight", d, HK)

    def gated_delta_net(self, i: int, qkv: str, f: str, beta: str, s0: str) -> tuple[str, str]:
        """(o [B, T, H, V] or [B, T, HV] in the model dtype, final state [B, H, V, K] fp32) of KDA's core from the
        conv's packed q, k, v [B, T, 3HK], the gate's and beta's logits (`kda`) and the state `s0`. One token (decode):
        one ``com.microsoft::GatedDeltaNet`` (ONNX Runtime >= 1.32: CPU, CUDA and WebGPU kernels), which L2-normalises q
        and k (``qk_l2_norm``), computes the gate from f_b_proj's output with ``A_log`` and ``dt_bias`` in fp32
        (``'kda'``: K3's bounded sigmoid; ``'softplus'``: Kimi-Linear's) and beta's sigmoid, fed q, k, v packed (no
        split, no per-head reshapes). `s0` and the final state are V-major [B, H, V, K], GatedDeltaNet's own
        (`GraphForm.recurrent_axes`). More tokens: the k3 ``kda`` op (`kda_inputs`, `kda_core`), whose chunked body
        ONNX Runtime 1.32's CPU runs faster than GatedDeltaNet's prefill (1.3-2x at 64 tokens: docs/speed.md), the
        state transposed to its order and back. A padded token
        gets gate and beta logits of -1e30 in both: sigmoid gives exactly 0, so no decay and no write, as the other
        forms' zeroed g and beta."""
        c = self.config
        H, K = c.kda_num_heads, c.kda_head_dim
        HK = H * K
        p = f"model.layers.{i}.self_attn."
        if self.attn_mask is not None:
            off = self.op("Mul", [self.op("Sub", [self.current_mask(F32), self.const(1.0, F32)]),
                                  self.const(1e30, F32)])                                 # [N, 1]: 0 or -1e30
            f, beta = self.op("Add", [f, off]), self.op("Add", [beta, off])
        bound = c.linear_attn_config["gate_lower_bound"]
        if bound is not None:
            a_log = self.op("Slice", [self.w(p + "A_log", (max(H, K),)), self.const([0]), self.const([H])])
            gate = {"gate_activation": "kda", "gate_lower_bound": float(bound)}
        else:
            a_log = self.reshape(self.w(p + "A_log", (1, 1, H, 1)), [H])
            gate = {"gate_activation": "softplus"}
        f_heads, beta_heads = self.reshape(f, [self.bt, H, K]), self.reshape(beta, [self.bt, H])
        with self.branch() as one_token:
            off_capture = self.const([0], TensorProto.INT32)  # no compact transitions: ORT picks its fastest engine
            o_one, s1_one = self.op("GatedDeltaNet", [self.cast(qkv, self.dt, F32), "", "", "", f_heads, beta_heads,
                                                      s0, a_log, self.w(p + "dt_bias", (HK,)), "", off_capture],
                                    n_out=2, domain=MS_DOMAIN, qk_l2_norm=1, beta_activation="sigmoid",
                                    scale=float(K ** -0.5), update_rule="gated_delta", **gate)
            o_one = self.cast(o_one, F32, self.dt)                                       # [B, T, HV]
        with self.branch() as many:  # the kda op's state is the contract's [B, H, K, V]
            o_many, s1_k = self.kda_core(self.kda_inputs(i, qkv, f, beta),
                                         self.op("Transpose", [s0], perm=list(V_MAJOR)), float(K ** -0.5))
            s1_many = self.op("Transpose", [s1_k], perm=list(V_MAJOR))
        return self.if_one_token(("gated_delta_net", one_token, [o_one, s1_one]),
                                 ("kda_chunked", many, [o_many, s1_many]), [self.dt, F32])

    def if_one_token(self, one_token: tuple[str, list, list[str]], many: tuple[str, list, list[str]],
                     types: list[int]) -> Any:
        """An ``If`` on the call's length: the branch `one_token` (name, nodes, outputs) for one token, `many`
        else; its outputs of `types`."""
        one = self.op("Equal", [self.t, self.const([1])])                                      # [1]
        branches = [helper.make_graph(nodes, self.fresh(name), [],
                                      [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, types)])
                    for name, nodes, outs in (one_token, many)]
        return self.op("If", [one], n_out=len(types), then_branch=branches[0], else_branch=branches[1])

    def last_real(self) -> str:
        """[B] int64: 1 + the index of each row's last real token in this call (0 when it has none)."""
        if self._last_real is None:
            cur = self.reshape(self.current_mask(TensorProto.INT64), [self.b, -1])                # [B, T]
            pos = self.op("Range", [self.const(1), self.op("Add", [self.op("Squeeze", [self.t, self.const([0])]),
                                                                   self.const(1)]), self.const(1)])
            self._last_real = self.op("ReduceMax", [self.op("Mul", [cur, pos]), self.const([1])], keepdims=0)
        return self._last_real

    def current_mask(self, elem: int) -> str:
        """attention_mask[:, -T:] as [N, 1] of `elem` type (N = B*T rows of the flattened activations)."""
        if elem not in self._cur_mask:
            t_neg = self.op("Neg", [self.t])
            cur = self.op("Slice", [self.attn_mask, t_neg, self.const([INT64_MAX]), self.const([1])])   # [B, T]
            self._cur_mask[elem] = self.reshape(self.op("Cast", [cur], to=elem), [-1, 1])
        return self._cur_mask[elem]

    # ------------------------------------------------------------------ MLA
    def in_query_blocks(self, q: str, masks: list[str], attend: Any) -> str:
        """``attend(q, *masks)`` of q [B, H, T, D] (masks [..., T, S]), rows in blocks of at most `MLA_QUERY_BLOCK`
        when T exceeds it: n = ceil(T / block) blocks of ceil(T / n) rows (q and the masks padded with visible
        rows, dropped after), one ``Loop`` iteration each; one call otherwise (decode, short prompts). A form without
        branches (`forms.STANDARD`) attends in one call at every length."""
        if not self.form.branches:
            return attend(q, *masks)
        t = self.op("Squeeze", [self.t, self.const([0])])
        with self.collecting() as whole:
            whole_out = attend(q, *masks)
        with self.collecting() as blocked:
            n = self.op("Div", [self.op("Add", [t, self.const(MLA_QUERY_BLOCK - 1)]), self.const(MLA_QUERY_BLOCK)])
            rows = self.op("Div", [self.op("Sub", [self.op("Add", [t, n]), self.const(1)]), n])
            extra = self.op("Unsqueeze", [self.op("Sub", [self.op("Mul", [n, rows]), t]), self.const([0])])
            pad, rows_axis = self.op("Concat", [self.const([0]), extra], axis=0), self.const([-2])
            fill = [(True, TensorProto.BOOL), (1.0, F32)][:len(masks)]  # padded rows: visible, see a key
            padded = [self.op("Pad", [q, pad, "", rows_axis])] + [
                self.op("Pad", [m, pad, self.const(*f), rows_axis]) for m, f in zip(masks, fill)]
            it, cond = self.fresh("mla_block"), self.fresh("mla_cond")
            with self.collecting() as body:
                start = self.op("Unsqueeze", [self.op("Mul", [it, rows]), self.const([0])])
                end = self.op("Add", [start, self.op("Unsqueeze", [rows, self.const([0])])])
                out = attend(*[self.op("Slice", [x, start, end, rows_axis]) for x in padded])
                body.append(helper.make_node("Identity", [cond], [self.fresh("mla_cond_out")]))
            cond_out = body[-1].output[0]
            loop_graph = helper.make_graph(
                body, self.fresh("mla_block_body"),
                [helper.make_tensor_value_info(it, TensorProto.INT64, []),
                 helper.make_tensor_value_info(cond, TensorProto.BOOL, [])],
                [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                 helper.make_tensor_value_info(out, F32, None)])
            stacked = self.op("Loop", [n, self.const(True, TensorProto.BOOL)], body=loop_graph)  # [n, B, H, rows, r]
            # explicitly [n, B, H, rows, r]: the ONNX reference evaluator concatenates scan outputs on axis 0
            stacked = self.reshape(stacked, [self.op("Unsqueeze", [n, self.const([0])]), -1, self.op(
                "Slice", [self.op("Shape", [stacked]), self.const([-3]), self.const([INT64_MAX])])])
            dims = self.op("Shape", [stacked])
            merged = self.op("Reshape", [self.op("Transpose", [stacked], perm=[1, 2, 0, 3, 4]), self.op("Concat", [
                self.op("Slice", [dims, self.const([1]), self.const([3])]), self.const([-1]),
                self.op("Slice", [dims, self.const([4]), self.const([5])])], axis=0)])        # [B, H, n * rows, r]
            blocked_out = self.op("Slice", [merged, self.const([0]), self.op("Unsqueeze", [t, self.const([0])]),
                                            self.const([2])])
        branch = [helper.make_graph(nodes, self.fresh(name), [], [helper.make_tensor_value_info(value, F32, None)])
                  for nodes, name, value in ((blocked, MLA_QUERY_BLOCKS, blocked_out),
                                             (whole, "mla_all_queries", whole_out))]
        many = self.op("Greater", [t, self.const(MLA_QUERY_BLOCK)])
        return self.op("If", [many], then_branch=branch[0], else_branch=branch[1])

    def padding_mask(self, cached: str) -> tuple[str, str]:
        """(visible [B, 1, T, S] bool = causal & attention_mask[:, -S:], any [B, 1, T, 1] fp32 = the row sees
        some key); shared by all MLA layers. `cached`: the cache, S on axis -2 (`causal_mask`)."""
        if self._mla_mask is None:
            visible = self.visible_keys(cached)
            any_key = self.op("ReduceMax", [self.op("Cast", [visible], to=F32), self.const([-1])], keepdims=1)
            self._mla_mask = (visible, any_key)
        return self._mla_mask

    def visible_keys(self, cached: str) -> str:
        """[B, 1, T, S] bool = causal & attention_mask[:, -S:]; shared by all MLA layers (`padding_mask`)."""
        if self._visible is None:
            s_len = self.op("Slice", [self.op("Shape", [cached]), self.const([-2]), self.const([-1])])
            keys = self.op("Slice", [self.attn_mask, self.op("Neg", [s_len]), self.const([INT64_MAX]),
                                     self.const([1])])                                         # [B, S]
            keys = self.op("Unsqueeze", [self.op("Cast", [keys], to=TensorProto.BOOL), self.const([1, 2])])
            self._visible = self.op("And", [self.causal_mask(cached), keys])                     # [B, 1, T, S]
        return self._visible

    def causal_mask(self, cached: str) -> str:
        """[T, S] bool, key j visible from query i iff j <= past + i (past = S - T); shared by all MLA layers.
        `cached`: the cache, S on axis -2 (a present half, not the joined latent: the library's fused attention
        reads the halves, and nothing else then reads the join, `fusions.fuse_mla_attend`)."""
        if self._mask is None:
            s = self.op("Squeeze", [self.op("Slice", [self.op("Shape", [cached]), self.const([-2]), self.const([-1])]),
                                    self.const([0])])
            t = self.op("Squeeze", [self.t, self.const([0])])
            past = self.op("Sub", [s, t])
            kpos = self.op("Range", [self.const(0), s, self.const(1)])
            qpos = self.op("Range", [past, s, self.const(1)])
            self._mask = self.op("LessOrEqual", [self.op("Unsqueeze", [kpos, self.const([0])]),
                                                 self.op("Unsqueeze", [qpos, self.const([1])])])
        return self._mask

    def latent_cache(self, i: int, new: str, heads_axis: bool = False) -> tuple[str, str]:
        """Layer `i`'s cached latents with this call's `new` [B, T, L] appended: the contract's present key / value
        halves, each the past half with the new rows' half appended where it lies, and the whole latent [B, S, L]
        for the attention, those halves joined. Two copies of the cache a call (appending to the joined latent and
        splitting it again took four). Returns (the latent, the present key half); `heads_axis`: the latent as
        [B, 1, S, L], as the ``Attention`` op takes its one key head (no Squeeze and Unsqueeze between)."""
        w, L = contract.mla_kv_width(self.config), self.config.mla_latent_dim
        new = self.op("Unsqueeze", [new, self.const([1])])                                     # [B, 1, T, L]
        if 2 * w != L:
            new = self.op("Pad", [new, self.const([0, 0, 0, 0, 0, 0, 0, 1])])
        halves = []
        for kind, part in zip(("key", "value"), self.op("Split", [new, self.const([w, w])], n_out=2, axis=-1)):
            spec, past = self.state(i, kind)
            halves.append(self.op("Concat", [past, part], axis=2))                            # [B, 1, S, W]
            self.present(spec, halves[-1])
        joined = self.op("Concat", halves, axis=-1)                                            # [B, 1, S, 2W]
        if not heads_axis:
            joined = self.op("Squeeze", [joined, self.const([1])])                             # [B, S, 2W]
        if 2 * w != L:
            joined = self.op("Slice", [joined, self.const([0]), self.const([L]), self.const([3 if heads_axis else 2])])
        return joined, halves[0]

    def mla(self, i: int, x: str) -> str:
        c = self.config
        d, H = c.hidden_size, c.num_attention_heads
        nope, rope, vd, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        qk = nope + rope
        p = f"model.layers.{i}.self_attn."
        if c.q_lora_rank is None:
            q = self.linear(x, p + "q_proj.weight", H * qk, d)
        else:
            qa = self.rmsnorm(self.linear(x, p + "q_a_proj.weight", c.q_lora_rank, d), p + "q_a_layernorm.weight",
                              c.q_lora_rank, 1e-6)
            q = self.linear(qa, p + "q_b_proj.weight", H * qk, c.q_lora_rank)
        q = self.op("Transpose", [self.reshape(q, [self.bt, H, qk])], perm=[0, 2, 1, 3])      # [B, H, T, qk]
        kva = self.linear(x, p + "kv_a_proj_with_mqa.weight", r + rope, d)
        c_kv, k_pe = self.op("Split", [kva, self.const([r, rope])], n_out=2, axis=-1)
        c_kv = self.rmsnorm(c_kv, p + "kv_a_layernorm.weight", r, 1e-6)
        new_latent = self.reshape(self.op("Concat", [c_kv, k_pe], axis=-1), [self.bt, r + rope])
        latent, cached = self.latent_cache(i, new_latent, self.form.mla_attention)        # [B, (1,) S, r+rope]
        # weight absorption: kv_b_proj [H*(nope+v), r] -> W_uk [H, nope, r], W_uv [H, v, r]
        wkv = self.reshape(self.w_as(p + "kv_b_proj.weight", (H * (nope + vd), r), F32), [H, nope + vd, r])
        w_uk = self.op("Slice", [wkv, self.const([0]), self.const([nope]), self.const([1])])
        w_uv_t = self.op("Transpose", [self.op("Slice", [wkv, self.const([nope]), self.const([nope + vd]),
                                                         self.const([1])])], perm=[0, 2, 1])  # [H, r, v]
        qf = self.cast(q, self.dt, F32)
        q_nope, q_pe = self.op("Split", [qf, self.const([nope, rope])], n_out=2, axis=-1)
        q_lat = self.op("Concat", [self.op("MatMul", [q_nope, w_uk]), q_pe], axis=-1)      # [B, H, T, r+rope]
        lat = self.cast(latent, self.dt, F32)
        if self.form.mla_attention:
            o = self.mla_attention_op(q_lat, lat, cached, qk, r)
        else:
            o = self.mla_attend(q_lat, lat, cached, qk, r)
        o = self.op("MatMul", [o, w_uv_t])                                                  # [B, H, T, v]
        o = self.reshape(self.op("Transpose", [self.cast(o, F32, self.dt)], perm=[0, 2, 1, 3]), [-1, H * vd])
        if c.mla_use_output_gate:
            gate = self.op("Sigmoid", [self.cast(self.linear(x, p + "g_proj.weight", H * vd, d), self.dt, F32)])
            o = self.cast(self.op("Mul", [self.cast(o, self.dt, F32), gate]), F32, self.dt)
        return self.linear(o, p + "o_proj.weight", d, H * vd)

    def mla_attention_op(self, q_lat: str, lat: str, cached: str, qk: int, r: int) -> str:
        """The absorbed attention as one ``Attention`` (opset 23/24): the H query heads [B, H, T, r+rope] over one
        key / value head (``kv_num_heads=1``), keys the whole latent `lat` [B, 1, S, r+rope] and values its first `r`
        columns, scale qk^-0.5 (the heads' own width, not the latent's). The mask is a boolean [T, S] (causal) or
        [B, 1, T, S] (causal and attention_mask): given explicitly because the op's ``is_causal`` aligns the
        triangle to the top left, wrong once there is a past. A row that sees no key gives 0 in ONNX Runtime and
        the reference evaluator alike (PyTorch: nan_to_num(0)). Long prompts attend in query blocks in a form with
        branches, as `mla_attend`. Returns [B, H, T, r] fp32."""
        keys = lat                                                                           # [B, 1, S, r+rope]
        values = self.op("Slice", [keys, self.const([0]), self.const([r]), self.const([3])])  # [B, 1, S, r]
        visible = self.causal_mask(cached) if self.attn_mask is None else self.visible_keys(cached)

        def attend(q: str, mask: str) -> str:  # 4-D inputs: the head counts are their shapes' (no attributes)
            return self.op("Attention", [q, keys, values, mask], scale=float(qk ** -0.5))

        return self.in_query_blocks(q_lat, [visible], attend)

    def mla_attend(self, q_lat: str, lat: str, cached: str, qk: int, r: int) -> str:
        """The absorbed attention in MatMul / Softmax / MatMul: q_lat [B, H, T, r+rope] over the latent [B, S,
        r+rope] (fp32) -> [B, H, T, r]."""
        lat_t = self.op("Unsqueeze", [self.op("Transpose", [lat], perm=[0, 2, 1]), self.const([1])])
        c_all = self.op("Unsqueeze", [self.op("Slice", [lat, self.const([0]), self.const([r]), self.const([2])]),
                                      self.const([1])])                                      # [B, 1, S, r]
        scale = self.const(float(qk ** -0.5), F32)
        if self.attn_mask is None:
            masks = [self.causal_mask(cached)]
        else:  # finite fill: a fully masked (padding) row is uniform, then zeroed (PyTorch: nan_to_num(0))
            masks = list(self.padding_mask(cached))

        def attend(q: str, visible: str, any_key: str | None = None) -> str:  # [B, H, t, r+rope] -> [B, H, t, r]
            scores = self.op("Mul", [self.op("MatMul", [q, lat_t]), scale])
            if any_key is None:
                probs = self.op("Softmax", [self.op("Where", [visible, scores, self.const(float("-inf"), F32)])],
                                axis=-1)
            else:
                scores = self.op("Where", [visible, scores, self.const(float(np.finfo(np.float32).min), F32)])
                probs = self.op("Mul", [self.op("Softmax", [scores], axis=-1), any_key])
            return self.op("MatMul", [probs, c_all])

        return self.in_query_blocks(q_lat, masks, attend)                                    # [B, H, T, r]

    # ------------------------------------------------------------------ Stable LatentMoE
    def moe(self, x: str, p: str) -> str:
        """Stable LatentMoE: route, project to the latent, ``k3::moe_experts`` over the selected experts, norm, up,
        plus the shared experts. ``self.experts == "mxfp4"`` keeps the routed experts as the checkpoint's MXFP4
        (`mxfp4` module): FLOAT4E2M1 weights + FLOAT8E8M0 scales, dequantised per selected expert in the loop."""
        c = self.config
        d, E, k, inter = c.hidden_size, c.num_experts, c.num_experts_per_token, c.moe_intermediate_size
        D = c.expert_input_size
        logits = self.op("Gemm", [self.cast(x, self.dt, F32), self.w_as(p + "gate.weight", (E, d), F32)], transB=1)
        if self.quantize:
            self.keep_apart.add(p + "gate.weight")
        weights, indices = self.op(
            "moe_route", [logits, self.w(p + "gate.e_score_correction_bias", (E,))], n_out=2, domain=DOMAIN,
            top_k=int(k), renormalize=int(bool(c.moe_renormalize)), scale=float(c.routed_scaling_factor),
            plugin_namespace=PLUGIN_NAMESPACE)
        z = self.linear(x, p + "routed_expert_down_proj.weight", D, d) if c.use_latent_moe else x
        mxfp4, nvfp4 = self.experts == "mxfp4", self.experts == "nvfp4"

        def stacked(which: str, out_f: int, in_f: int, suffix: str = "weight") -> str:
            """The E checkpoint tensors ``experts.{e}.{which}.{suffix}`` stacked [E, ...]: dense weights in the
            export dtype, or (MXFP4) the packed FLOAT4E2M1 values / FLOAT8E8M0 group scales, byte for byte; (NVFP4)
            the packed values, FLOAT8E4M3FN scales per 16 and the fp32 global scales [E]."""
            name = f"{p}experts.{which}.{suffix}"
            dt, shape = {"weight": (self.weight_dtype(name), (E, out_f, in_f)),
                         "weight_packed": (as_dtype("float4e2m1"), (E, out_f, in_f)),
                         "weight_scale": ((as_dtype("float8e4m3fn"), (E, out_f, in_f // 16)) if nvfp4 else
                                          (as_dtype("float8e8m0"), (E, out_f, in_f // 32))),
                         "weight_scale_2": (as_dtype("float32"), (E,))}[suffix]
            return self.weight(name, shape, dt, [f"{p}experts.{e}.{which}.{suffix}" for e in range(E)])

        shapes = (("w1", inter, D), ("w3", inter, D), ("w2", D, inter))
        if nvfp4:  # k3::moe_experts(..., w1, w3, w2, w*_scale, w*_scale_2): `k3export.ops.spec.MOE_EXPERTS_NVFP4`
            ws = [stacked(*s, suffix) for suffix in ("weight_packed", "weight_scale", "weight_scale_2")
                  for s in shapes]
        elif mxfp4:  # k3::moe_experts(..., w1, w3, w2, w1_scale, w3_scale, w2_scale): dequantised inside the loop
            ws = [stacked(*s, "weight_packed") for s in shapes] + [stacked(*s, "weight_scale") for s in shapes]
        else:
            ws = [stacked(*s) for s in shapes]
        u = self.op("moe_experts", [z, weights, indices, *ws], domain=DOMAIN, act=c.hidden_act,
                    beta1=float(c.activation_situ_beta), beta2=float(c.activation_situ_linear_beta),
                    plugin_namespace=PLUGIN_NAMESPACE)                                         # [N, D] fp32
        u = self.cast(u, F32, self.dt)
        if c.use_latent_moe:
            if c.latent_moe_use_norm:
                u = self.rmsnorm(u, p + "routed_expert_norm.weight", D, c.rms_norm_eps)
            u = self.linear(u, p + "routed_expert_up_proj.weight", d, D)
        if c.num_shared_experts:
            u = self.op("Add", [u, self.mlp(x, p + "shared_experts.", d, inter * c.num_shared_experts)])
        return u
