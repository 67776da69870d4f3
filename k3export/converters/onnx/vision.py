# Copyright 2026 the k3export authors. Apache-2.0.
"""K3's vision tower + projector and its embedding splice as ONNX graphs (mirror of ``modeling_k3_vision.py``).

Long file: the two graphs, the stage outputs validation reads and the export entry point share one set of tower
emitters (patch embedding, 2D rotary, packed attention, merge), which mirror the modeling file block for block.

Two graphs, the two that onnxruntime-genai's multimodal pipeline runs before its decoder (its ``vision`` and
``embedding`` models; ``docs/vision.md`` has the maths and the sources):

``vision.onnx``     ``pixel_values`` [num_patches, C * p * p] (the processor's packed patches, each patch flattened
                    channel-major, as `K3ImageProcessor` packs them: ``pixel_values.reshape(num_patches, -1)``) and
                    ``image_grid_thw`` int64 [num_images, 3] (frames, rows, columns per image) in;
                    ``image_features`` [num_image_tokens, text hidden] out: every image's merged, projected tokens,
                    images in order. Any number of images of any sizes (and video chunks of up to
                    ``init_pos_emb_time`` frames) in one call; at least one image.
``embedding.onnx``  ``input_ids`` int64 [batch, sequence_length] and ``image_features`` [num_image_tokens, hidden] in;
                    ``inputs_embeds`` [batch, sequence_length, hidden] out: the token embeddings with the k-th
                    ``media_placeholder_token_id`` token (batch row-major) replaced by the k-th image token. Decode
                    steps feed 0 image tokens (genai does); a placeholder without a feature keeps its own embedding.

How the vision graph is written (standard ops only, no ``If``, no functions, no sequences: ONNX Runtime and the ONNX
reference evaluator read it as it is):

* Everything per image is computed from ``image_grid_thw`` with vectorised index arithmetic: each patch's image
  (its position against the cumulative patch counts), frame, row and column.
* ``divided_fixed`` position: the learned [H0, W0, D] grid resampled per patch by gathering its four bilinear
  neighbours (half-pixel centres, PyTorch's ``align_corners=False`` rule), in fp32; a chunk of t > 1 frames adds the
  fixed temporal table (``temporal_sincos``) gathered by frame. Nothing about the grids is fixed at export: every
  grid gives the PyTorch numbers.
* 2D rotary: angles column x f_i / row x f_i (`ROPE_THETA`), cos / sin in fp32.
* Per-image attention: one ``Loop`` per layer over query blocks. Each image's patches are cut into blocks of
  ``Bq = min(largest image, VISION_QUERY_BLOCK)`` query rows; an iteration attends one block to its own image's keys
  only, so the scores never exceed [heads, Bq, patches of one image] (no [L, L] mask, nothing across images), and the
  rows are gathered back into patch order after the loop.
* ``sd2_tpool``: each merged token gathers its kh x kw patches of every frame (at most ``init_pos_emb_time``, masked
  past the image's own) and averages over frames.

Weights are external data in the export's shard layout (`shards.plan_shards`, `weights.write_weights`):
``vision.onnx.data.NNNNN`` and ``embedding.onnx.data.NNNNN``, initializers named as in the checkpoint
(``vision_tower.*``, ``mm_projector.*``; ``model.embed_tokens.weight`` as in the decoder graph).

Debug outputs (``debug_outputs=True``, never in an export's own ``vision.onnx``): every stage's output besides
``image_features``, named by the PyTorch module that computes it (`vision_stages`): the patch embedding
``vision_tower.patch_embed`` and each block ``vision_tower.encoder.blocks.{i}`` [num_patches, vt_hidden], the final
norm ``vision_tower.encoder.final_layernorm`` and the ``sd2_tpool`` merge ``vision_tower`` [num_image_tokens,
kh * kw * vt_hidden]; the projector ``mm_projector`` is ``image_features`` itself. `with_stage_outputs` adds them to
a written ``vision.onnx`` in memory, so that validation localises a vision divergence in the graph under test.

`export_vision` writes both graphs into an export folder (built in a hidden sibling, renamed at the end);
`write_vision_graphs` writes them into a folder being built (the decoder export's, once it calls it). The graph cannot
refuse a bad grid with a message, so a runtime builds its feeds with `contract.vision_feeds`, which checks them as
the PyTorch tower does.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from k3export.artifacts import write_bytes_atomic
from k3export.artifacts.manifest import TensorSpec, image_graph_specs
from k3export.dtypes import FLOAT32, DType, dtype as as_dtype
from k3export.errors import ConfigError, ExportError
from k3export.files import CONFIG_NAME, read_config_json
from k3export.modeling import contract
from k3export.modeling.configuration_k3 import K3ConfigError, K3VisionConfig, K3VLConfig
from k3export.modeling.contract import (IMAGE_FEATURES, IMAGE_GRID_THW, INPUTS_EMBEDS, NUM_IMAGE_TOKENS, NUM_IMAGES,
                                       NUM_PATCHES, PIXEL_VALUES)
from k3export.modeling.modeling_k3_vision import ROPE_THETA, VISION_PREFIXES, temporal_sincos

from .builder import GraphBuilder, WeightSpec
from .opsets import DEFAULT_OPSET, IR_VERSION, check_graph_opset, check_opset, export_dtype
from .shards import DEFAULT_MAX_SHARD_BYTES, plan_shards
from .weights import WeightSource, initializer, write_weights

F32, I64 = TensorProto.FLOAT, TensorProto.INT64

VISION_FILE = "vision.onnx"
VISION_DATA_PREFIX = "vision.onnx.data."
EMBEDDING_FILE = "embedding.onnx"
EMBEDDING_DATA_PREFIX = "embedding.onnx.data."

# graph I/O names and dims (PIXEL_VALUES, IMAGE_FEATURES, NUM_PATCHES, ...) are the contract's
# (`k3export.modeling.contract`), the I/O specs the manifest's (`k3export.artifacts.manifest.image_graph_specs`)

#: most query rows one attention step of the vision graph takes: the scores of a step are at most
#: [heads, VISION_QUERY_BLOCK, patches of one image] fp32 (12 x 1024 x 16384 x 4 B = 805 MB for a released image at
#: the full 16384-patch budget)
VISION_QUERY_BLOCK = 1024

#: the text-model weight the embedding graph reads (the decoder graph's name for it)
EMBED_TOKENS = "model.embed_tokens.weight"


#: the stage of `vision_stages` that is the graph's ``image_features`` output (no debug output of its own)
PROJECTOR_STAGE = "mm_projector"
#: the stage that is the tower's output: the ``sd2_tpool`` merge
MERGE_STAGE = "vision_tower"


def vision_stages(config: K3VisionConfig) -> list[str]:
    """The vision stages in the order they run, each named by the `K3ForConditionalGeneration` submodule whose
    output it is (a forward hook on that module reads the PyTorch side)."""
    blocks = [f"vision_tower.encoder.blocks.{i}" for i in range(config.vt_num_hidden_layers)]
    return ["vision_tower.patch_embed", *blocks, "vision_tower.encoder.final_layernorm", MERGE_STAGE,
            PROJECTOR_STAGE]


# ============================================================================ graph I/O


def vision_io(config: K3VisionConfig, dtype: Any = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of ``vision.onnx`` for `config` in activation dtype `dtype`."""
    vision = image_graph_specs(config, config.text_hidden_size, dtype)[0]
    return vision.inputs, vision.outputs


