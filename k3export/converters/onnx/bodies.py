# Copyright 2026 the k3export authors. Apache-2.0.
"""Standard-op bodies of the k3 functions that need control flow: routed experts and chunked KDA prefill.

Built with `Body`, a tiny node writer for FunctionProto and Loop/If subgraphs (unique names, int64 constants).

* ``moe_experts``: the token-slots sorted by expert and a ``Loop`` over blocks of the experts that were actually
  selected; each iteration gathers a block's weights once and runs its token-slots as batched MatMuls, so time
  and memory do not grow as tokens x top-k x expert size (the per-slot ``Gather`` of weights did). Decode
  gathers per slot. MXFP4 experts (FLOAT4E2M1 weights + FLOAT8E8M0 scales) are cropped to one selected expert
  per iteration and dequantised inside the loop (`mxfp4_expert`); ONNX Runtime runs them through
  `k3export.runtime.ort_session`.
* ``kda`` chunked: a ``Loop`` over chunks of `KDA_CHUNK` tokens carrying the state, with the UT transform
  (I + A)^-1 computed exactly as (I - A)(I + A^2)(I + A^4)(I + A^8) (A is strictly lower triangular 16 x 16, so
  A^16 = 0); only pairwise differences of cumulative log-decays are exponentiated, as in ``modeling.kda_chunked``.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from k3export.artifacts.graph_forms import EXPERT_BLOCK

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
#: chunk length of the in-graph chunked KDA (4 Neumann factors make its UT inverse exact); 32 and 64 were slower
KDA_CHUNK = 16
#: largest exponent the factored chunk decays may reach: (chunk - 1) x |gate bound|, in the upper triangle that
#: is masked afterwards (|k_i . k_j| <= 1, so each entry stays below exp(80) = 5.5e34, finite in fp32)
KDA_FACTOR_EXP = 80.0
#: up to this many tokens (decode), routed experts gather per slot instead of looping over the selected experts
FEW_TOKENS = 2


#: ONNX Runtime's contrib-op domain (``GatherBlockQuantized``: the ORT forms of quantized experts)
MS_DOMAIN = "com.microsoft"

class Body:
    """Nodes of one function body or subgraph, with fresh value names."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.nodes, self._n = prefix, [], 0
        self._renamed: dict[str, str] = {}  # value -> the output name `out` gave it

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> str | list[str]:
        outs = [f"{self.prefix}{op_type.lower()}_{self._n}_{i}" for i in range(n_out)]
        self._n += 1
        self.nodes.append(helper.make_node(op_type, [self._renamed.get(i, i) for i in inputs], outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype: int = I64, shape: list[int] | None = None) -> str:
        values = value if isinstance(value, list) else [value]
        dims = [len(values)] if shape is None and isinstance(value, list) else (shape or [])
        return self.op("Constant", [], value=helper.make_tensor(f"{self.prefix}c{self._n}", dtype, dims, values))

    def out(self, value: str, name: str) -> None:
        """Name `value` `name`, an output of this body. A value made here is renamed where it is made and used:
        ONNX Runtime copies a subgraph output that an ``Identity`` names (a KDA layer's [B, H, K, V] state, every
        decode step). An input, or a value already named, is named by an ``Identity``."""
        value = self._renamed.get(value, value)
        if value in self._renamed.values() or not any(value in n.output for n in self.nodes):
            self.nodes.append(helper.make_node("Identity", [value], [name]))
            return
        _rename(self.nodes, value, name)
        self._renamed[value] = name


def _rename(nodes, old: str, new: str) -> None:
    """Value `old` is called `new` in `nodes` and in the subgraphs they hold (which may read it from outside)."""
    for n in nodes:
        n.input[:] = [new if i == old else i for i in n.input]
        n.output[:] = [new if o == old else o for o in n.output]
        for a in n.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                _rename(g.node, old, new)
                for o in g.output:
                    o.name = new if o.name == old else o.name


def situ_glu_nodes(b: Body, gate: str, up: str, beta1: float, beta2: float, batched: bool = False,
                   up_rows: int | None = None) -> str:
    """SiTU-GLU in fp32 of gate/up (any float dtype), returned in gate's dtype (as ``k3::situ_glu``).

    ``batched``: up comes straight from a batched ``MatMul``. Its softcap then divides by beta2 expanded to up's
    shape, because ONNX Runtime folds a division by a scalar constant into the MatMul (``MatMulScaleFusion``),
    and the batched ``FusedMatMul`` it makes is ~3x slower (90 against 27 us at [8, 256, 256] x [8, 256, 1]:
    ~0.4 ms of a big_cfg decode step). gate has a second consumer (its sigmoid), so it is not folded. With
    ``up_rows`` (up's static second-to-last size, columns of one) the divisor is a constant [up_rows, 1] instead,
    which the fusion leaves alone too (it takes one-element scales), at no node."""
    g, u = b.op("Cast", [gate], to=F32), b.op("Cast", [up], to=F32)
    # the scalars as [1, 1] (gate and up have rank >= 2 here): ONNX Runtime 1.32's CPU Mul / Div of a tensor whose
    # last dim is 1 (these [..., I, 1] columns) by a rank-0 or rank-1 scalar goes element by element (~60 us for
    # 2,048 values at 2 threads against ~2 us by a [1, 1] one: bench/ort_broadcast.py); beta1 * beta2 in one product
    b1, b2 = b.const([beta1], F32, [1, 1]), b.const([beta2], F32, [1, 1])
    if up_rows is not None:
        u_div = b.const([beta2] * up_rows, F32, [up_rows, 1])
    else:
        u_div = b.op("Expand", [b2, b.op("Shape", [u])]) if batched else b2
    situ = b.op("Mul", [b.op("Tanh", [b.op("Div", [g, b1])]), b.op("Sigmoid", [g])])
    out = b.op("Mul", [b.op("Mul", [situ, b.op("Tanh", [b.op("Div", [u, u_div])])]),
                       b.const([beta1 * beta2], F32, [1, 1])])
    return b.op("CastLike", [out, gate])


def gather_expert(b: Body, weight: str | tuple[str, ...], e: str, like: str) -> str:
    """Expert ``e``'s weight [out, in] of a stacked [E, out, in] float weight (``Gather``); with a vector of
    experts (``gather_expert.many``), [S, out, in]."""
    return b.op("Gather", [weight, e], axis=0)


gather_expert.many = gather_expert  # type: ignore[attr-defined]


def mxfp4_expert(b: Body, weight: str | tuple[str, ...], e: str, like: str) -> str:
    """Expert ``e``'s weight [out, in] in ``like``'s dtype from (FLOAT4E2M1 [E, out, in], FLOAT8E8M0 [E, out, in/32]).

    No standard gather takes 4-bit or E8M0 tensors, but ``Pad`` does, and negative pads remove elements: pads
    ``[-e, e + 1 - E]`` on axis 0 crop the stack to expert e, so only that expert's bytes are read; a ``Reshape``
    to the stack's own [out, in] then gives the crop a static shape (OpenVINO dequantises no dynamically shaped
    blocks). Then ``DequantizeLinear(block_size=32, axis=-1)``: value * 2^(scale - 127), compressed-tensors'
    decoding."""
    packed, scale = weight
    crop = _cropper(b, packed, e)
    w, s = crop(packed), crop(scale)                                                     # [out, in], [out, in/32]
    dq = b.op("DequantizeLinear", [w, s], axis=-1, block_size=32, output_dtype=F32)
    return b.op("CastLike", [dq, like])


def _cropper(b: Body, stack: str, e: str):
    """A function cropping a stacked [E, out, x] tensor to expert ``e``'s [out, x] (`mxfp4_expert`: ``Pad`` with
    negative pads, then a ``Reshape`` to the static shape)."""
    e1 = b.op("Unsqueeze", [e, b.const([0])])
    n = b.op("Slice", [b.op("Shape", [stack]), b.const([0]), b.const([1])])
    pads = b.op("Concat", [b.op("Neg", [e1]), b.op("Sub", [b.op("Add", [e1, b.const([1])]), n])], axis=0)
    axes = b.const([0])

    def crop(stacked: str) -> str:
        static = b.op("Slice", [b.op("Shape", [stacked]), b.const([1]), b.const([3])])
        return b.op("Reshape", [b.op("Pad", [stacked, pads, "", axes]), static])

    return crop


def nvfp4_expert(b: Body, weight: str | tuple[str, ...], e: str, like: str) -> str:
    """Expert ``e``'s weight [out, in] in ``like``'s dtype from NVFP4 (FLOAT4E2M1 [E, out, in], FLOAT8E4M3FN
    [E, out, in/16], fp32 global scales [E]): cropped as `mxfp4_expert` does, the E4M3 block scales dequantised by
    the expert's global scale (``DequantizeLinear``, per tensor: the standard takes no E4M3 scale directly), then
    ``DequantizeLinear(block_size=16, axis=-1)`` of the values by them: e2m1 * (e4m3 * scale_2)."""
    packed, scale, scale_2 = weight
    crop = _cropper(b, packed, e)
    w, s8 = crop(packed), crop(scale)                                                    # [out, in], [out, in/16]
    s = b.op("DequantizeLinear", [s8, b.op("Gather", [scale_2, e], axis=0)])            # fp32 [out, in/16]
    dq = b.op("DequantizeLinear", [w, s], axis=-1, block_size=16)
    return b.op("CastLike", [dq, like])


def _one_expert(expert):
    """`expert` (one expert's weight [out, in]) as a gather of a block of experts [1, out, in] (a block of one)."""
    def many(b: Body, weight, e: str, like: str) -> str:
        return b.op("Unsqueeze", [expert(b, weight, b.op("Squeeze", [e, b.const([0])]), like), b.const([0])])
    return many


def moe_experts_nodes(b: Body, z: str, weights: str, indices: str, w1, w3, w2, act: str,
                      beta1: float, beta2: float, expert=gather_expert, block: int = EXPERT_BLOCK,
                      branches: bool = True, sequences: bool = True, unique: bool = True,
                      few_rows: int | None = None) -> str:
    """u [N, D] fp32 = sum_j weights[n, j] E_{indices[n, j]}(z[n]); w1/w3 [E, I, D], w2 [E, D, I].

    ``expert(body, w, e, like)`` returns expert e's weight [out, in] in ``like``'s dtype from ``w`` (one name, or a
    tuple of names for a quantised form, e.g. `mxfp4_expert`); ``expert.many(body, w, es, like)``, where the form
    has it, the experts of a vector ``es`` at once [len(es), out, in]. Each selected expert is read once per call.

    Many tokens: the token-slots are sorted by expert (``Unique`` + a ``TopK`` of their group, ties in slot
    order), the experts taken most-selected first, and a ``Loop`` runs `block` selected experts per iteration
    (`expert_block`; one for a form without ``many``): their weights gathered once, their tokens scattered into
    [block, M, D] (M: the block's largest group, zero-padded: ordering by count keeps a block's groups near
    equal), three batched MatMuls; each block appends its slots' rows to a sequence, concatenated after the loop.
    Each slot's output lands in its own row of [S, D] (scatter-adding a token's several slots into one row gave
    wrong sums in ONNX Runtime's parallel ``ScatterND``), and one [N, 1, k] x [N, k, D] MatMul weighs and sums a
    token's slots. Memory holds one block of experts, never tokens x top-k copies of weights. At most
    `FEW_TOKENS` tokens (decode), an ``If`` skips the sort: a token's slots name distinct experts, so gathering each
    slot's weights reads every selected expert once too. That gathers every slot's weights at once, so it is
    emitted only where a whole block of `EXPERT_BLOCK` experts fits `EXPERT_BLOCK_BYTES` (experts of up to
    8 MiB in fp32); larger ones decode through the loop, a block at a time (one K3 token's 16 experts would
    otherwise gather 2.1 GB of fp32 per MoE layer per step).

    ``branches=False``: no ``If``, every call takes the loop; ``sequences=False``: the loop carries the rows in an
    [S, D] tensor that each block scatters into, not a sequence; ``unique=False``: the slots per expert are counted
    against every expert id (an [S, E] comparison) instead of by ``Unique`` (the standard graph form,
    `forms.STANDARD`: TensorRT's parser has neither sequences nor ``Unique``).

    ``few_rows`` (the experts' intermediate size; the ort form, `forms.GraphForm.ort_contrib`): the few-token branch
    in as few nodes as it takes, since a plain ONNX Runtime session runs each node of the inlined body (~24 a layer
    against ~43): the experts gathered by ``indices`` [N, k] as they are ([N, k, out, in]), products broadcast
    over the [N, 1, D, 1] tokens, the slots weighed by one [N, 1, k] x [N, k, D] product, SiTU's divisor a
    constant, the general path's preparation inside its own branch."""
    gathers_many = hasattr(expert, "many")
    many = expert.many if gathers_many else _one_expert(expert)
    block = block if gathers_many else 1
    lean = few_rows is not None and branches and gathers_many and block >= EXPERT_BLOCK
    pre = Body(f"{b.prefix}p_") if lean else b  # lean: the general path's preparation goes into its branch
    flat = pre.op("Reshape", [indices, pre.const([-1])])                                 # [S] slot -> expert
    k = pre.op("Slice", [pre.op("Shape", [indices]), pre.const([1]), pre.const([2])])
    n_k = pre.op("Concat", [pre.const([-1]), k], axis=0)
    d = pre.op("Slice", [pre.op("Shape", [z]), pre.const([1]), pre.const([2])])
    w_nk = pre.op("Unsqueeze", [pre.op("Reshape", [weights, n_k]), pre.const([1])])         # [N, 1, k]
    n_slots = pre.op("Size", [flat])
    token = pre.op("Div", [pre.op("Range", [pre.const(0), n_slots, pre.const(1)]), pre.op("Squeeze", [k])])

    def glu(body: Body, gate: str, up: str) -> str:
        if act == "situ":
            return situ_glu_nodes(body, gate, up, beta1, beta2, batched=True)
        return body.op("Mul", [body.op("Mul", [gate, body.op("Sigmoid", [gate])]), up])

    def weigh(body: Body, y: str) -> str:  # y [S, D] fp32, slot order -> u [N, D]
        y = body.op("Reshape", [y, body.op("Concat", [n_k, d], axis=0)])                    # [N, k, D]
        return body.op("Squeeze", [body.op("MatMul", [w_nk, y]), body.const([1])])

    srt = Body(f"{b.prefix}l_")
    n_1 = srt.op("Unsqueeze", [n_slots, srt.const([0])])
    # the selected experts ordered by their number of slots, most first, so that a block pads its groups to a
    # near-equal largest one (zero padding to each block's largest group is MatMul work)
    if unique:
        experts, _, group, counts = srt.op("Unique", [flat], n_out=4, sorted=1)
        n_exp = srt.op("Size", [experts])
        by_count = srt.op("TopK", [counts, srt.op("Unsqueeze", [n_exp, srt.const([0])])], n_out=2, largest=1,
                          sorted=1)[1]                                                   # position -> group
        place = srt.op("ScatterElements", [by_count, by_count, srt.op("Range", [srt.const(0), n_exp,
                                                                                srt.const(1)])], axis=0)
        experts, counts = srt.op("Gather", [experts, by_count]), srt.op("Gather", [counts, by_count])
        group = srt.op("Gather", [place, group])                                         # [S] slot -> position
    else:  # every expert id counted, the unselected ones (count 0) sorted last and dropped
        n_all = srt.op("Slice", [srt.op("Shape", [w1 if isinstance(w1, str) else w1[0]]), srt.const([0]),
                                 srt.const([1])])                                        # [1] = E
        ids = srt.op("Range", [srt.const(0), srt.op("Squeeze", [n_all]), srt.const(1)])
        hits = srt.op("Equal", [srt.op("Unsqueeze", [flat, srt.const([1])]),
                                srt.op("Unsqueeze", [ids, srt.const([0])])])             # [S, E]
        counts = srt.op("ReduceSum", [srt.op("Cast", [hits], to=I64), srt.const([0])], keepdims=0)   # [E]
        n_exp = srt.op("ReduceSum", [srt.op("Cast", [srt.op("Greater", [counts, srt.const(0)])], to=I64)],
                       keepdims=0)
        by_count = srt.op("TopK", [counts, n_all], n_out=2, largest=1, sorted=1)[1]      # position -> expert
        place = srt.op("ScatterElements", [by_count, by_count, ids], axis=0)             # expert -> position
        experts = srt.op("Slice", [by_count, srt.const([0]), srt.op("Unsqueeze", [n_exp, srt.const([0])])])
        counts = srt.op("Gather", [counts, experts])
        group = srt.op("Gather", [place, flat])                                          # [S] slot -> position
    order = srt.op("TopK", [group, n_1], n_out=2, largest=0, sorted=1)[1]                 # slots by expert
    g_sorted = srt.op("Gather", [group, order])
    starts = srt.op("CumSum", [counts, srt.const(0)], exclusive=1)                       # [n_exp]
    rank = srt.op("Sub", [srt.op("Range", [srt.const(0), n_slots, srt.const(1)]),
                          srt.op("Gather", [starts, g_sorted])])                              # within its group
    z_sorted = srt.op("Gather", [z, srt.op("Gather", [token, order])], axis=0)           # [S, D]
    ends = srt.op("Concat", [starts, n_1], axis=0)                                       # [n_exp + 1]
    n_blocks = srt.op("Div", [srt.op("Add", [n_exp, srt.const(block - 1)]), srt.const(block)])
    y0 = srt.op("ConstantOfShape", [srt.op("Shape", [z_sorted])], value=helper.make_tensor("zero", F32, [1], [0.0]))

    x = Body(f"{b.prefix}e_")
    e0 = x.op("Mul", ["it", x.const(block)])
    e1 = x.op("Min", [x.op("Add", [e0, x.const(block)]), n_exp])
    e0v, e1v = x.op("Unsqueeze", [e0, x.const([0])]), x.op("Unsqueeze", [e1, x.const([0])])
    es = x.op("Slice", [experts, e0v, e1v])                                               # [nb] this block's
    rows = x.op("Range", [x.op("Gather", [ends, e0]), x.op("Gather", [ends, e1]), x.const(1)])  # its sorted slots
    at = x.op("Concat", [x.op("Unsqueeze", [x.op("Sub", [x.op("Gather", [g_sorted, rows]), e0]), x.const([1])]),
                         x.op("Unsqueeze", [x.op("Gather", [rank, rows]), x.const([1])])], axis=1)   # [Sb, 2]
    m = x.op("ReduceMax", [x.op("Slice", [counts, e0v, e1v]), x.const([0])], keepdims=1)
    xz = x.op("ConstantOfShape", [x.op("Concat", [x.op("Sub", [e1v, e0v]), m, d], axis=0)],
              value=helper.make_tensor("zero", F32, [1], [0.0]))
    xs = x.op("ScatterND", [x.op("CastLike", [xz, z]), at, x.op("Gather", [z_sorted, rows], axis=0)])
    xs = x.op("Transpose", [xs], perm=[0, 2, 1])                                          # [nb, D, M]
    gate = x.op("MatMul", [many(x, w1, es, xs), xs])                                      # [nb, I, M]
    up = x.op("MatMul", [many(x, w3, es, xs), xs])
    h = glu(x, gate, up)
    y = x.op("Transpose", [x.op("Cast", [x.op("MatMul", [many(x, w2, es, h), h])], to=F32)], perm=[0, 2, 1])
    rows_y = x.op("GatherND", [y, at])                                                      # [Sb, D]
    if sequences:
        x.out(x.op("SequenceInsert", ["ys_in", rows_y]), "ys_out")
        rows_type = helper.make_sequence_type_proto(helper.make_tensor_type_proto(F32, None))
    else:
        x.out(x.op("ScatterND", ["ys_in", x.op("Unsqueeze", [rows, x.const([1])]), rows_y]), "ys_out")
        rows_type = helper.make_tensor_type_proto(F32, None)
    x.out("cond_in", "cond_out")
    graph = helper.make_graph(
        x.nodes, "moe_expert_blocks",
        [helper.make_tensor_value_info("it", I64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_value_info("ys_in", rows_type)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_value_info("ys_out", rows_type)])
    true = srt.op("Constant", [], value=helper.make_tensor(f"{b.prefix}true", TensorProto.BOOL, [], [True]))
    # a sequence, not a carried [S, D] tensor updated by ScatterND, which ONNX Runtime copies whole every iteration
    # (S x D x blocks: 73 against 4.6 ms for 64 blocks of 16384 x 256 rows; up to 896 blocks of one K3 expert).
    # cond given: the ONNX reference evaluator runs no iteration of a Loop without it
    if sequences:
        blocks = srt.op("Loop", [n_blocks, true, srt.op("SequenceEmpty", [], dtype=F32)], body=graph)
        y_sorted = srt.op("ConcatFromSequence", [blocks], axis=0)
    else:
        y_sorted = srt.op("Loop", [n_blocks, true, y0], body=graph)                       # sorted slot order
    y_slots = srt.op("ScatterND", [y0, srt.op("Unsqueeze", [order, srt.const([1])]), y_sorted])   # slot order
    srt.out(weigh(srt, y_slots), "u_sorted")
    if not branches or not gathers_many or block < EXPERT_BLOCK:
        b.nodes += srt.nodes
        return "u_sorted"

    if lean:
        srt.nodes[:0] = pre.nodes
        few = Body(f"{b.prefix}s_")
        zs = few.op("Unsqueeze", [z, few.const([1, 3])])                                      # [N, 1, D, 1]
        gate = few.op("MatMul", [many(few, w1, indices, zs), zs])                             # [N, k, I, 1]
        up = few.op("MatMul", [many(few, w3, indices, zs), zs])
        h = situ_glu_nodes(few, gate, up, beta1, beta2, up_rows=few_rows) if act == "situ" else glu(few, gate, up)
        y = few.op("Squeeze", [few.op("Cast", [few.op("MatMul", [many(few, w2, indices, h), h])], to=F32),
                               few.const([3])])                                               # [N, k, D]
        u = few.op("MatMul", [few.op("Unsqueeze", [weights, few.const([1])]), y])           # [N, 1, D]
        few.out(few.op("Squeeze", [u, few.const([1])]), "u_few")
        is_few = b.op("LessOrEqual", [b.op("Shape", [z], start=0, end=1), b.const([FEW_TOKENS])])   # [1]
        return b.op("If", [is_few],
                    then_branch=helper.make_graph(few.nodes, "few_tokens", [], [helper.make_tensor_value_info(
                        "u_few", F32, None)]),
                    else_branch=helper.make_graph(srt.nodes, "sorted_experts", [], [helper.make_tensor_value_info(
                        "u_sorted", F32, None)]))
    few = Body(f"{b.prefix}s_")
    xs = few.op("Unsqueeze", [few.op("Gather", [z, token], axis=0), few.const([2])])          # [S, D, 1]
    gate = few.op("MatMul", [many(few, w1, flat, xs), xs])                                    # [S, I, 1]
    up = few.op("MatMul", [many(few, w3, flat, xs), xs])
    h = glu(few, gate, up)
    y = few.op("Cast", [few.op("MatMul", [many(few, w2, flat, h), h])], to=F32)              # [S, D, 1]
    few.out(weigh(few, y), "u_few")
    n_tokens = b.op("Slice", [b.op("Shape", [indices]), b.const([0]), b.const([1])])
    is_few = b.op("Squeeze", [b.op("LessOrEqual", [n_tokens, b.const([FEW_TOKENS])])])
    return b.op("If", [is_few],
                then_branch=helper.make_graph(few.nodes, "few_tokens", [], [helper.make_tensor_value_info(
                    "u_few", F32, None)]),
                else_branch=helper.make_graph(srt.nodes, "sorted_experts", [], [helper.make_tensor_value_info(
                    "u_sorted", F32, None)]))


def kda_chunked_nodes(b: Body, q: str, k: str, v: str, g: str, beta: str, s0: str, scale: str,
                      gate_bound: float | None = None) -> tuple[str, str]:
    """Chunked KDA over T > 1 tokens, fp32 [B, T, H, *] inputs -> (o [B, T, H, V], final state [B, H, K, V]).

    `gate_bound`: a lower bound of g per token that the model guarantees (K3: -5). When a chunk of it stays within
    `KDA_FACTOR_EXP`, the chunk's decays are factored through its middle row (two [C, K] x [K, C] MatMuls instead
    of [C, C, K] tensors; K3: exponents within +-40, 75 before masking); otherwise only pairwise differences are
    exponentiated (any g)."""
    C = KDA_CHUNK
    factored = gate_bound is not None and (C - 1) * abs(gate_bound) <= KDA_FACTOR_EXP
    T = b.op("Slice", [b.op("Shape", [q]), b.const([1]), b.const([2])])
    pad = b.op("Sub", [b.op("Mul", [b.op("Div", [b.op("Add", [T, b.const([C - 1])]), b.const([C])]), b.const([C])]), T])

    def chunks(x: str, rank: int) -> str:  # [B, T, H, (D)] -> [B, H, n, C, (D)], T zero-padded to n * C
        pads = b.op("Concat", [b.const([0] * (rank + 1)), pad, b.const([0] * (rank - 2))], axis=0)
        xt = b.op("Transpose", [b.op("Pad", [x, pads])], perm=[0, 2, 1, 3][:rank])         # [B, H, Tp, (D)]
        shape = b.op("Shape", [xt])
        dims = [b.op("Slice", [shape, b.const([0]), b.const([2])]), b.const([-1, C])]
        if rank == 4:
            dims.append(b.op("Slice", [shape, b.const([3]), b.const([4])]))
        return b.op("Reshape", [xt, b.op("Concat", dims, axis=0)])

    qc, kc, vc, gc, bc = chunks(q, 4), chunks(k, 4), chunks(v, 4), chunks(g, 4), chunks(beta, 3)
    qc = b.op("Mul", [qc, scale])
    n = b.op("Squeeze", [b.op("Slice", [b.op("Shape", [qc]), b.const([2]), b.const([3])])])

    lower = [[1.0 if i >= j else 0.0 for j in range(C)] for i in range(C)]
    strict = [[1.0 if i > j else 0.0 for j in range(C)] for i in range(C)]
    eye = [[1.0 if i == j else 0.0 for j in range(C)] for i in range(C)]

    x = Body(f"{b.prefix}c_")

    def take(t: str) -> str:
        return x.op("Gather", [t, "it"], axis=2)

    qi, ki, vi, gi, bi = (take(t) for t in (qc, kc, vc, gc, bc))                        # [B, H, C, (D)]
    G = x.op("CumSum", [gi, x.const(2)])                                                 # [B, H, C, K]
    if factored:  # exp(G_i - G_j) = exp(G_i - G_m) exp(G_m - G_j), m mid-chunk: two MatMuls
        G_m = x.op("Slice", [G, x.const([C // 2]), x.const([C // 2 + 1]), x.const([2])])  # [B, H, 1, K]
        up, down = x.op("Exp", [x.op("Sub", [G, G_m])]), x.op("Exp", [x.op("Sub", [G_m, G])])
        k_bar_t = x.op("Transpose", [x.op("Mul", [ki, down])], perm=[0, 1, 3, 2])       # [B, H, K, C]
        A = x.op("MatMul", [x.op("Mul", [ki, up]), k_bar_t])                             # [B, H, C, C]
        A_qk = x.op("Mul", [x.op("MatMul", [x.op("Mul", [qi, up]), k_bar_t]), x.const(sum(lower, []), F32, [C, C])])
    else:  # only pairwise differences exponentiated: any gate
        diff = x.op("Sub", [x.op("Unsqueeze", [G, x.const([3])]), x.op("Unsqueeze", [G, x.const([2])])])  # [B,H,C,C,K]
        lower_b = x.op("Cast", [x.const(sum(lower, []), F32, [C, C, 1])], to=TensorProto.BOOL)
        decay = x.op("Exp", [x.op("Where", [lower_b, diff, x.const(float("-inf"), F32)])])
        kk = x.op("Mul", [x.op("Unsqueeze", [ki, x.const([3])]), x.op("Unsqueeze", [ki, x.const([2])])])
        A = x.op("ReduceSum", [x.op("Mul", [kk, decay]), x.const([-1])], keepdims=0)     # [B, H, C, C]
        qk = x.op("Mul", [x.op("Unsqueeze", [qi, x.const([3])]), x.op("Unsqueeze", [ki, x.const([2])])])
        A_qk = x.op("ReduceSum", [x.op("Mul", [qk, decay]), x.const([-1])], keepdims=0)
    A = x.op("Mul", [x.op("Mul", [A, x.op("Unsqueeze", [bi, x.const([-1])])]), x.const(sum(strict, []), F32, [C, C])])
    # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8), exact for a strictly lower 16 x 16 A
    I = x.const(sum(eye, []), F32, [C, C])
    inv, p = x.op("Sub", [I, A]), A
    for _ in range(C.bit_length() - 2):  # C = 2^n: n - 1 squarings (A^C = 0)
        p = x.op("MatMul", [p, p])
        inv = x.op("MatMul", [inv, x.op("Add", [I, p])])
    eG = x.op("Exp", [G])
    rhs = x.op("Mul", [x.op("Concat", [vi, x.op("Mul", [ki, eG])], axis=-1), x.op("Unsqueeze", [bi, x.const([-1])])])
    UW = x.op("MatMul", [inv, rhs])
    V = x.op("Slice", [x.op("Shape", [vi]), x.const([3]), x.const([4])])
    U = x.op("Slice", [UW, x.const([0]), V, x.const([3])])
    W = x.op("Slice", [UW, V, x.const([2**62]), x.const([3])])
    v_new = x.op("Sub", [U, x.op("MatMul", [W, "s_in"])])
    o = x.op("Add", [x.op("MatMul", [x.op("Mul", [qi, eG]), "s_in"]), x.op("MatMul", [A_qk, v_new])])
    G_last = x.op("Slice", [G, x.const([-1]), x.const([C]), x.const([2])])               # [B, H, 1, K]
    s_dec = x.op("Mul", ["s_in", x.op("Transpose", [x.op("Exp", [G_last])], perm=[0, 1, 3, 2])])
    k_dec = x.op("Mul", [ki, x.op("Exp", [x.op("Sub", [G_last, G])])])
    s_next = x.op("Add", [s_dec, x.op("MatMul", [x.op("Transpose", [k_dec], perm=[0, 1, 3, 2]), v_new])])
    x.out("cond_in", "cond_out")
    x.out(s_next, "s_out")
    x.out(o, "o_out")
    graph = helper.make_graph(
        x.nodes, "kda_chunk_body",
        [helper.make_tensor_value_info("it", I64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_in", F32, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_out", F32, None), helper.make_tensor_value_info("o_out", F32, None)])
    # cond given: the ONNX reference evaluator runs no iteration of a Loop whose optional cond is left out
    true = b.op("Constant", [], value=helper.make_tensor(f"{b.prefix}true", TensorProto.BOOL, [], [True]))
    s_final, o_chunks = b.op("Loop", [n, true, s0], n_out=2, body=graph)                 # o: [n, B, H, C, V]
    o = b.op("Transpose", [stacked(b, o_chunks, n, 4)], perm=[1, 2, 0, 3, 4])
    o_shape = b.op("Shape", [o])
    o = b.op("Reshape", [o, b.op("Concat", [b.op("Slice", [o_shape, b.const([0]), b.const([2])]), b.const([-1]),
                                            b.op("Slice", [o_shape, b.const([4]), b.const([5])])], axis=0)])  # [B,H,Tp,V]
    o = b.op("Transpose", [b.op("Slice", [o, b.const([0]), T, b.const([2])])], perm=[0, 2, 1, 3])
    return o, s_final


def stacked(b: Body, scan: str, n: str, rank: int) -> str:
    """A ``Loop`` scan output of `n` iterations (int64 scalar) of rank-`rank` values, reshaped to its stacked
    [n, ...] shape: a no-op where the Loop stacks (the standard), and the same bytes in that shape where it
    concatenates along axis 0 instead (the ONNX reference evaluator's ``np.vstack``)."""
    per = b.op("Shape", [scan])
    shape = b.op("Concat", [b.op("Unsqueeze", [n, b.const([0])]), b.const([-1]),
                            b.op("Slice", [per, b.const([-(rank - 1)]), b.const([2**62])])], axis=0)
    return b.op("Reshape", [scan, shape])


def as_function(domain: str, name: str, inputs: list[str], outputs: list[str], body: Body, opset: int,
                attributes: list[str] | None = None) -> onnx.FunctionProto:
    return helper.make_function(domain, name, inputs, outputs, body.nodes, [helper.make_opsetid("", opset)],
                                attributes=attributes or [])


def _attr_const(b: Body, attr: str, kind: int) -> str:
    """A ``Constant`` holding the function attribute `attr` (a scalar)."""
    out = b.op("Constant", [])
    value_attr = {onnx.AttributeProto.FLOAT: "value_float", onnx.AttributeProto.INT: "value_int"}[kind]
    ref = helper.make_attribute_ref(value_attr, kind)
    ref.ref_attr_name = attr
    b.nodes[-1].attribute.append(ref)
    return out


def _subgraph(b: Body, name: str, outputs: list[str]) -> onnx.GraphProto:
    names = [f"{name}_{i}" for i in range(len(outputs))]
    for value, out in zip(outputs, names):
        b.out(value, out)
    return helper.make_graph(b.nodes, name, [], [helper.make_tensor_value_info(n, F32, None) for n in names])


def kda_step_nodes(b: Body, q: str, k: str, v: str, g: str, beta: str, s0: str, scale: str,
                   num_heads: int) -> tuple[str, str]:
    """One token of the recurrence, fp32 [B, 1, H, *] inputs -> (o [B, 1, H, V], state [B, H, K, V]):
    S = exp(g) S;  S += k (beta (v - kᵀS));  o = (scale q)ᵀ S. Three tiny MatMuls per head: 1.3x faster in
    ONNX Runtime than ``LinearAttention``, which it expands into a ``Scan``."""
    def heads(x: str, rows: int) -> str:  # [B, 1, H, D] -> [B, H, rows, D / rows] (a column when rows = -1)
        return b.op("Reshape", [x, b.const([0, num_heads, 1, -1] if rows == 1 else [0, num_heads, -1, 1])])

    s = b.op("Mul", [s0, b.op("Exp", [heads(g, -1)])])                                   # [B, H, K, V]
    k_row = heads(k, 1)
    delta = b.op("Mul", [b.op("Sub", [heads(v, 1), b.op("MatMul", [k_row, s])]),
                         b.op("Reshape", [beta, b.const([0, num_heads, 1, 1])])])          # [B, H, 1, V]
    s = b.op("Add", [s, b.op("MatMul", [heads(k, -1), delta])])
    o = b.op("MatMul", [heads(b.op("Mul", [q, scale]), 1), s])                          # [B, H, 1, V]
    return b.op("Reshape", [o, b.op("Shape", [v])]), s


def kda_function(domain: str, num_heads: int, opset: int, gate_bound: float | None = None,
                 branches: bool = True) -> onnx.FunctionProto:
    """``k3::kda``: one token -> the recurrence (`kda_step_nodes`); more -> the chunked form above (factored when
    the model bounds its gate: `gate_bound`). Inputs are cast to fp32; o comes back in q's dtype, the final state
    in fp32. ``branches=False``: no ``If``, the chunked form for every length (one token is a padded chunk)."""
    b = Body("")
    qf, kf, vf, gf, bf, s0 = (b.op("Cast", [n], to=F32) for n in ("q", "k", "v", "g", "beta", "initial_state"))
    scale = _attr_const(b, "scale", onnx.AttributeProto.FLOAT)
    if not branches:
        chunk = Body("c_")
        o, s = kda_chunked_nodes(chunk, qf, kf, vf, gf, bf, s0, scale, gate_bound)
        b.nodes += chunk.nodes
        b.out(b.op("CastLike", [o, "q"]), "o")
        b.out(s, "final_state")
        return as_function(domain, "kda", ["q", "k", "v", "g", "beta", "initial_state"], ["o", "final_state"], b,
                           opset, ["scale"])
    one_token = b.op("Equal", [b.op("Slice", [b.op("Shape", [qf]), b.const([1]), b.const([2])]), b.const([1])])

    rec = Body("r_")
    o_rec, s_rec = kda_step_nodes(rec, qf, kf, vf, gf, bf, s0, scale, num_heads)
    chunk = Body("c_")
    o_chk, s_chk = kda_chunked_nodes(chunk, qf, kf, vf, gf, bf, s0, scale, gate_bound)
    o, s = b.op("If", [b.op("Squeeze", [one_token])], n_out=2,
                then_branch=_subgraph(rec, "recurrent", [o_rec, s_rec]),
                else_branch=_subgraph(chunk, "chunked", [o_chk, s_chk]))
    b.out(b.op("CastLike", [o, "q"]), "o")
    b.out(s, "final_state")
    return as_function(domain, "kda", ["q", "k", "v", "g", "beta", "initial_state"], ["o", "final_state"], b, opset,
                       ["scale"])


def moe_experts_function(domain: str, act: str, beta1: float, beta2: float, opset: int,
                         mxfp4: bool = False, block: int = EXPERT_BLOCK, branches: bool = True,
                         sequences: bool = True, unique: bool = True, nvfp4: bool = False,
                         few_rows: int | None = None) -> onnx.FunctionProto:
    """``k3::moe_experts(z, weights, indices, w1, w3, w2) -> u`` fp32 [N, D]; attributes act, beta1, beta2 (baked
    into this model-local body, read by the TensorRT plugin).

    ``mxfp4``: the experts of an MXFP4 export, ``k3::moe_experts(z, weights, indices, w1, w3, w2, w1_scale,
    w3_scale, w2_scale)`` with w* FLOAT4E2M1 and w*_scale FLOAT8E8M0 [E, out, in/32]; the loop dequantises only
    the selected experts (`mxfp4_expert`). Needs opset >= 25 (``Pad`` / ``DequantizeLinear`` on 4-bit types).
    `block`: selected experts per loop iteration (`expert_block` of the model's expert size); `branches`,
    `sequences`, `unique`, `few_rows` (dense experts only): as `moe_experts_nodes`.

    ``nvfp4``: the experts in NVIDIA's NVFP4 (`k3export.ops.spec.MOE_EXPERTS_NVFP4`), ``k3::moe_experts(z, weights,
    indices, w1, w3, w2, w1_scale, w3_scale, w2_scale, w1_scale_2, w3_scale_2, w2_scale_2)`` with w* FLOAT4E2M1,
    w*_scale FLOAT8E4M3FN [E, out, in/16] and w*_scale_2 fp32 [E] (`nvfp4_expert`)."""
    b = Body("")
    names = ["z", "weights", "indices", "w1", "w3", "w2"]
    if nvfp4:
        names += ["w1_scale", "w3_scale", "w2_scale", "w1_scale_2", "w3_scale_2", "w2_scale_2"]
        ws = [(w, f"{w}_scale", f"{w}_scale_2") for w in ("w1", "w3", "w2")]
        u = moe_experts_nodes(b, "z", "weights", "indices", *ws, act, beta1, beta2, expert=nvfp4_expert,
                              branches=branches, sequences=sequences, unique=unique)
    elif mxfp4:
        names += ["w1_scale", "w3_scale", "w2_scale"]
        ws = [("w1", "w1_scale"), ("w3", "w3_scale"), ("w2", "w2_scale")]
        u = moe_experts_nodes(b, "z", "weights", "indices", *ws, act, beta1, beta2, expert=mxfp4_expert,
                              branches=branches, sequences=sequences, unique=unique)
    else:
        u = moe_experts_nodes(b, "z", "weights", "indices", "w1", "w3", "w2", act, beta1, beta2, block=block,
                              branches=branches, sequences=sequences, unique=unique, few_rows=few_rows)
    b.out(u, "u")
    return as_function(domain, "moe_experts", names, ["u"], b, opset, ["act", "beta1", "beta2"])
