"""Analytic model statistics from a config alone: parameter counts and decode-state sizes.

Nothing is instantiated, so this works for the full 2.8T-parameter release; tests check the counts
against ``sum(p.numel())`` of a real tiny model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3export.dtypes import dtype as as_dtype
from k3export.modeling import contract
from k3export.modeling.configuration_k3 import K3Config


@dataclass
class ParameterCounts:
    total: int = 0
    active: int = 0  # read per token: routed experts count top-k of num_experts
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int, active: int | None = None) -> None:
        self.total += n
        self.active += n if active is None else active
        self.by_kind[kind] = self.by_kind.get(kind, 0) + n


def count_parameters(config: K3Config) -> ParameterCounts:
    """Total and active-per-token parameter counts, grouped by kind (embedding, kda, mla, moe_routed, ...),
    summed over the contract's parameter specs (one routed expert counted once per MoE layer, times E)."""
    c = config
    counts = ParameterCounts()
    for spec in contract.head_param_specs(c):
        counts.add(spec.kind, spec.numel)
    expert = sum(s.numel for s in contract.expert_param_specs(c, 0, 0))
    for i in range(c.num_hidden_layers):
        for spec in contract.layer_param_specs(c, i, experts=False):
            counts.add(spec.kind, spec.numel)
        if c.mlp_types[i] == "moe":
            counts.add("moe_routed", c.num_experts * expert, active=c.num_experts_per_token * expert)
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


def decode_state_bytes(config: K3Config, context: int, batch: int = 1, dtype: str = "bf16",
                       layers: range | None = None) -> StateBytes:
    """Bytes of carried decode state of `layers` (default all) for `batch` sequences, from the contract's specs
    (a state's dtype is the activation `dtype` unless the contract fixes it, e.g. the fp32 KDA state)."""
    act = as_dtype(dtype).name
    per_token = constant = 0
    for spec in contract.state_specs(config, layers):
        size = as_dtype(spec.resolved_dtype(act)).itemsize
        if spec.grows:
            per_token += int(spec.elements(past=1) * size)
        else:
            constant += int(spec.elements() * size)
    return StateBytes(per_token=per_token * batch, constant=constant * batch, context=context, batch=batch)
