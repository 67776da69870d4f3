"""Localisation: name the first layer, and the tensor in it, where a failing run diverges.

Take the earliest step with any failing tensor (the errors of later steps are contaminated by it). At that
step, consider the per-layer tensors: each layer's carried state (conv_state, recurrent_state for KDA; the
latent's key / value halves for MLA) and, when the runtime exposes it, the per-layer residual stream ``hidden_states.{i}``.
The first divergence is the failing one with the lowest layer index; within a layer a state tensor is
named before the hidden state (it is the more specific). Layers are 0-based, as in the tensor names.

Without per-layer hidden outputs (an ONNX export without debug outputs), states alone still localise the
attention sublayer of a KDA/MLA layer; an FFN fault in layer i then first shows in layer i+1's state, and
the line says so.
"""

from __future__ import annotations

from typing import Any

from k3export.artifacts import StateManifest


def _fmt(v: float) -> str:
    return f"{v:.1e}"  # nan / inf print as such


def localise(records: list[Any], manifest: StateManifest) -> str | None:
    """One line, e.g. ``first divergence: layer 3 (kda) recurrent_state, rms_rel 2.1e-01 (decode step 1)``."""
    failing = [r for r in records if not r.metrics.passed]
    if not failing:
        return None
    step = min(r.step for r in failing)
    at_step = [r for r in records if r.step == step]
    bad = [r for r in at_step if r.layer is not None and not r.metrics.passed]
    has_hidden = any(r.kind == "hidden" for r in at_step)
    where = "prefill" if step == 0 else f"decode step {step}"
    scenario = failing[0].scenario
    if not bad:
        logit = next((r for r in at_step if r.tensor == "logits"), failing[0])
        return (f"first divergence: {logit.tensor} only (no per-layer tensor exceeds its tolerance), "
                f"rms_rel {_fmt(logit.metrics.rms_rel)} ({scenario} {where}: {logit.metrics.reason})")
    layer = min(r.layer for r in bad)
    in_layer = [r for r in bad if r.layer == layer]
    order = {s.name: n for n, s in enumerate(manifest.states)}
    in_layer.sort(key=lambda r: (r.kind == "hidden", order.get(r.tensor, 0)))
    first = in_layer[0]
    short = first.tensor.split(".")[-1] if first.kind != "hidden" else "hidden_states"
    extra = ""
    if not has_hidden:
        extra = " [localised by carried state only; the cause may also be the previous layer's FFN]"
    others = [r.tensor.split(".")[-1] if r.kind != "hidden" else "hidden_states" for r in in_layer[1:]]
    also = f", also {', '.join(others)}" if others else ""
    return (f"first divergence: layer {layer} ({manifest.layer_type(layer)}) {short}, rms_rel "
            f"{_fmt(first.metrics.rms_rel)} ({scenario}, {where}{also}){extra}")
