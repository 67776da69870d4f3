"""Localisation: name the first layer, and the tensor in it, where a failing run diverges.

Take the earliest step with any failing tensor (the errors of later steps are contaminated by it). At that
step, consider the per-layer tensors: each layer's carried state (conv_state, recurrent_state for KDA; the
latent's key / value halves for MLA) and, when the runtime exposes it, the per-layer residual stream ``hidden_states.{i}``.
The first divergence is the failing one with the lowest layer index; within a layer a state tensor is
named before the hidden state (it is the more specific). Layers are 0-based, as in the tensor names.

Without per-layer hidden outputs (an ONNX export without debug outputs), states alone still localise the
attention sublayer of a KDA/MLA layer; an FFN fault in layer i then first shows in layer i+1's state, and
the line says so.

A failing ``image`` scenario is localised in the vision tower first (`localise_vision`): the reference and the
runtime run the scenario's images once more with every vision stage's output exposed (PyTorch through forward
hooks on the stage modules, a session runtime or pipeline through the export's ``vision.onnx`` with its stage
values added as outputs in memory, `SessionRunner.vision_stages`), compared in order with the hidden-state
tolerance: patch embedding, each block, the final norm, the merge, the projector. The first failing stage is
named; when every stage agrees the text localisation stands. It runs only on a failure, so a passing validation
pays nothing for it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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


def _stage_label(stage: str) -> str:
    """``vision block 3 (vision_tower.encoder.blocks.3)``, ``patch embedding (vision_tower.patch_embed)``, ..."""
    from k3export.converters.onnx.vision import MERGE_STAGE, PROJECTOR_STAGE

    prefix = "vision_tower.encoder.blocks."
    if stage.startswith(prefix):
        what = f"vision block {stage[len(prefix):]}"
    else:
        what = {"vision_tower.patch_embed": "patch embedding", "vision_tower.encoder.final_layernorm":
                "vision final norm", MERGE_STAGE: "sd2_tpool merge", PROJECTOR_STAGE: "projector"}[stage]
    return f"{what} ({stage})"


def vision_stage_outputs(runner: Any, images: Any) -> dict[str, np.ndarray] | None:
    """Every vision stage's output (`converters.onnx.vision.vision_stages`) of `runner` on `images`, or None when
    the runner exposes none (a runtime that runs the vision graph as a whole, e.g. genai). A runner holding a
    PyTorch `K3ForConditionalGeneration` (``.model``) is read through forward hooks on the stage modules; any
    other runner through its own ``vision_stages(images, expose)``, its vision graph's stages exposed by the
    exporter's `with_stage_outputs` (a runtime never edits a graph itself)."""
    if callable(getattr(runner, "vision_stages", None)):
        from k3export.converters.onnx.vision import with_stage_outputs

        return {k: np.asarray(v) for k, v in runner.vision_stages(images, with_stage_outputs).items()}
    model = getattr(runner, "model", None)
    if model is None or not hasattr(model, "get_image_features") or not hasattr(runner, "image_inputs"):
        return None
    import torch

    from k3export.converters.onnx.vision import vision_stages

    seen: dict[str, np.ndarray] = {}

    def keep(stage: str) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            seen[stage] = output.detach().float().cpu().numpy()
        return hook

    handles = [model.get_submodule(s).register_forward_hook(keep(s)) for s in vision_stages(model.config.vision_config)]
    try:
        with torch.no_grad():
            model.get_image_features(**runner.image_inputs(images))
    finally:
        for h in handles:
            h.remove()
    return seen


def localise_vision(reference: Any, runner: Any, images: Any, tolerances: Any) -> str | None:
    """The first vision stage whose output on `images` differs between `reference` and `runner` beyond the
    hidden-state tolerance, as one line, e.g. ``first divergence: vision block 1 (vision_tower.encoder.blocks.1),
    rms_rel 3.2e-01 (image, vision tower: rms_rel ... > ...)``; None when every stage agrees or `runner` exposes no
    stages. `tolerances` is the run's `Tolerances`."""
    from k3export.converters.onnx.vision import vision_stages

    from .compare import compare

    ours = vision_stage_outputs(runner, images)
    if ours is None:
        return None
    ref = vision_stage_outputs(reference, images)
    if ref is None:
        return None
    tol = tolerances.for_kind("hidden")
    config = getattr(getattr(reference, "model", None), "config", None)
    order = vision_stages(config.vision_config) if config is not None else list(ref)
    for stage in order:
        if stage not in ours or stage not in ref:
            side = "runtime" if stage not in ours else "reference"
            return f"vision stage {_stage_label(stage)} missing from the {side}'s outputs"
        m = compare(ours[stage], ref[stage], "hidden", tol)
        if not m.passed:
            return (f"first divergence: {_stage_label(stage)}, rms_rel {_fmt(m.rms_rel)} "
                    f"(image, vision tower: {m.reason})")
    return None
