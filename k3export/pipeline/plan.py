# Copyright 2026 the k3export authors. Apache-2.0.
"""Stage planning: which contiguous layer range each pipeline stage (one device) holds, and what it costs.

Every number comes from the contract (`k3export.modeling.contract`): a layer's weight bytes are its parameter
specs times their dtype (fp32 for the parameters the contract keeps in fp32; routed experts at 4.25 bits per
weight when they stay MXFP4: 4-bit E2M1 values plus one E8M0 scale per 32), and its state bytes are the
contract's state specs (`info.decode_state_bytes`): a constant part (KDA conv + recurrent state) and a part that
grows per token (MLA latents). Stage 0 also holds the embedding (and, for an image + text model, the vision tower
and projector: `info.count_vision_parameters` in the activation dtype), the last stage the final norm, the
Attention-Residual output weights and ``lm_head``.

`plan_stages` cuts the layers into N stages that minimise the largest stage's bytes at a reference context
(weights + state), then, among the cuts that reach that bottleneck, the spread of the others (least sum of
squares). `plan_for_devices` does the same for a device size: with ``context`` it minimises the largest stage,
without it it maximises the longest context every stage can hold. `deploy_plan` reports a plan against a device
and refuses one that does not fit, saying by how much.

A stage plan file (``--stage-plan plan.json``) lists half-open layer ranges in order
(`k3export.artifacts.StagePlanFile`); `read_stage_plan` checks them against the model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from k3export.artifacts import ArtifactError, StagePlanFile
from k3export.dtypes import DTypeError, dtype as as_dtype
from k3export.errors import ExportError

MXFP4_BITS = 4.25  # E2M1 value (4 bits) + one E8M0 scale byte per 32 values
DEFAULT_CONTEXT = 8192  # reference context when balancing without a deployment target


class PipelineError(ExportError):
    """A stage plan, pipeline export or pipeline run that cannot be used as asked (one line)."""


# ---------------------------------------------------------------------------------------------- costs
@dataclass(frozen=True)
class Costs:
    """Bytes of a model by layer, in one dtype: what `Stage` and the planners add up."""

    dtype: str  # canonical activation dtype name
    mxfp4_experts: bool
    first: int  # weights only stage 0 holds (embedding; the vision tower and projector of an image model)
    last: int  # weights only the last stage holds (final norm, AttnRes output, lm_head)
    weights: tuple[int, ...]  # per layer
    state_constant: tuple[int, ...]  # per layer, per sequence
    state_per_token: tuple[int, ...]  # per layer, per sequence and token
    vision: int = 0  # of `first`: the vision tower and projector of an image + text model
    nvfp4_experts: bool = False  # routed experts in NVFP4 (4.5 bits + two fp32 scalars a matrix)

    @property
    def num_layers(self) -> int:
        return len(self.weights)

    def stage(self, index: int, start: int, stop: int) -> Stage:
        w = sum(self.weights[start:stop]) + (self.first if start == 0 else 0) + (
            self.last if stop == self.num_layers else 0)
        return Stage(index, range(start, stop), w, sum(self.state_constant[start:stop]),
                     sum(self.state_per_token[start:stop]))


def _param_bytes(spec: Any, act_bytes: float) -> int:
    return int(spec.numel * (4 if spec.fp32 else act_bytes))


def layer_costs(config: Any, dtype: str = "bf16", mxfp4_experts: bool = False,
                vision_config: Any = None, nvfp4_experts: bool = False) -> Costs:
    """Weight and state bytes of every layer of `config` in activation `dtype` (see the module docstring);
    `vision_config` (a `K3VisionConfig`): stage 0 also holds that tower and its projector. `nvfp4_experts`: the
    routed experts in NVFP4 (`k3export.info.NVFP4_BITS`, plus ``weight_scale_2`` and ``input_scale`` a matrix)."""
    from k3export.info import NVFP4_BITS, count_vision_parameters, decode_state_bytes
    from k3export.modeling import contract

    try:
        act = as_dtype(dtype)
    except DTypeError as exc:
        raise PipelineError(str(exc)) from None
    c = config
    first = last = 0
    for spec in contract.head_param_specs(c):
        if spec.kind == "embedding":
            first += _param_bytes(spec, act.itemsize)
        else:
            last += _param_bytes(spec, act.itemsize)
    vision = 0
    if vision_config is not None:  # vision.onnx goes with stage 0; embedding.onnx holds the embedding counted above
        vision = int(sum(count_vision_parameters(vision_config).values()) * act.itemsize)
    first += vision
    if c.tie_word_embeddings:  # the last stage needs its own copy of the tied matrix as lm_head
        last += int(c.vocab_size * c.hidden_size * act.itemsize)
    expert_numel = sum(s.numel for s in contract.expert_param_specs(c, 0, 0)) if c.num_experts else 0
    expert_bytes = expert_numel * (MXFP4_BITS / 8 if mxfp4_experts else act.itemsize)
    if nvfp4_experts:
        expert_bytes = expert_numel * NVFP4_BITS / 8 + 8 * len(contract.expert_param_specs(c, 0, 0))
    weights, constant, per_token = [], [], []
    unread = contract.unread_param_names(c)  # left out of the export, so of no stage
    for i in range(c.num_hidden_layers):
        w = sum(_param_bytes(s, act.itemsize) for s in contract.layer_param_specs(c, i, experts=False)
                if s.name not in unread)
        if c.mlp_types[i] == "moe":
            w += int(c.num_experts * expert_bytes)
        weights.append(w)
        state = decode_state_bytes(c, 1, 1, act.name, layers=range(i, i + 1))
        constant.append(state.constant)
        per_token.append(state.per_token)
    return Costs(act.name, mxfp4_experts, first, last, tuple(weights), tuple(constant), tuple(per_token), vision,
                 nvfp4_experts)


# ---------------------------------------------------------------------------------------------- stages
@dataclass(frozen=True)
class Stage:
    """One stage: its layers and bytes (state per sequence: `state_constant` + `state_per_token` x context)."""

    index: int
    layers: range
    weight_bytes: int
    state_constant: int
    state_per_token: int

    def state_bytes(self, context: int, batch: int = 1) -> int:
        return batch * (self.state_constant + self.state_per_token * context)

    def total_bytes(self, context: int, batch: int = 1) -> int:
        return self.weight_bytes + self.state_bytes(context, batch)

    def max_context(self, budget: int, batch: int = 1) -> int | None:
        """Longest context whose total fits in `budget` bytes; -1 if not even context 0 does; None: unbounded."""
        room = budget - self.weight_bytes - batch * self.state_constant
        if room < 0:
            return -1
        if self.state_per_token == 0:
            return None
        return room // (batch * self.state_per_token)

    @property
    def span(self) -> str:
        return f"{self.layers.start}-{self.layers.stop - 1}" if len(self.layers) > 1 else str(self.layers.start)


@dataclass
class StagePlan:
    """Contiguous layer ranges covering a model, one per stage, with their costs."""

    stages: list[Stage]
    costs: Costs = field(repr=False)

    @property
    def ranges(self) -> list[range]:
        return [s.layers for s in self.stages]

    def __len__(self) -> int:
        return len(self.stages)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan file (`StagePlanFile`) atomically (a reader never sees half a plan; a link at `path` is
        replaced, an existing file only when it is a stage plan: `check_report_path`)."""
        from k3export.safety import check_report_path

        path = check_report_path(path, StagePlanFile.FORMAT)
        return StagePlanFile.of(self.ranges).write(path.parent, path.name)


