# Copyright 2026 the k3export authors. Apache-2.0.
"""Standard-op subgraphs of the exported graph fused into one kernel of ONNX Runtime's k3 ops library.

A decode step runs hundreds of nodes on a few KB each, each with its own dispatch, so a string of them done by one
kernel is time saved (docs/speed.md has the figures). The exporter applies these fusions to the graph it built
(`export.write_fused`, ``export --kernels``) and writes each fused op as a k3 function whose body is the subgraph it
replaced (`fused_bodies`; the ops' contracts: `k3export.ops.spec.FUSED_SPECS`), so every consumer still reads the
file, and ONNX Runtime with the library and OpenVINO with the extension run one kernel; the library's session is
checked against the standard ops (tests/runtime/test_ort_ops.py).

* ``attn_res_aggregate``: the Attention-Residuals aggregate that `graph.K3GraphBuilder.aggregate` writes
  (``RMSNormalization`` of the stacked sources, ``ReduceSum``, ``Softmax`` over depth, ``Mul``, ``ReduceSum``, and
  the ``Unsqueeze`` + ``Concat`` that stack them) becomes one node
  ``k3::attn_res_aggregate(weight, *sources, epsilon)`` over the unstacked sources; its kernel is
  ``k3::attn_res_aggregate`` in ``ops/csrc/kernels/attn_res_aggregate.h``, the maths of ``modeling_k3.attn_res_aggregate``.

* ``mla_attend``: the ``If`` that runs MLA's attention in one call or in blocks of queries (its then branch named
  `forms.MLA_QUERY_BLOCKS`) becomes one node ``k3::mla_attend(q, lat_t, c, visible[, any_key]; scale, fill)`` that
  computes it a query row at a time (kernel ``k3::mla_attend``): no ``If``, and no [B, H, T, S] scores at any length.
  Where the latents come from the cache's key / value halves (`graph.K3GraphBuilder.latent_cache`), the node reads
  those halves in place instead (``halves = 1``, ``value_dim`` Dc), and the cache is not joined, transposed or
  sliced at every call.

* ``short_conv``: KDA's short convolution as `graph.K3GraphBuilder.short_conv` writes it (the conv state
  transposed onto the new rows, one ``Mul`` per tap, SiLU, the new state's window transposed back) becomes one node
  ``k3::short_conv(state, x, taps[, start]) -> (y, present)`` (kernel ``k3::short_conv``, the maths of
  ``modeling_k3.short_conv``).

* ``l2_norm``: the L2 normalisation of KDA's q and k as `graph.K3GraphBuilder.l2norm` writes it (``Mul``,
  ``ReduceSum``, ``Add`` of eps, ``Sqrt``, ``Div``) becomes one node ``k3::l2_norm(x; epsilon)`` over the last axis
  (kernel ``k3::l2_norm``, the maths of ``modeling_k3.l2norm``).

* ``kda_layer``: a ``k3::short_conv`` whose output is split into q, k and v (``Split`` on the last axis, each
  part reshaped to heads), q and k through ``k3::l2_norm``, and the three into ``k3::kda``, as the fusions above leave
  a KDA layer, becomes one node ``k3::kda_layer(state, x, taps, g, beta, initial_state[, start]; scale,
  epsilon) -> (o, present, final_state)`` (kernel ``k3::kda_layer``): in OpenVINO each of those nodes was a
  layer of its own with a per-call cost (docs/speed.md).

* ``moe_route_experts``: a ``k3::moe_route`` whose weights and indices only a ``k3::moe_experts`` reads becomes one
  node ``k3::moe_route_experts(logits, bias, z, w1, w3, w2[, w1_scale, w3_scale, w2_scale]; top_k, renormalize,
  scale, act, beta1, beta2) -> u`` (with MXFP4 experts too; the k3 ORT library reads it as
  ``moe_route_experts_mxfp4``, `k3export.artifacts.expert_views.packed_view`): the router, then the experts on its
  slots, in one call (``k3::Routed`` in the kernels), one OpenVINO layer less a MoE layer.

Nodes that only fed what was fused are dropped. A subgraph that differs in any way (another axis, an intermediate
used twice or a graph output) is left alone.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from k3export.ops import spec

from .functions import DOMAIN, DOMAIN_VERSION
# not .graph: graph.py needs transformers
from .forms import INT64_MAX, MLA_QUERY_BLOCKS, value_uses

# the fused ops' names, from their contracts (`k3export.ops.spec.FUSED_SPECS`)
ATTN_RES_AGGREGATE = spec.ATTN_RES_AGGREGATE.name
MLA_ATTEND = spec.MLA_ATTEND.name
SHORT_CONV = spec.SHORT_CONV.name
L2_NORM = spec.L2_NORM.name
KDA_LAYER = spec.KDA_LAYER.name
MOE_ROUTE_EXPERTS = spec.MOE_ROUTE_EXPERTS.name


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _constant(consts: dict[str, onnx.TensorProto], name: str) -> list | None:
    """The value of initializer `name` as a flat list (None when no initializer has that name)."""
    t = consts.get(name)
    return None if t is None else numpy_helper.to_array(t).reshape(-1).tolist()


class _Index:
    """Who makes and who reads each value of a main graph (`nodes`, its node wrappers, held: fusions key them by
    id), its outputs and inputs, and its constants."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.nodes = list(graph.node)
        self.consts = {t.name: t for t in graph.initializer}
        self.producer = {o: n for n in self.nodes for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in graph.output}
        self.inputs = {i.name for i in graph.input}

    def made(self, value: str, op: str, domain: str = "") -> onnx.NodeProto | None:
        """The `op` node of `domain` (standard: "") that makes `value`, if that is what makes it."""
        node = self.producer.get(value)
        return node if node is not None and node.op_type == op and node.domain == domain else None

    def only(self, value: str, op: str) -> onnx.NodeProto | None:
        """The one node that reads `value` (not a graph output), if it is a standard-domain `op`."""
        users = self.consumers.get(value, [])
        ok = len(users) == 1 and users[0].op_type == op and users[0].domain == "" and value not in self.outputs
        return users[0] if ok else None

    def sole(self, value: str, user: onnx.NodeProto) -> bool:
        """Whether `user` is all that reads `value` (not a graph output)."""
        return [id(n) for n in self.consumers.get(value, [])] == [id(user)] and value not in self.outputs

    def const(self, name: str) -> list | None:
        """An initializer's values, or those of a Concat (axis 0) of initializers (`graph.shape_of`)."""
        node = self.made(name, "Concat")
        if node is None:
            return _constant(self.consts, name)
        parts = [_constant(self.consts, i) for i in node.input]
        return None if None in parts or _attr(node, "axis", None) != 0 else sum(parts, [])