def embedding_io(config: K3VLConfig, dtype: Any = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of ``embedding.onnx`` for `config` in activation dtype `dtype`."""
    embedding = image_graph_specs(config.vision_config, config.text_config.hidden_size, dtype)[1]
    return embedding.inputs, embedding.outputs


# ============================================================================ builders


class _Builder(GraphBuilder):
    """`GraphBuilder` with the few helpers both graphs use, for one activation dtype."""

    def __init__(self, dtype: Any) -> None:
        super().__init__()
        self.act: DType = as_dtype(dtype)
        self.dt = self.act.onnx

    def cast(self, x: str, frm: int, to: int) -> str:
        return x if frm == to else self.op("Cast", [x], to=to)

    def take(self, table: str, index: str) -> str:
        """``table[index]`` along axis 0."""
        return self.op("Gather", [table, index], axis=0)

    def col(self, x: str) -> str:
        """[n] -> [n, 1]."""
        return self.op("Unsqueeze", [x, self.const([1])])

    def io(self, spec: TensorSpec, output: str | None = None) -> str:
        elem = as_dtype(spec.dtype).onnx
        if output is None:
            return self.add_input(spec.name, elem, list(spec.shape))
        self.add_output(output, spec.name, elem, list(spec.shape))
        return spec.name

    def proto(self, name: str, opset: int, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, initializer=self.constants)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION,
                                 producer_name="k3export", doc_string=doc)


class K3VisionGraphBuilder(_Builder):
    """Builds ``vision.onnx`` (tower + projector, module docstring) of a `K3VisionConfig` for one export dtype."""

    def __init__(self, config: K3VisionConfig, dtype: Any = "float32", query_block: int = VISION_QUERY_BLOCK,
                 debug_outputs: bool = False) -> None:
        super().__init__(dtype)
        self.config = config
        self.query_block = int(query_block)
        self.debug_outputs = debug_outputs
        #: stage (`vision_stages`) -> the graph value holding its output, filled by `build`
        self.stage_values: dict[str, str] = {}
        # the tower's RMSNorm epsilon is the activation dtype's (`modeling_k3_vision.vision_rms_norm`)
        self.norm_eps = float(torch.finfo(self.act.torch).eps)

    # ------------------------------------------------------------------ small helpers
    def w(self, name: str, shape: tuple[int, ...]) -> str:
        return self.weight(name, shape, self.act)

    def linear(self, x: str, name: str, out_f: int, in_f: int) -> str:
        """x [n, in] @ W^T, W stored as in the checkpoint [out, in]."""
        return self.op("Gemm", [x, self.w(name, (out_f, in_f))], transB=1)

    def rmsnorm(self, x: str, name: str, dim: int, eps: float) -> str:
        return self.op("RMSNormalization", [x, self.w(name, (dim,))], axis=1, epsilon=float(eps), stash_type=1)

    def segment(self, positions: str, ends: str) -> str:
        """The segment of each position [n] given the segments' cumulative ends [N]: how many ends it reaches."""
        reached = self.op("GreaterOrEqual", [self.col(positions), self.op("Unsqueeze", [ends, self.const([0])])])
        return self.op("ReduceSum", [self.cast(reached, TensorProto.BOOL, I64), self.const([1])], keepdims=0)

    # ------------------------------------------------------------------ the graph
    def build(self) -> None:
        c = self.config
        d = c.vt_hidden_size
        (px_io, grid_io), (out_io,) = vision_io(c, self.act)
        px, grid = self.io(px_io), self.io(grid_io)
        self.scope = "index"
        self.index(px, grid)
        self.scope = "patch_embed"
        proj = self.op("Reshape", [self.w("vision_tower.patch_embed.proj.weight",
                                          (d, c.in_channels, c.patch_size, c.patch_size)),
                                   self.const([d, c.patch_pixels])])
        x = self.op("Gemm", [px, proj], transB=1)                                             # [L, D]
        x = self.op("Add", [x, self.cast(self.position(), F32, self.dt)])
        stages = iter(vision_stages(c))
        self.stage_values[next(stages)] = x
        self.rope_tables()
        self.attention_plan()
        for i in range(c.vt_num_hidden_layers):
            self.scope = f"blocks.{i}"
            x = self.block(i, x)
            self.stage_values[next(stages)] = x
        self.scope = "merge"
        x = self.rmsnorm(x, "vision_tower.encoder.final_layernorm.weight", d, self.norm_eps)
        self.stage_values[next(stages)] = x
        merged = self.merge(x)                                                                 # [M, kh*kw*D]
        self.stage_values[next(stages)] = merged
        self.scope = "projector"
        width = c.projector_in_size
        h = self.op("Gelu", [self.linear(merged, "mm_projector.proj.0.weight", width, width)], approximate="none")
        h = self.linear(h, "mm_projector.proj.2.weight", c.text_hidden_size, width)
        h = self.rmsnorm(h, "mm_projector.post_norm.weight", c.text_hidden_size, c.projector_ln_eps)
        self.stage_values[next(stages)] = h
        self.io(out_io, output=h)
        if self.debug_outputs:  # after every graph node, so the nodes above are exactly the plain graph's
            self.scope = "debug"
            for stage, value in self.stage_values.items():
                if stage == PROJECTOR_STAGE:
                    continue  # that is image_features
                rows = contract.NUM_IMAGE_TOKENS if stage == MERGE_STAGE else contract.NUM_PATCHES
                width = c.projector_in_size if stage == MERGE_STAGE else d
                self.add_output(value, stage, self.dt, [rows, width])

    def stage_outputs(self) -> dict[str, str]:
        """Stage (`vision_stages`) -> the graph output holding it, with `debug_outputs`."""
        return {s: IMAGE_FEATURES if s == PROJECTOR_STAGE else s for s in self.stage_values}

    def index(self, px: str, grid: str) -> None:
        """Per-image sizes and offsets, and each patch's image, frame, row and column (int64)."""
        t, h, w = (self.op("Gather", [grid, self.const(i)], axis=1) for i in range(3))     # [N] each
        hw = self.op("Mul", [h, w])
        n = self.op("Mul", [t, hw])
        self.ends = self.op("CumSum", [n, self.const(0)])
        self.starts = self.op("Sub", [self.ends, n])
        self.img_t, self.img_h, self.img_w, self.img_hw, self.n = t, h, w, hw, n
        length = self.op("Squeeze", [self.op("Slice", [self.op("Shape", [px]), self.const([0]), self.const([1])]),
                                     self.const([0])])
        j = self.op("Range", [self.const(0), length, self.const(1)])                          # [L]
        img = self.segment(j, self.ends)
        self.local = self.op("Sub", [j, self.take(self.starts, img)])  # patch index within its image
        self.patch_image = img
        w_j, h_j, t_j = (self.take(v, img) for v in (w, h, t))
        self.col_j = self.op("Mod", [self.local, w_j])
        self.row_j = self.op("Mod", [self.op("Div", [self.local, w_j]), h_j])
        self.frame_j = self.op("Div", [self.local, self.take(hw, img)])
        self.h_j, self.w_j, self.t_j = h_j, w_j, t_j

    def position(self) -> str:
        """``divided_fixed`` of every patch [L, D] fp32: the learned grid at the patch's bilinear source point (half
        pixel centres, clamped at 0, as ``F.interpolate(..., "bilinear", align_corners=False)``) plus, for images of
        more than one frame, the temporal sin/cos of its frame."""
        c = self.config
        h0, w0, d = c.init_pos_emb_height, c.init_pos_emb_width, c.vt_hidden_size
        table = self.cast(self.op("Reshape", [self.w("vision_tower.patch_embed.pos_emb.weight", (h0, w0, d)),
                                              self.const([h0 * w0, d])]), self.dt, F32)
        half, zero = self.const(0.5, F32), self.const(0.0, F32)

        def source(dst: str, out_size: str, in_size: int) -> tuple[str, str, str]:
            """(first neighbour, second neighbour, weight of the second) along one axis, per patch."""
            scale = self.op("Div", [self.const(float(in_size), F32), self.cast(out_size, I64, F32)])
            src = self.op("Max", [self.op("Sub", [self.op("Mul", [scale, self.op("Add", [
                self.cast(dst, I64, F32), half])]), half]), zero])
            lo = self.op("Floor", [src])
            i0 = self.op("Min", [self.cast(lo, F32, I64), self.const(in_size - 1)])
            i1 = self.op("Min", [self.op("Add", [i0, self.const(1)]), self.const(in_size - 1)])
            return i0, i1, self.col(self.op("Sub", [src, lo]))

        y0, y1, ly = source(self.row_j, self.h_j, h0)
        x0, x1, lx = source(self.col_j, self.w_j, w0)
        one = self.const(1.0, F32)

        def at(y: str, x: str) -> str:
            return self.take(table, self.op("Add", [self.op("Mul", [y, self.const(w0)]), x]))

        def lerp(a: str, b: str, weight: str) -> str:
            return self.op("Add", [self.op("Mul", [self.op("Sub", [one, weight]), a]), self.op("Mul", [weight, b])])

        pos = lerp(lerp(at(y0, x0), at(y0, x1), lx), lerp(at(y1, x0), at(y1, x1), lx), ly)
        time = self.const(temporal_sincos(d, c.init_pos_emb_time, torch.float32, "cpu").numpy(), F32)  # [T, D]
        several = self.col(self.cast(self.op("Greater", [self.t_j, self.const(1)]), TensorProto.BOOL, F32))
        return self.op("Add", [pos, self.op("Mul", [self.take(time, self.frame_j), several])])

    def rope_tables(self) -> None:
        """cos / sin [L, 1, head_dim / 2, 1] fp32 of the 2D rotary angles: pair 2i turns with the column, 2i + 1
        with the row, at f_i = ROPE_THETA^(-4i / head_dim) (`modeling_k3_vision.rope_2d_angles`)."""
        hd = self.config.head_dim
        freqs = (ROPE_THETA ** (-torch.arange(0, hd, 4, dtype=torch.float32)[: hd // 4] / hd)).numpy()
        f = self.const(freqs.reshape(1, -1), F32)
        ang = [self.op("Unsqueeze", [self.op("Mul", [self.col(self.cast(p, I64, F32)), f]), self.const([2])])
               for p in (self.col_j, self.row_j)]                                                 # [L, hd/4, 1]
        ang = self.op("Reshape", [self.op("Concat", ang, axis=2), self.const([-1, 1, hd // 2, 1])])
        self.cos, self.sin = self.op("Cos", [ang]), self.op("Sin", [ang])

    def attention_plan(self) -> None:
        """The query blocks of the per-image attention: block size Bq, and for block k its first query row, its
        image's first and last key; for patch j the row of the stacked block outputs that holds it."""
        self.scope = "attention_plan"
        bq = self.op("Min", [self.op("ReduceMax", [self.n, self.const([0])], keepdims=0), self.const(self.query_block)])
        blocks = self.op("Div", [self.op("Sub", [self.op("Add", [self.n, bq]), self.const(1)]), bq])   # [N]
        b_end = self.op("CumSum", [blocks, self.const(0)])
        b_start = self.op("Sub", [b_end, blocks])
        count = self.op("ReduceSum", [blocks, self.const([0])], keepdims=0)
        k = self.op("Range", [self.const(0), count, self.const(1)])
        img = self.segment(k, b_end)
        self.block_q = self.op("Add", [self.take(self.starts, img),
                                       self.op("Mul", [self.op("Sub", [k, self.take(b_start, img)]), bq])])
        self.block_k0, self.block_k1 = self.take(self.starts, img), self.take(self.ends, img)
        block_j = self.op("Add", [self.take(b_start, self.patch_image), self.op("Div", [self.local, bq])])
        self.block_row = self.op("Add", [self.op("Mul", [block_j, bq]), self.op("Mod", [self.local, bq])])
        self.bq, self.block_count = bq, count
        self.q_pad = self.op("Concat", [self.const([0, 0, 0]), self.op("Unsqueeze", [bq, self.const([0])]),
                                        self.const([0, 0])], axis=0)

    def rope(self, x: str) -> str:
        """Rotate the channel pairs of x [L, heads * head_dim] (fp32): [L, heads, head_dim]."""
        c = self.config
        pairs = self.op("Reshape", [x, self.const([-1, c.vt_num_attention_heads, c.head_dim // 2, 2])])
        a, b = self.op("Split", [pairs, self.const([1, 1])], n_out=2, axis=3)
        out = self.op("Concat", [self.op("Sub", [self.op("Mul", [a, self.cos]), self.op("Mul", [b, self.sin])]),
                                 self.op("Add", [self.op("Mul", [a, self.sin]), self.op("Mul", [b, self.cos])])],
                      axis=3)
        return self.op("Reshape", [out, self.const([0, c.vt_num_attention_heads, c.head_dim])])

    def attention(self, q: str, k: str, v: str) -> str:
        """Per-image bidirectional attention of q, k, v [L, heads, head_dim] (fp32) -> [L, heads * head_dim]: a
        ``Loop`` over the query blocks of `attention_plan`, each against its own image's keys."""
        c = self.config
        width = c.vt_num_attention_heads * c.head_dim
        q = self.op("Pad", [q, self.q_pad])  # the last block of an image may run past the pack: zero rows
        it, cond = self.fresh("block"), self.fresh("cond")
        scale = self.const(float(c.head_dim ** -0.5), F32)
        axis0 = self.const([0])
        with self.collecting() as body:
            first = self.op("Unsqueeze", [self.take(self.block_q, it), axis0])
            qb = self.op("Slice", [q, first, self.op("Add", [first, self.op("Unsqueeze", [self.bq, axis0])]), axis0])
            k0 = self.op("Unsqueeze", [self.take(self.block_k0, it), axis0])
            k1 = self.op("Unsqueeze", [self.take(self.block_k1, it), axis0])
            kb, vb = (self.op("Slice", [x, k0, k1, axis0]) for x in (k, v))
            scores = self.op("Mul", [self.op("MatMul", [self.op("Transpose", [qb], perm=[1, 0, 2]),
                                                        self.op("Transpose", [kb], perm=[1, 2, 0])]), scale])
            probs = self.op("Softmax", [scores], axis=2)                                        # [H, Bq, n_i]
            o = self.op("MatMul", [probs, self.op("Transpose", [vb], perm=[1, 0, 2])])            # [H, Bq, hd]
            o = self.op("Reshape", [self.op("Transpose", [o], perm=[1, 0, 2]), self.const([-1, width])])
            body.append(helper.make_node("Identity", [cond], [self.fresh("cond_out")]))
        loop_body = helper.make_graph(
            body, self.fresh("attention_blocks"),
            [helper.make_tensor_value_info(it, I64, []), helper.make_tensor_value_info(cond, TensorProto.BOOL, [])],
            [helper.make_tensor_value_info(body[-1].output[0], TensorProto.BOOL, []),
             helper.make_tensor_value_info(o, F32, None)])
        stacked = self.op("Loop", [self.block_count, self.const(True, TensorProto.BOOL)], body=loop_body)
        # [blocks * Bq, width] whether the scan output is stacked (ONNX) or concatenated (the reference evaluator)
        rows = self.op("Reshape", [stacked, self.const([-1, width])])
        return self.take(rows, self.block_row)

    def block(self, i: int, x: str) -> str:
        c = self.config
        d, qkv = c.vt_hidden_size, c.qkv_hidden_size
        p = f"vision_tower.encoder.blocks.{i}."
        y = self.rmsnorm(x, p + "norm0.weight", d, self.norm_eps)
        q, k, v = self.op("Split", [self.linear(y, p + "wqkv.weight", 3 * qkv, d), self.const([qkv] * 3)], n_out=3,
                          axis=1)
        v = self.op("Reshape", [self.cast(v, self.dt, F32), self.const([0, c.vt_num_attention_heads, c.head_dim])])
        o = self.attention(self.rope(self.cast(q, self.dt, F32)), self.rope(self.cast(k, self.dt, F32)), v)
        x = self.op("Add", [x, self.linear(self.cast(o, F32, self.dt), p + "wo.weight", d, qkv)])
        y = self.rmsnorm(x, p + "norm1.weight", d, self.norm_eps)
        u = self.op("Gelu", [self.linear(y, p + "mlp.fc0.weight", c.vt_intermediate_size, d)], approximate="tanh")
        return self.op("Add", [x, self.linear(u, p + "mlp.fc1.weight", d, c.vt_intermediate_size)])

    def merge(self, x: str) -> str:
        """``sd2_tpool`` of x [L, D]: merged token m gathers its kh x kw patches (block rows outer, columns inner) in
        every frame of its image and averages over the frames: [M, kh * kw * D]."""
        c = self.config
        kh, kw = (int(k) for k in c.merge_kernel_size)
        d = c.vt_hidden_size
        mw = self.op("Div", [self.img_w, self.const(kw)])
        m = self.op("Mul", [self.op("Div", [self.img_h, self.const(kh)]), mw])  # [N] tokens per image
        m_end = self.op("CumSum", [m, self.const(0)])
        tok = self.op("Range", [self.const(0), self.op("ReduceSum", [m, self.const([0])], keepdims=0), self.const(1)])
        img = self.segment(tok, m_end)
        q = self.op("Sub", [tok, self.take(self.op("Sub", [m_end, m]), img)])
        mw_m, w_m, t_m = self.take(mw, img), self.take(self.img_w, img), self.take(self.img_t, img)
        first = self.op("Add", [self.take(self.starts, img), self.op("Add", [
            self.op("Mul", [self.op("Div", [q, mw_m]), self.op("Mul", [w_m, self.const(kh)])]),
            self.op("Mul", [self.op("Mod", [q, mw_m]), self.const(kw)])])])                     # [M]
        sub_rows = np.repeat(np.arange(kh), kw).reshape(1, -1)
        sub_cols = np.tile(np.arange(kw), kh).reshape(1, -1)
        frame0 = self.op("Add", [self.op("Add", [self.col(first), self.op("Mul", [self.const(sub_rows),
                                                                                  self.col(w_m)])]),
                                 self.const(sub_cols)])                                          # [M, kh*kw]
        total = self.take(x, frame0)                                                              # [M, kh*kw, D]
        frames = c.init_pos_emb_time
        if frames > 1:
            last = self.op("Sub", [t_m, self.const(1)])
            hw_m = self.take(self.img_hw, img)
            for f in range(1, frames):  # frame f of a shorter image: its last frame again, masked out
                shift = self.col(self.op("Mul", [self.op("Min", [last, self.const(f)]), hw_m]))
                there = self.cast(self.op("Greater", [t_m, self.const(f)]), TensorProto.BOOL, self.dt)
                there = self.op("Unsqueeze", [there, self.const([1, 2])])
                total = self.op("Add", [total, self.op("Mul", [self.take(x, self.op("Add", [frame0, shift])), there])])
            count = self.op("Unsqueeze", [self.cast(t_m, I64, self.dt), self.const([1, 2])])
            total = self.op("Div", [total, count])
        return self.op("Reshape", [total, self.const([-1, kh * kw * d])])


class K3EmbeddingGraphBuilder(_Builder):
    """Builds ``embedding.onnx`` (token embeddings with image features spliced in, module docstring)."""

    def __init__(self, config: K3VLConfig, dtype: Any = "float32") -> None:
        super().__init__(dtype)
        self.config = config

    def build(self) -> None:
        c = self.config
        d, vocab = c.text_config.hidden_size, c.text_config.vocab_size
        (ids_io, feat_io), (out_io,) = embedding_io(c, self.act)
        ids, feats = self.io(ids_io), self.io(feat_io)
        wdt = FLOAT32 if contract.keeps_fp32(EMBED_TOKENS) else self.act
        table = self.cast(self.weight(EMBED_TOKENS, (vocab, d), wdt), wdt.onnx, self.dt)
        flat = self.op("Reshape", [ids, self.const([-1])])                                     # [B*T]
        embeds = self.op("Gather", [table, flat], axis=0)                                       # [B*T, d]
        is_pad = self.op("Equal", [flat, self.const(int(c.media_placeholder_token_id))])
        rank = self.op("Sub", [self.op("CumSum", [self.cast(is_pad, TensorProto.BOOL, I64), self.const(0)]),
                               self.const(1)])                                                   # k-th placeholder
        have = self.op("Squeeze", [self.op("Slice", [self.op("Shape", [feats]), self.const([0]), self.const([1])]),
                                   self.const([0])])
        use = self.op("And", [is_pad, self.op("Less", [rank, have])])
        # one zero row after the features, so that the gather is in range with 0 features (decode steps)
        zero = self.cast(self.op("ConstantOfShape", [self.const([1, d])],
                                 value=helper.make_tensor("zero", F32, [1], [0.0])), F32, self.dt)
        rows = self.op("Gather", [self.op("Concat", [feats, zero], axis=0), self.op("Where", [use, rank, have])],
                       axis=0)
        out = self.op("Where", [self.col(use), rows, embeds])
        shape = self.op("Concat", [self.op("Shape", [ids]), self.const([d])], axis=0)
        self.io(out_io, output=self.op("Reshape", [out, shape]))


# ============================================================================ protos


def build_vision_proto(config: K3VisionConfig, dtype: Any = "float32", opset: int | None = None,
                       query_block: int = VISION_QUERY_BLOCK, debug_outputs: bool = False
                       ) -> tuple[onnx.ModelProto, K3VisionGraphBuilder]:
    """``vision.onnx`` with its weights declared only (`export_vision` adds the initializers); `debug_outputs`
    adds every stage's output (module docstring)."""
    b = K3VisionGraphBuilder(config, export_dtype(dtype), query_block=query_block, debug_outputs=debug_outputs)
    b.build()
    model = b.proto("k3_vision", check_opset(DEFAULT_OPSET if opset is None else opset),
                    "Kimi K3 MoonViT-V2 tower + PatchMergerMLPV2 projector: packed patches + image_grid_thw in, "
                    "image_features out")
    return model, b


def _signature(nodes: Any) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    return [(n.op_type, tuple(n.input), tuple(n.output)) for n in nodes]


def with_stage_outputs(model: onnx.ModelProto, config: K3VisionConfig, where: Any = VISION_FILE
                       ) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of `model`, a written ``vision.onnx`` (loaded without its weights: they stay external, relative to its
    folder), with the debug outputs of every stage added, and the stage (`vision_stages`) -> output name map.

    The graph is checked node by node against the one this builder writes for `config` in the graph's own dtype, so
    the added outputs are the stages they are named for; a graph that differs (another k3export wrote it, or it was
    edited) is refused with `ExportError` naming `where`."""
    feats = next((o for o in model.graph.output if o.name == IMAGE_FEATURES), None)
    if feats is None:
        raise ExportError(f"{where}: no {IMAGE_FEATURES!r} output; not a K3 vision graph")
    debug, b = build_vision_proto(config, as_dtype(feats.type.tensor_type.elem_type), debug_outputs=True)
    plain = len(debug.graph.node) - (len(debug.graph.output) - len(model.graph.output))  # one Identity per output
    if _signature(model.graph.node) != _signature(debug.graph.node[:plain]):
        raise ExportError(f"{where}: its nodes differ from the vision graph this k3export writes for its config "
                          f"({len(model.graph.node)} nodes against {plain}), so its stages cannot be named")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.node.extend(debug.graph.node[plain:])
    out.graph.output.extend(debug.graph.output[len(model.graph.output):])
    return out, b.stage_outputs()


def build_embedding_proto(config: K3VLConfig, dtype: Any = "float32", opset: int | None = None
                          ) -> tuple[onnx.ModelProto, K3EmbeddingGraphBuilder]:
    """``embedding.onnx`` with its weight declared only."""
    b = K3EmbeddingGraphBuilder(config, export_dtype(dtype))
    b.build()
    model = b.proto("k3_embedding", check_opset(DEFAULT_OPSET if opset is None else opset),
                    "Kimi K3 token embeddings with image_features written over the media placeholder tokens")
    return model, b


# ============================================================================ weights


class VisionSource:
    """The tensors of the two graphs, by their graph names: ``vision_tower.*`` / ``mm_projector.*`` and
    `EMBED_TOKENS`, from an in-memory `K3ForConditionalGeneration` or a ``kimi_k3`` checkpoint folder (the vision
    tensors checked from the shard headers first, `check_vision_tensors`; the text embedding through k3export's
    checkpoint reader). NaN / Inf is refused unless `allow_nonfinite`."""

    def __init__(self, model_or_folder: Any, config: K3VLConfig, allow_nonfinite: bool = False,
                 config_json: dict[str, Any] | None = None) -> None:
        self.allow_nonfinite = allow_nonfinite
        self.folder: Path | None = None
        if isinstance(model_or_folder, torch.nn.Module):
            self.tensors = dict(model_or_folder.state_dict())
            self.where: dict[str, str] = {}
            self.text = None
            return
        from k3export.modeling.modeling_k3_vision import check_vision_tensors

        from .weights import CheckpointSource

        self.folder = Path(model_or_folder)
        self.tensors = {}
        try:
            self.where = check_vision_tensors(str(self.folder), config)
        except ValueError as exc:  # K3CheckpointError: one line naming the tensor
            raise ExportError(str(exc)) from None
        self.text = CheckpointSource(self.folder, allow_nonfinite, config_json=config_json)

    def get(self, name: str) -> torch.Tensor:
        from k3export.converters.checkpoints.safetensors_io import all_finite

        if self.folder is None:
            key = f"language_model.{name}" if name == EMBED_TOKENS else name
            if key not in self.tensors:
                raise ExportError(f"the model has no tensor {key!r}")
            tensor = self.tensors[key]
        elif name.startswith(VISION_PREFIXES):
            from safetensors import safe_open

            with safe_open(str(self.folder / self.where[name]), framework="pt") as f:
                tensor = f.get_tensor(name)
        else:
            return self.text.get(name)  # checks finiteness itself
        if not self.allow_nonfinite and not all_finite(tensor):
            raise ExportError(f"{self.where.get(name, 'the model')}: tensor {name!r} holds NaN or Inf "
                              "(--allow-nonfinite exports it anyway)")
        return tensor

    def close(self) -> None:
        if self.text is not None:
            self.text.close()


def resolve_vision_model(model_or_dir: Any, weights: bool, allow_nonfinite: bool = False
                         ) -> tuple[K3VLConfig, VisionSource | None, Path | None]:
    """(config, weight source or None, the checkpoint folder read or None) of a `K3ForConditionalGeneration`, a
    `K3VLConfig` (``weights=False``), or a ``kimi_k3`` checkpoint folder / Hub id."""
    from k3export.modeling.modeling_k3_vision import K3ForConditionalGeneration

    if isinstance(model_or_dir, K3ForConditionalGeneration):
        cfg = model_or_dir.config
        return cfg, (VisionSource(model_or_dir, cfg, allow_nonfinite) if weights else None), None
    if isinstance(model_or_dir, K3VLConfig):
        if weights:
            raise ExportError("a bare K3VLConfig has no weights: pass weights=False (--no-weights) or a model")
        return model_or_dir, None, None
    if isinstance(model_or_dir, torch.nn.Module):
        raise ExportError(f"{type(model_or_dir).__name__} has no vision tower: pass a K3ForConditionalGeneration")
    if not isinstance(model_or_dir, (str, os.PathLike)):
        raise ExportError(f"cannot export the vision graphs of {type(model_or_dir).__name__}: pass a "
                          "K3ForConditionalGeneration, a K3VLConfig or a checkpoint folder")
    folder = Path(model_or_dir).expanduser()
    if not folder.is_dir():
        if folder.exists():
            raise ExportError(f"{folder} is not a folder")
        from k3export.artifacts import snapshot

        folder = Path(snapshot(str(model_or_dir)))
    data = read_config_json(folder, ExportError)
    try:
        cfg = K3VLConfig.from_released_dict(data)
    except (K3ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{folder / CONFIG_NAME}: {exc}") from None
    return cfg, (VisionSource(folder, cfg, allow_nonfinite, config_json=data) if weights else None), folder


# ============================================================================ writing


@dataclass
class GraphFile:
    """One written graph: its file, its data shards, sizes."""

    model_file: str
    data_files: list[str]
    num_nodes: int
    num_initializers: int
    weight_bytes: int


@dataclass
class VisionExportResult:
    out_dir: Path
    dtype: str
    opset: int
    weights_materialized: bool
    vision: GraphFile
    embedding: GraphFile
    seconds: float
    io: dict[str, tuple[list[TensorSpec], list[TensorSpec]]] = field(repr=False, default_factory=dict)


def _write_graph(folder: Path, file: str, prefix: str, model: onnx.ModelProto, specs: list[WeightSpec],
                 source: WeightSource | None, max_shard_bytes: int,
                 progress: Callable[[int, int], None] | None) -> GraphFile:
    layout = [(s, loc, off) for s, (loc, off) in zip(specs, plan_shards([s.nbytes for s in specs], max_shard_bytes,
                                                                           prefix))]
    model.graph.initializer.extend(initializer(s, loc, off) for s, loc, off in layout)
    check_graph_opset(model, next(o.version for o in model.opset_import if o.domain == ""))
    if source is not None:
        write_weights(layout, folder, source, progress=progress)
    write_bytes_atomic(folder, file, model.SerializeToString())
    data_files = sorted({loc for _, loc, _ in layout})
    return GraphFile(file, data_files, len(model.graph.node), len(model.graph.initializer),
                     sum(s.nbytes for s in specs))


def _check_written(folder: Path, graph: GraphFile, materialized: bool) -> None:
    """Read back one written graph (without its weights): a valid ONNX model whose every external reference is one
    of its own data files, inside the folder, and (when written) within the file."""
    from k3export.artifacts.export_folder import check_external_data

    path = folder / graph.model_file
    model = onnx.load(str(path), load_external_data=False)
    check_external_data(model, folder, graph.data_files, path, path, materialized)
    if materialized:  # the checker reads every external reference, so only when the data files exist
        onnx.checker.check_model(str(path))


def write_vision_graphs(folder: str | os.PathLike[str], config: K3VLConfig, source: WeightSource | None, *,
                        dtype: Any = "float32", opset: int | None = None,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        progress: Callable[[int, int], None] | None = None) -> tuple[GraphFile, GraphFile]:
    """Write ``vision.onnx`` and ``embedding.onnx`` (+ their data shards when `source` is given) into `folder`, a
    folder being built (`k3export.safety.output_folder`), and read them back. ``progress(bytes written, bytes in
    all)`` follows the weights of both graphs."""
    folder = Path(folder)
    vision, vb = build_vision_proto(config.vision_config, dtype, opset)
    embedding, eb = build_embedding_proto(config, dtype, opset)
    v_specs, e_specs = list(vb.weights.values()), list(eb.weights.values())
    v_bytes = sum(s.nbytes for s in v_specs)
    total = v_bytes + sum(s.nbytes for s in e_specs)
    done = (lambda base: None if progress is None else (lambda d, _: progress(base + d, total)))
    graphs = (_write_graph(folder, VISION_FILE, VISION_DATA_PREFIX, vision, v_specs, source, max_shard_bytes, done(0)),
              _write_graph(folder, EMBEDDING_FILE, EMBEDDING_DATA_PREFIX, embedding, e_specs, source,
                           max_shard_bytes, done(v_bytes)))
    for g in graphs:
        _check_written(folder, g, source is not None)
    return graphs


def export_vision(model_or_dir: Any, out_dir: str | os.PathLike[str], *, dtype: Any = "fp32",
                  opset: int | None = None, weights: bool = True, overwrite: bool = False,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, allow_nonfinite: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> VisionExportResult:
    """Export K3's vision graphs to ``out_dir``: ``vision.onnx`` + ``vision.onnx.data.NNNNN`` and
    ``embedding.onnx`` + ``embedding.onnx.data.NNNNN`` (module docstring).

    ``model_or_dir``: a `K3ForConditionalGeneration`, a ``kimi_k3`` checkpoint folder or Hub id, or a `K3VLConfig`
    with ``weights=False`` (graphs only, the data files not written). The folder is built in a hidden sibling, each
    graph read back, and renamed into place at the end; an existing output is replaced only with `overwrite` and
    only when k3export wrote it."""
    from k3export.safety import EXPORT, check_output, output_folder

    t0 = time.perf_counter()
    act = export_dtype(dtype)
    opset = check_opset(DEFAULT_OPSET if opset is None else opset)
    out = Path(out_dir).expanduser().absolute()
    check_output(out, EXPORT, overwrite=overwrite)
    config, source, folder = resolve_vision_model(model_or_dir, weights, allow_nonfinite)
    try:
        with output_folder(out, EXPORT, overwrite=overwrite,
                           sources=[model_or_dir, folder, getattr(model_or_dir, "_k3_source", None)]) as tmp:
            vision, embedding = write_vision_graphs(tmp, config, source, dtype=act, opset=opset,
                                                    max_shard_bytes=max_shard_bytes, progress=progress)
    finally:
        if source is not None:
            source.close()
    return VisionExportResult(out, act.name, opset, source is not None, vision, embedding, time.perf_counter() - t0,
                              io={VISION_FILE: vision_io(config.vision_config, act),
                                  EMBEDDING_FILE: embedding_io(config, act)})


__all__ = [
    "EMBEDDING_DATA_PREFIX", "EMBEDDING_FILE", "EMBED_TOKENS", "GraphFile", "IMAGE_FEATURES",
    "IMAGE_GRID_THW", "INPUTS_EMBEDS", "K3EmbeddingGraphBuilder", "K3VisionGraphBuilder", "NUM_IMAGES",
    "NUM_IMAGE_TOKENS", "NUM_PATCHES", "PIXEL_VALUES", "VISION_DATA_PREFIX", "VISION_FILE", "VISION_QUERY_BLOCK",
    "MERGE_STAGE", "PROJECTOR_STAGE", "VisionExportResult", "VisionSource", "build_embedding_proto",
    "build_vision_proto", "embedding_io", "export_vision", "resolve_vision_model", "vision_io",
    "vision_stages", "with_stage_outputs", "write_vision_graphs",
]