def check_ranges(ranges: list[range], num_layers: int, where: str = "stage plan") -> list[range]:
    """`ranges` if they cover layers 0..num_layers-1 once each, in order; else `PipelineError` (one line)."""
    if not ranges:
        raise PipelineError(f"{where}: no stages")
    if len(ranges) > num_layers:
        raise PipelineError(f"{where}: {len(ranges)} stages for a {num_layers}-layer model; at most {num_layers} "
                            "(one layer each)")
    expect = 0
    for n, r in enumerate(ranges):
        if r.stop <= r.start:
            raise PipelineError(f"{where}: stage {n} [{r.start}, {r.stop}) holds no layer")
        if r.start > expect:
            missing = f"layer {expect}" if r.start == expect + 1 else f"layers {expect}-{r.start - 1}"
            raise PipelineError(f"{where}: {missing} {'is' if r.start == expect + 1 else 'are'} in no stage "
                                f"(stage {n} starts at {r.start})")
        if r.start < expect:
            raise PipelineError(f"{where}: layer {r.start} is in stage {n - 1} and again in stage {n}")
        if r.stop > num_layers:
            raise PipelineError(f"{where}: stage {n} [{r.start}, {r.stop}) goes past the model's {num_layers} "
                                f"layers")
        expect = r.stop
    if expect < num_layers:
        missing = f"layer {expect}" if expect == num_layers - 1 else f"layers {expect}-{num_layers - 1}"
        raise PipelineError(f"{where}: {missing} {'is' if expect == num_layers - 1 else 'are'} in no stage (the "
                            f"last stage ends at {expect})")
    return ranges


def read_stage_plan(path: str | os.PathLike[str], num_layers: int) -> list[range]:
    """The layer ranges of stage plan file `path` (`StagePlanFile`), checked against `num_layers`."""
    try:
        ranges = StagePlanFile.read_file(path).ranges
    except ArtifactError as exc:
        raise PipelineError(str(exc)) from None
    return check_ranges(ranges, num_layers, str(path))