def fuse_attn_res(model: onnx.ModelProto) -> int:
    """Fuse every Attention-Residuals aggregate of `model`'s main graph (in place, weights not needed); returns how
    many were fused."""
    g = _Index(model)
    nodes, producer, consumers, outputs, only = g.nodes, g.producer, g.consumers, g.outputs, g.only

    def axes(node: onnx.NodeProto) -> list[int] | None:
        return g.const(node.input[1]) if len(node.input) > 1 else None

    def unstacked(vals: str) -> list[str] | None:
        """The [N, D] sources that `vals` [S, N, D] stacks with Unsqueeze (axis 0), then Concat (axis 0)."""
        concat = g.made(vals, "Concat")
        parts = [vals] if g.made(vals, "Unsqueeze") else (
            list(concat.input) if concat is not None and _attr(concat, "axis", None) == 0 else None)
        if parts is None:
            return None
        sources = []
        for p in parts:
            u = g.made(p, "Unsqueeze")
            if u is None or axes(u) != [0]:
                return None
            sources.append(u.input[0])
        return sources

    fused: dict[int, onnx.NodeProto] = {}  # id of the last node of a fused pattern -> the fused node
    dropped: set[int] = set()
    for norm in nodes:
        if norm.op_type != "RMSNormalization" or norm.domain != "" or _attr(norm, "axis", -1) != -1 \
                or _attr(norm, "stash_type", 1) != 1:
            continue
        vals, weight = norm.input[0], norm.input[1]
        logits = only(norm.output[0], "ReduceSum")
        if logits is None or axes(logits) != [-1] or _attr(logits, "keepdims", 1) != 1:
            continue
        alpha = only(logits.output[0], "Softmax")
        if alpha is None or _attr(alpha, "axis", -1) != 0:
            continue
        weighed = only(alpha.output[0], "Mul")
        if weighed is None or sorted(weighed.input) != sorted([alpha.output[0], vals]):
            continue
        total = only(weighed.output[0], "ReduceSum")
        if total is None or axes(total) != [0] or _attr(total, "keepdims", 1) != 0:
            continue
        sources = unstacked(vals)
        if sources is None or {id(n) for n in consumers[vals]} != {id(norm), id(weighed)} or vals in outputs:
            continue
        fused[id(total)] = helper.make_node(
            ATTN_RES_AGGREGATE, [weight, *sources], [total.output[0]], name=f"{norm.name}/{ATTN_RES_AGGREGATE}",
            domain=DOMAIN, epsilon=float(_attr(norm, "epsilon", 1e-5)))
        dropped |= {id(norm), id(logits), id(alpha), id(weighed), id(producer[vals])}
    if not fused:
        return 0
    _replace(model, nodes, fused, dropped)
    return len(fused)


