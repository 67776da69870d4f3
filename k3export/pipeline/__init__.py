# Copyright 2026 the k3export authors. Apache-2.0.
"""Past one device: pipeline stages (contiguous layer ranges, one standard graph per device), their plan, their
export, and two ways to run them.

    plan = plan_stages(config, 16, dtype="bf16", mxfp4_experts=True)        # balanced by bytes and state
    dp = deploy_plan(config, 16, 141 * 10**9, context=131072)               # refuses a plan that does not fit
    export_pipeline(model_dir, "out/", stages=4)                            # out/pipeline.json + out/stage-NN/
    runner = PipelineRunner("out/")                                         # stages chained in this process
    runner = RayPipelineRunner("out/", address="auto")                      # one Ray actor per stage

`plan` (stage planning and the deployment plan), `export` (pipeline.json, stage folders, `load_pipeline`),
`runner` (`run_stage`, the one stage execution path, and `PipelineRunner`), `ray_runner` (`RayPipelineRunner`:
actors in a placement group, state kept on its actor, micro-batched pipelining; needs ``k3export[ray]``),
`ray_cluster` (a cluster address checked in bounded time). `PIPELINE_RUNNERS` holds the factories of the runtimes
``pipeline`` and ``ray`` (their target's ``pipeline_dir``, else ``onnx_dir``, is a pipeline export), for a registry
that offers them beside `k3export.runtime.RUNNERS` (``validate``'s); importing this package registers nothing.
"""

from __future__ import annotations

from typing import Any

from .plan import (
    Costs, DeployPlan, PipelineError, Stage, StagePlan, check_ranges, deploy_plan, layer_costs, plan_for_devices,
    plan_stages, read_stage_plan,
)


def _pipeline(target: Any) -> Any:
    from .runner import pipeline_factory

    return pipeline_factory(target)


def _ray(target: Any) -> Any:
    from .ray_runner import ray_factory

    return ray_factory(target)


#: runtime name -> factory of a `k3export.runtime.Target` (onnxruntime and ray load only when one is called)
PIPELINE_RUNNERS: dict[str, Any] = {"pipeline": _pipeline, "ray": _ray}

_LAZY = {"export_pipeline": "export", "load_pipeline": "export", "is_pipeline": "export", "Pipeline": "export",
         "PipelineRunner": "runner", "RayPipelineRunner": "ray_runner"}


def __getattr__(name: str) -> Any:  # onnx, onnxruntime and ray load only when used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Costs", "DeployPlan", "PIPELINE_RUNNERS", "Pipeline", "PipelineError", "PipelineRunner", "RayPipelineRunner",
           "Stage",
           "StagePlan", "check_ranges", "deploy_plan", "export_pipeline", "is_pipeline", "layer_costs",
           "load_pipeline", "plan_for_devices", "plan_stages", "read_stage_plan"]