def stages_from_ranges(costs: Costs, ranges: list[range], where: str = "stage plan") -> StagePlan:
    check_ranges(ranges, costs.num_layers, where)
    return StagePlan([costs.stage(i, r.start, r.stop) for i, r in enumerate(ranges)], costs)


def _check_count(n: int, num_layers: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PipelineError(f"--stages must be a positive number of stages, got {n!r}")
    if n > num_layers:
        raise PipelineError(f"--stages {n}: the model has {num_layers} layers, so at most {num_layers} stages "
                            "(one layer each)")


def _partition(costs: Costs, n: int, cost: Callable[[Stage], float]) -> list[range]:
    """Contiguous cut of the layers into `n` stages minimising the largest `cost`, then the sum of squared bytes
    (weights + state at the reference context) among the cuts that reach it. Two O(n L^2) dynamic programmes."""
    L = costs.num_layers
    stage = [[costs.stage(0, i, j) if j > i else None for j in range(L + 1)] for i in range(L + 1)]
    g = [[cost(stage[i][j]) if j > i else math.inf for j in range(L + 1)] for i in range(L + 1)]
    inf = math.inf
    # pass 1: the bottleneck
    best = [[inf] * (L + 1) for _ in range(n + 1)]
    best[0][0] = -inf
    for k in range(1, n + 1):
        for j in range(k, L - (n - k) + 1):
            best[k][j] = min((max(best[k - 1][i], g[i][j]) for i in range(k - 1, j)), default=inf)
    bottleneck = best[n][L]
    # pass 2: the least sum of squares among cuts whose stages all stay within the bottleneck
    sq = [[float(stage[i][j].total_bytes(0)) ** 2 if j > i else inf for j in range(L + 1)] for i in range(L + 1)]
    total = [[inf] * (L + 1) for _ in range(n + 1)]
    back = [[0] * (L + 1) for _ in range(n + 1)]
    total[0][0] = 0.0
    for k in range(1, n + 1):
        for j in range(k, L - (n - k) + 1):
            for i in range(k - 1, j):
                if g[i][j] <= bottleneck and total[k - 1][i] + sq[i][j] < total[k][j]:
                    total[k][j], back[k][j] = total[k - 1][i] + sq[i][j], i
    cuts, j = [L], L
    for k in range(n, 0, -1):
        j = back[k][j]
        cuts.append(j)
    cuts.reverse()
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def plan_stages(config: Any, n: int, *, dtype: str = "bf16", mxfp4_experts: bool = False,
                context: int = DEFAULT_CONTEXT, batch: int = 1, costs: Costs | None = None) -> StagePlan:
    """`n` stages balanced by bytes: weights plus the state of `batch` sequences of `context` tokens."""
    costs = costs or layer_costs(config, dtype, mxfp4_experts)
    _check_count(n, costs.num_layers)
    ranges = _partition(costs, n, lambda s: s.total_bytes(context, batch))
    return stages_from_ranges(costs, ranges)


def plan_for_devices(config: Any, n: int, device_bytes: int, *, context: int | None = None, batch: int = 1,
                     dtype: str = "bf16", mxfp4_experts: bool = False, reserve: int = 0,
                     costs: Costs | None = None) -> StagePlan:
    """`n` stages for devices of `device_bytes`: with `context`, the least largest stage at that context;
    without, the longest context every stage holds (ties: balanced weights)."""
    costs = costs or layer_costs(config, dtype, mxfp4_experts)
    _check_count(n, costs.num_layers)
    if context is not None:
        return plan_stages(config, n, context=context, batch=batch, costs=costs)
    budget = device_bytes - reserve

    def shortfall(s: Stage) -> float:  # smaller is better: minus the longest context, or bytes over budget
        ctx = s.max_context(budget, batch)
        if ctx is None:
            return -math.inf
        return float(-ctx) if ctx >= 0 else float(s.total_bytes(0, batch) - budget) * 1e30
    return stages_from_ranges(costs, _partition(costs, n, shortfall))


# ---------------------------------------------------------------------------------------------- deployment
@dataclass
class DeployPlan:
    plan: StagePlan
    device_bytes: int
    reserve: int
    batch: int
    context: int | None  # asked for; None: report the longest that fits

    @property
    def budget(self) -> int:
        return self.device_bytes - self.reserve

    def stage_context(self, s: Stage) -> int | None:
        return s.max_context(self.budget, self.batch)

    @property
    def max_context(self) -> int | None:
        """Longest context (per sequence, for `batch` sequences) every stage holds; None: unbounded; -1: none."""
        values = [self.stage_context(s) for s in self.plan.stages]
        bounded = [v for v in values if v is not None]
        return min(bounded) if bounded else None

    def need(self, s: Stage) -> int:
        return s.total_bytes(self.context or 0, self.batch) + self.reserve

    def problems(self) -> list[tuple[Stage, int]]:
        """(stage, bytes over the device) for every stage that does not fit."""
        return [(s, self.need(s) - self.device_bytes) for s in self.plan.stages if self.need(s) > self.device_bytes]

    def to_json(self) -> dict[str, Any]:
        ctx = self.context or 0
        return {
            "devices": len(self.plan), "device_bytes": self.device_bytes, "reserve_bytes": self.reserve,
            "batch": self.batch, "context": self.context, "dtype": self.plan.costs.dtype,
            "mxfp4_experts": self.plan.costs.mxfp4_experts, "nvfp4_experts": self.plan.costs.nvfp4_experts,
            "max_context": self.max_context,
            "vision_bytes": self.plan.costs.vision,
            "stages": [{"stage": s.index, "layers": [s.layers.start, s.layers.stop], "weight_bytes": s.weight_bytes,
                        "state_bytes_per_token": s.state_per_token * self.batch,
                        "state_bytes_constant": s.state_constant * self.batch,
                        "total_bytes": s.total_bytes(ctx, self.batch) + self.reserve,
                        "max_context": self.stage_context(s)} for s in self.plan.stages],
        }


def min_devices(costs: Costs, device_bytes: int, reserve: int, context: int, batch: int) -> int | None:
    """The fewest stages that hold `context` on such devices (None: a single layer is already too large).
    Greedy packing from layer 0 is exact: a stage's bytes only grow as it takes more layers."""
    budget = device_bytes - reserve
    L = costs.num_layers
    if any(costs.stage(0, i, i + 1).total_bytes(context, batch) > budget for i in range(L)):
        return None
    count, start = 1, 0
    for j in range(1, L + 1):
        if costs.stage(0, start, j).total_bytes(context, batch) > budget:
            count, start = count + 1, j - 1
    return count


def deploy_plan(config: Any, devices: int, device_bytes: int, *, context: int | None = None, batch: int = 1,
                dtype: str = "bf16", mxfp4_experts: bool = False, reserve: int = 0,
                ranges: list[range] | None = None, vision_config: Any = None,
                nvfp4_experts: bool = False) -> DeployPlan:
    """The plan of `config` on `devices` devices of `device_bytes` each (``ranges``: a given cut), checked:
    `PipelineError` says which stage does not fit and by how much, and how many devices would do. `vision_config`:
    stage 0 also holds that vision tower and its projector; `nvfp4_experts`: experts in NVFP4 (`layer_costs`)."""
    from k3export.units import format_bytes

    if batch < 1:
        raise PipelineError(f"--batch must be >= 1, got {batch}")
    if context is not None and context < 0:
        raise PipelineError(f"--context must be >= 0, got {context}")
    if reserve >= device_bytes:
        raise PipelineError(f"the reserve ({format_bytes(reserve)}) leaves nothing of a {format_bytes(device_bytes)}"
                            " device")
    costs = layer_costs(config, dtype, mxfp4_experts, vision_config=vision_config, nvfp4_experts=nvfp4_experts)
    if ranges is not None:
        if len(ranges) != devices:
            raise PipelineError(f"the stage plan has {len(ranges)} stages for {devices} devices")
        plan = stages_from_ranges(costs, ranges)
    else:
        plan = plan_for_devices(config, devices, device_bytes, context=context, batch=batch, reserve=reserve,
                                costs=costs)
    dp = DeployPlan(plan, device_bytes, reserve, batch, context)
    over = dp.problems()
    if over:
        s, by = max(over, key=lambda x: x[1])
        fewest = min_devices(costs, device_bytes, reserve, context or 0, batch)
        hint = (f"; {fewest} such devices would hold it" if fewest and fewest > devices else
                "; no number of such devices holds it (a single layer is larger)" if fewest is None else "")
        raise PipelineError(
            f"does not fit: stage {s.index} (layers {s.span}) needs {format_bytes(dp.need(s))} at context "
            f"{context or 0} x batch {batch} on a {format_bytes(device_bytes)} device: {format_bytes(by)} over"
            f"{f' ({len(over)} of {devices} stages over)' if len(over) > 1 else ''}{hint}")
    return dp


__all__ = ["Costs", "DEFAULT_CONTEXT", "DeployPlan", "MXFP4_BITS", "PipelineError", "Stage", "StagePlan",
           "check_ranges", "deploy_plan", "layer_costs", "min_devices", "plan_for_devices", "plan_stages",
           "read_stage_plan", "stages_from_ranges"]