def fuse_mla_attend(model: onnx.ModelProto) -> int:
    """Replace each ``If`` of `model`'s main graph that picks MLA's attention in one call or in blocks of queries
    (`graph.K3GraphBuilder.in_query_blocks`) by one ``k3::mla_attend`` node, which computes it a query row at a
    time at every length (in place, weights not needed); returns how many were replaced. The one-call branch gives
    the node's inputs and constants: ``MatMul(q, lat_t)``, ``Mul`` by the scale, ``Where(visible, ., fill)``,
    ``Softmax`` over the keys, with an attention mask ``Mul`` by ``any_key``, and ``MatMul`` by the latents ``c``."""
    g = _Index(model)
    nodes = g.nodes

    def scalar(name: str) -> float | None:
        value = _constant(g.consts, name)
        return float(value[0]) if value is not None and len(value) == 1 else None

    fused: dict[int, onnx.NodeProto] = {}
    for node in nodes:
        if node.op_type != "If" or len(node.output) != 1:
            continue
        branches = {a.name: a.g for a in node.attribute}
        then, whole = branches.get("then_branch"), branches.get("else_branch")
        if then is None or whole is None or not then.name.rsplit("/", 1)[-1].startswith(MLA_QUERY_BLOCKS):
            continue
        ops = [n.op_type for n in whole.node]
        if ops not in (["MatMul", "Mul", "Where", "Softmax", "MatMul"], ["MatMul", "Mul", "Where", "Softmax", "Mul",
                                                                            "MatMul"]):
            continue
        first, scaled, where, softmax, *gated, last = whole.node
        probs = gated[0] if gated else softmax
        linked = (scaled.input[0] == first.output[0] and where.input[1] == scaled.output[0]
                  and softmax.input[0] == where.output[0] and (not gated or gated[0].input[0] == softmax.output[0])
                  and last.input[0] == probs.output[0] and last.output[0] == whole.output[0].name
                  and _attr(softmax, "axis", -1) == -1)
        scale, fill = scalar(scaled.input[1]), scalar(where.input[2])
        if not linked or scale is None or fill is None:
            continue
        inputs = [first.input[0], first.input[1], last.input[1], where.input[0]] + [m.input[1] for m in gated]
        halves = _cache_halves(g, inputs[1], inputs[2])
        if halves is not None:
            inputs[1:3] = halves[:2]
        fused[id(node)] = helper.make_node(MLA_ATTEND, inputs, list(node.output), name=f"{node.name}/{MLA_ATTEND}",
                                           domain=DOMAIN, scale=scale, fill=fill, halves=int(halves is not None),
                                           value_dim=halves[2] if halves is not None else 0)
    if fused:
        _replace(model, nodes, fused, set())
    return len(fused)


def _cache_halves(g: _Index, lat_t: str, c: str) -> tuple[str, str, int] | None:
    """(key, value, Dc) when MLA's transposed latents `lat_t` [B, 1, R, S] and their first Dc features `c` are cut from
    the join of the cache's present key / value halves, as `graph.K3GraphBuilder.latent_cache` writes it
    (``Squeeze(Concat(key, value))``, cut to R when 2W > R; ``Unsqueeze(Transpose)`` and ``Unsqueeze(Slice)`` of it):
    the fused attention then reads the halves in place, and the join, its transpose and the slice go unread. None for
    another graph (an export written before `latent_cache`: its attention reads `lat_t` and `c`)."""
    def front(node: onnx.NodeProto | None) -> list | None:
        """The end of `node`, a ``Slice`` of features [0, end) on axis 2; None for anything else."""
        ok = node is not None and len(node.input) == 4 and g.const(node.input[1]) == [0] and \
            g.const(node.input[3]) == [2]
        return g.const(node.input[2]) if ok else None

    cut_t, cut_c = (g.made(v, "Unsqueeze") for v in (lat_t, c))
    if cut_t is None or cut_c is None or g.const(cut_t.input[1]) != [1] or g.const(cut_c.input[1]) != [1]:
        return None
    tr, sl = g.made(cut_t.input[0], "Transpose"), g.made(cut_c.input[0], "Slice")
    dc = front(sl)
    if tr is None or dc is None or _attr(tr, "perm", None) != [0, 2, 1] or sl.input[0] != tr.input[0]:
        return None
    latent = tr.input[0]
    cut = g.made(latent, "Slice")  # the join cut to R (2W > R)
    if cut is not None and front(cut) is None:
        return None
    squeeze = g.made(cut.input[0] if cut is not None else latent, "Squeeze")
    join = g.made(squeeze.input[0], "Concat") if squeeze is not None and g.const(squeeze.input[1]) == [1] else None
    if join is None or len(join.input) != 2 or _attr(join, "axis", None) != -1:
        return None
    return join.input[0], join.input[1], int(dc[0])


def fuse_short_conv(model: onnx.ModelProto) -> int:
    """Fuse each KDA short convolution of `model`'s main graph as `graph.K3GraphBuilder.short_conv` writes it into
    one ``k3::short_conv(state, x, taps[, start]) -> (y, present)`` node (in place, weights not needed); returns how
    many were fused. The pattern: ``full = Concat(Transpose(state), x)`` along time, one ``Mul`` per tap of
    ``Slice``s of `full` and of `taps` [K, C], their ``Sum``, SiLU (``Mul`` by its ``Sigmoid``), and the new state
    ``Transpose`` of the window of `full` from row `start`: ``Slice`` of the last K - 1 rows (no mask: start = T),
    or ``GatherElements`` at ``start + [0, K - 1)`` (``start`` = `graph.K3GraphBuilder.last_real`)."""
    g = _Index(model)
    nodes, consumers, outputs, made, sole, const = g.nodes, g.consumers, g.outputs, g.made, g.sole, g.const

    def sliced(node: onnx.NodeProto | None, start: int, end: int, axis: int) -> str | None:
        """The data input of `node` when it is Slice(data, [start], [end], [axis]) with unit steps."""
        if node is None or node.op_type != "Slice" or len(node.input) not in (4, 5):
            return None
        steps = const(node.input[4]) if len(node.input) == 5 else [1]
        given = [const(node.input[1]), const(node.input[2]), const(node.input[3]), steps]
        return node.input[0] if given == [[start], [end], [axis], [1]] else None

    def window(node: onnx.NodeProto, km1: int) -> tuple[str | None, bool]:
        """(start, whether `node` is the new state's window of `full`): None for the last K - 1 rows."""
        if node.op_type == "Slice":
            return None, sliced(node, -km1, INT64_MAX, 1) is not None
        if node.op_type != "GatherElements" or _attr(node, "axis", 0) != 1:
            return None, False
        expand = made(node.input[1], "Expand")
        add = made(expand.input[0], "Add") if expand is not None else None
        if add is None:
            return None, False
        for rows, offsets in (add.input, add.input[::-1]):
            reshape = made(rows, "Reshape")
            if reshape is not None and const(reshape.input[1]) == [-1, 1, 1] and \
                    const(offsets) == list(range(km1)):
                return reshape.input[0], True
        return None, False

    fused: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for total in nodes:
        if total.op_type != "Sum" or total.domain != "" or len(total.input) < 2:
            continue
        K = len(total.input)
        full = taps = None
        parts: list[onnx.NodeProto] = []
        for j, term in enumerate(total.input):
            mul = made(term, "Mul")
            if mul is None or not sole(term, total):
                break
            shifted, tap = made(mul.input[0], "Slice"), made(mul.input[1], "Slice")
            f = sliced(shifted, j, j - (K - 1) if j < K - 1 else INT64_MAX, 1)
            t = sliced(tap, j, j + 1, 0)
            if f is None or t is None or (full or f) != f or (taps or t) != t or not sole(mul.input[0], mul) \
                    or not sole(mul.input[1], mul):
                break
            full, taps = f, t
            parts += [mul, shifted, tap]
        else:
            users = consumers.get(total.output[0], [])
            sig = next((u for u in users if u.op_type == "Sigmoid"), None)
            silu = next((u for u in users if u.op_type == "Mul"), None)
            concat = made(full, "Concat")
            turned = made(concat.input[0], "Transpose") if concat is not None and len(concat.input) == 2 else None
            if sig is None or silu is None or len(users) != 2 or total.output[0] in outputs \
                    or sorted(silu.input) != sorted([total.output[0], sig.output[0]]) \
                    or not sole(sig.output[0], silu) or turned is None or _attr(concat, "axis", None) != 1 \
                    or _attr(turned, "perm", None) != [0, 2, 1] or turned.input[0] not in g.inputs \
                    or not sole(turned.output[0], concat) or full in outputs:
                continue
            ends = [u for u in consumers[full] if id(u) not in {id(p) for p in parts}]
            start, ok = window(ends[0], K - 1) if len(ends) == 1 else (None, False)
            after = consumers.get(ends[0].output[0], []) if ok else []
            present = after[0] if len(after) == 1 and after[0].op_type == "Transpose" else None
            if present is None or _attr(present, "perm", None) != [0, 2, 1] or ends[0].output[0] in outputs:
                continue
            args = [turned.input[0], concat.input[1], taps] + ([start] if start is not None else [])
            # at the present's place: the window's `start` may be made after the SiLU
            fused[id(present)] = helper.make_node(
                SHORT_CONV, args, [silu.output[0], present.output[0]], name=f"{total.name}/{SHORT_CONV}",
                domain=DOMAIN)
            dropped |= {id(n) for n in [*parts, total, sig, silu, concat, turned, ends[0]]}
    if fused:
        _replace(model, nodes, fused, dropped)
    return len(fused)


def fuse_l2_norm(model: onnx.ModelProto) -> int:
    """Fuse each L2 normalisation of `model`'s main graph as `graph.K3GraphBuilder.l2norm` writes it (KDA's q and k:
    ``Div(x, Sqrt(Add(ReduceSum(Mul(x, x), [-1], keepdims=1), eps)))``) into one ``k3::l2_norm(x; epsilon)`` node
    (in place, weights not needed); returns how many were fused."""
    g = _Index(model)
    fused: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for div in g.nodes:
        if div.op_type != "Div" or div.domain != "":
            continue
        x = div.input[0]
        sqrt = g.made(div.input[1], "Sqrt")
        add = g.made(sqrt.input[0], "Add") if sqrt is not None else None
        if add is None:
            continue
        for total, eps in (add.input, add.input[::-1]):
            ss, value = g.made(total, "ReduceSum"), g.const(eps)
            if ss is not None and value is not None and len(value) == 1:
                break
        else:
            continue
        sq = g.made(ss.input[0], "Mul")
        if sq is None or list(sq.input) != [x, x] or len(ss.input) != 2 or g.const(ss.input[1]) != [-1] \
                or _attr(ss, "keepdims", 1) != 1 or not all(g.sole(v, u) for v, u in (
                    (sq.output[0], ss), (ss.output[0], add), (add.output[0], sqrt), (sqrt.output[0], div))):
            continue
        fused[id(div)] = helper.make_node(L2_NORM, [x], [div.output[0]], name=f"{div.name}/{L2_NORM}", domain=DOMAIN,
                                          epsilon=float(value[0]))
        dropped |= {id(sq), id(ss), id(add), id(sqrt)}
    if fused:
        _replace(model, g.nodes, fused, dropped)
    return len(fused)


def fuse_kda_layer(model: onnx.ModelProto) -> int:
    """Fuse each ``k3::kda`` of `model`'s main graph whose q, k and v are the parts of one ``k3::short_conv``'s output
    (``Split`` on the last axis into [HK, HK, HV], each ``Reshape``d to [.., H, K] or [.., H, V], q and k through
    ``k3::l2_norm`` of one epsilon) into one ``k3::kda_layer`` node; returns how many were fused. Run after
    `fuse_short_conv` and `fuse_l2_norm`, whose nodes it reads."""
    g = _Index(model)

    def heads(reshape: onnx.NodeProto | None) -> list | None:
        """The last two entries of a Reshape's target shape when they are constants (`graph.shape_of`'s Concat)."""
        concat = g.made(reshape.input[1], "Concat") if reshape is not None else None
        if concat is None or _attr(concat, "axis", None) != 0 or len(concat.input) < 3:
            return None
        tail = [_constant(g.consts, i) for i in concat.input[-2:]]
        return None if None in tail or any(len(t) != 1 for t in tail) else [t[0] for t in tail]

    fused: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for kda in g.nodes:
        if kda.op_type != "kda" or kda.domain != DOMAIN or len(kda.input) != 6:
            continue
        norms = [g.made(kda.input[i], L2_NORM, DOMAIN) for i in (0, 1)]
        if None in norms or _attr(norms[0], "epsilon", None) != _attr(norms[1], "epsilon", None):
            continue
        shaped = [g.made(n.input[0], "Reshape") for n in norms] + [g.made(kda.input[2], "Reshape")]
        if None in shaped:
            continue
        split = g.made(shaped[0].input[0], "Split")
        conv = g.made(split.input[0], SHORT_CONV, DOMAIN) if split is not None else None
        dims = [heads(r) for r in shaped]
        if conv is None or None in dims or dims[0] != dims[1] or len(split.output) != 3 or len(split.input) != 2 \
                or _attr(split, "axis", 0) not in (-1, 2) or not g.sole(conv.output[0], split) \
                or [r.input[0] for r in shaped] != list(split.output) \
                or g.const(split.input[1]) != [dims[0][0] * dims[0][1]] * 2 + [dims[2][0] * dims[2][1]] \
                or not all(g.sole(v, u) for v, u in (*zip(split.output, shaped), (shaped[0].output[0], norms[0]),
                                                      (shaped[1].output[0], norms[1]), (norms[0].output[0], kda),
                                                      (norms[1].output[0], kda), (shaped[2].output[0], kda))):
            continue
        state, x, taps = conv.input[:3]
        args = [state, x, taps, *kda.input[3:]] + list(conv.input[3:])
        fused[id(kda)] = helper.make_node(
            KDA_LAYER, args, [kda.output[0], conv.output[1], kda.output[1]], name=f"{kda.name}/{KDA_LAYER}",
            domain=DOMAIN, scale=float(_attr(kda, "scale", 1.0)), epsilon=float(_attr(norms[0], "epsilon", 1e-6)))
        dropped |= {id(n) for n in [conv, split, *shaped, *norms]}
    if fused:
        _replace(model, g.nodes, fused, dropped, reorder=True)
    return len(fused)


def fuse_moe_route_experts(model: onnx.ModelProto) -> int:
    """Fuse each ``k3::moe_experts`` of `model`'s main graph (dense or MXFP4) whose weights and indices are the two
    outputs of one ``k3::moe_route``, read by nothing else, with that router into one ``k3::moe_route_experts``
    node; returns how many were fused."""
    g = _Index(model)
    fused: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for experts in g.nodes:
        if experts.domain != DOMAIN or experts.op_type != spec.MOE_EXPERTS.name or len(experts.input) < 3:
            continue
        route = g.made(experts.input[1], "moe_route", DOMAIN)
        if route is None or list(experts.input[1:3]) != list(route.output) \
                or not all(g.sole(v, experts) for v in route.output):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in (*route.attribute, *experts.attribute)}
        attrs.pop("plugin_namespace", None)  # TensorRT's, of the export's nodes
        fused[id(experts)] = helper.make_node(MOE_ROUTE_EXPERTS, [*route.input, experts.input[0], *experts.input[3:]],
                                              list(experts.output), name=f"{experts.name}/{MOE_ROUTE_EXPERTS}",
                                              domain=DOMAIN,
                                              **attrs)
        dropped.add(id(route))
    if fused:
        _replace(model, g.nodes, fused, dropped)
    return len(fused)


def _in_order(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` in their order but for each moved after the nodes that make what it reads: a fused node stands where
    the last node it replaced stood, which may come after a reader of an output it took over."""
    made = {o for n in nodes for o in n.output}
    order: list[onnx.NodeProto] = []
    have: set[str] = set()
    waiting: list[onnx.NodeProto] = []
    for node in nodes:
        waiting.append(node)
        while True:
            ready = next((w for w in waiting if all(v in have or v not in made for v in value_uses([w]))), None)
            if ready is None:
                break
            waiting.remove(ready)
            order.append(ready)
            have.update(ready.output)
    if waiting:
        raise ValueError(f"fusions: node {waiting[0].name!r} reads a value no node before it makes (a cycle)")
    return order


def _replace(model: onnx.ModelProto, nodes: list[onnx.NodeProto], fused: dict[int, onnx.NodeProto],
             dropped: set[int], reorder: bool = False) -> None:
    """`model`'s main graph as `nodes` (its nodes, the objects whose ids key `fused` and `dropped`) with node id ->
    fused node swapped in, the `dropped` nodes out (`reorder`: then sorted, `_in_order`), then every node whose
    outputs nothing reads any more (in a branch inside a node either) nor is a graph output, until none is left, and
    the initializers no node reads."""
    graph = model.graph
    nodes = [fused.get(id(n), n) for n in nodes if id(n) not in dropped]
    if reorder:
        nodes = _in_order(nodes)
    outputs = {o.name for o in graph.output}
    while True:
        read = set(value_uses(nodes)) | outputs
        live = [n for n in nodes if any(o in read for o in n.output)]
        if len(live) == len(nodes):
            break
        nodes = live
    del graph.node[:]
    graph.node.extend(nodes)
    inputs = {i.name for i in graph.input}  # an input's default stays, read or not
    unread = [t for t in graph.initializer if t.name not in read | inputs]  # what was fused read (ORT warns)
    for t in unread:
        graph.initializer.remove(t)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))


def fuse(model: onnx.ModelProto, route_experts: bool = True) -> int:
    """Every fusion of this module on `model` (in place; `route_experts`: ``fuse_moe_route_experts`` too); returns
    how many nodes were fused."""
    return (fuse_attn_res(model) + fuse_mla_attend(model) + fuse_short_conv(model) + fuse_l2_norm(model)
            + fuse_kda_layer(model) + (fuse_moe_route_experts(model) if route_experts else 0))


__all__ = ["ATTN_RES_AGGREGATE", "L2_NORM", "MLA_ATTEND", "MOE_ROUTE_EXPERTS", "SHORT_CONV", "KDA_LAYER", "fuse",
           "fuse_attn_res", "fuse_l2_norm", "fuse_mla_attend", "fuse_moe_route_experts", "fuse_short_conv",
           "fuse_kda_layer"]
