"""`k3export export`: a K3 / Kimi-Linear model to an ONNX folder (model.onnx + data + state manifest).

A checkpoint with a vision tower (``vision_config``), and the ``k3`` preset (the released model), export image +
text: vision.onnx, embedding.onnx and a decoder on ``inputs_embeds`` (`k3export.converters.onnx.export_onnx`), with
the processor files and genai's vision and embedding sections in genai_config.json. ``--text-only`` exports the text
decoder alone (on ``input_ids``, the vision tensors not read). ``--stages`` of such a model puts the image graphs
with stage 0 (`k3export.pipeline.export_pipeline`)."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import bytes_bar, console, user_errors


def export(
    model_or_out: str = typer.Argument(..., metavar="MODEL_DIR", help="Checkpoint folder or Hub id (or OUT_DIR "
                                                                       "with --config)."),
    out_dir: Path | None = typer.Argument(None, metavar="OUT_DIR", help="Folder to create."),
    dtype: str = typer.Option("fp32", "--dtype", help="Export dtype: fp32, bf16 or fp16."),
    opset: int | None = typer.Option(None, "--opset", help="ONNX opset, 23 to 28 (an older one for an older "
                                                         "runtime: onnxruntime-webgpu 1.27 loads up to 26); refused "
                                                         "when the graph needs a newer one. Default: the form's (27; "
                                                         "the ort form 24)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT_DIR if it is an ONNX export k3export wrote."),
    config: str | None = typer.Option(None, "--config", help="Export a preset config instead of a model: "
                                                             "k3, tiny, tiny-kimi-linear."),
    weights: bool = typer.Option(True, "--weights/--no-weights", help="Write the weights (--no-weights: graph "
                                                                      "only, weights declared, not written)."),
    debug_outputs: bool = typer.Option(False, "--debug-outputs", help="Also output hidden_states.{i} after "
                                                                       "every layer (for localising mismatches)."),
    experts: str | None = typer.Option(None, "--experts", help="Routed experts as mxfp4 or nvfp4 (the checkpoint's "
                                                               "packed bytes; default when the source keeps them) "
                                                               "or dense."),
    projections: str | None = typer.Option(None, "--projections", help="Weights the checkpoint stores in block "
                                           "FP8 (NVIDIA's NVFP4 release: the attention projections) as fp8 (kept: "
                                           "1 byte a weight + fp32 scales, dequantised in the graph; default for "
                                           "such a source without --quantize) or dense (decoded into --dtype)."),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="Export weights holding NaN / Inf (and "
                                                                          "NaN MXFP4 scales) instead of refusing."),
    form: str | None = typer.Option(None, "--form", help="Graph form: functions (default: k3 functions kept; ONNX "
                                    "Runtime runs it fastest, TensorRT with the k3 plugins), standard (opset-27 "
                                    "standard ops: KDA as LinearAttention and CausalConvWithState, MLA as "
                                    "Attention; any opset-27 consumer, ONNX Runtime with no k3 library, the ONNX "
                                    "reference evaluator), inlined (inlined into standard ops of earlier opsets, no "
                                    "If, no sequences: OpenVINO) or ort (ONNX Runtime's GatedDeltaNet for KDA, MLA "
                                    "as Attention: a plain onnxruntime session)."),
    genai: bool | None = typer.Option(None, "--genai/--no-genai", help="Write genai_config.json for "
                                      "onnxruntime-genai (default: with dense experts; MXFP4 and NVFP4 experts need "
                                      "an 8-bit copy for it, 9 bits per expert weight more on disk)."),
    stages: int | None = typer.Option(None, "--stages", min=1, max=1 << 16,
                                      help="Write N pipeline stages (layer ranges balanced by bytes) + pipeline.json."),
    stage_plan: Path | None = typer.Option(None, "--stage-plan", help="Write the stages of this plan "
                                                                      "(`k3export deploy-plan --write-plan`)."),
    text_only: bool = typer.Option(False, "--text-only", help="Export the text decoder only (input_ids in), "
                                   "without the vision and embedding graphs, of a model with a vision tower."),
    state_window: int = typer.Option(0, "--state-window", min=0, max=64, help="Also return the carried state after "
                                     "each of a call's last W positions, so speculative decoding takes back up to W "
                                     "rejected draft tokens without a second call (docs/state.md)."),
    quantize: str | None = typer.Option(None, "--quantize", help="Store the dense projections (attention, shared "
                                        "experts, dense MLPs, head) weight-only block-quantized: int8 or int4 "
                                        "(ONNX Runtime's MatMulNBits; --dtype fp32). The experts stay as --experts "
                                        "says."),
    block_size: int = typer.Option(32, "--block-size", help="Weights per quantization scale with --quantize (a "
                                   "power of two >= 16)."),
    quantize_activations: bool = typer.Option(True, "--quantize-activations/--no-quantize-activations",
                                              help="With --quantize: the projections round their input to int8 per "
                                                   "block (ONNX Runtime's fast path, as llama.cpp's Q8_0 / Q4_0 do); "
                                                   "--no-quantize-activations keeps fp32 inputs (exact, slower)."),
    kernels: bool | None = typer.Option(None, "--kernels/--no-kernels", help="Write the k3 library's fused ops "
                                        "(each a k3 function with its standard-op body), which ONNX Runtime with the "
                                        "k3 ops library and OpenVINO with the k3 extension run as one kernel each. "
                                        "Default: on for the forms that keep k3 functions (functions, ort)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar over the weights."),
) -> None:
    """Export MODEL_DIR to OUT_DIR, or the graph of a preset: `k3export export --config k3 --no-weights OUT_DIR`."""
    from k3export.errors import ExportError

    with user_errors():
        from k3export.safety import EXPORT, PIPELINE, check_output

        # refuse a bad OUT_DIR (not ours, overlapping the model) before the heavy imports
        if config is None and out_dir is not None:
            check_output(out_dir, EXPORT if stages is None and stage_plan is None else PIPELINE, overwrite=overwrite,
                         sources=[model_or_out])
        from k3export.checkpoint_io import PRESETS, preset_model_config
        from k3export.converters.onnx import export_onnx

        if config is not None:
            if out_dir is not None:
                raise ExportError("with --config pass only OUT_DIR (no MODEL_DIR)")
            source = preset_model_config(config, vision=not text_only)
            if source is None:
                raise ExportError(f"unknown --config {config!r}; choose one of {', '.join(PRESETS)}")
            if weights:
                raise ExportError("a preset config has no weights: add --no-weights")
            target = Path(model_or_out)
        else:
            if out_dir is None:
                raise ExportError("missing OUT_DIR (usage: k3export export MODEL_DIR OUT_DIR)")
            source, target = model_or_out, out_dir
        if stages is not None or stage_plan is not None:
            from .pipeline import export_stages

            if genai:
                raise ExportError("--genai: onnxruntime-genai runs whole decoders, not pipeline stages")
            if form not in (None, "functions"):
                raise ExportError(f"--form {form}: pipeline stages are written in the functions form only")
            if quantize is not None:
                raise ExportError("--quantize: pipeline stages are written with dense projections only")

            return export_stages(source, target, stages=stages, stage_plan=stage_plan, dtype=dtype, opset=opset,
                                 weights=weights, overwrite=overwrite, debug_outputs=debug_outputs, experts=experts,
                                 allow_nonfinite=allow_nonfinite, progress=progress, state_window=state_window,
                                 vision=False if text_only else None)  # image graphs go with stage 0
        with bytes_bar(progress and weights, "writing weights") as bar:
            result = export_onnx(source, target, dtype=dtype, opset=opset, weights=weights, overwrite=overwrite,
                                 debug_outputs=debug_outputs, experts=experts, allow_nonfinite=allow_nonfinite,
                                 genai=genai, form=form, vision=False if text_only else None, progress=bar,
                                 state_window=state_window, quantize=quantize, block_size=block_size,
                                 accuracy_level=4 if quantize_activations else 0, projections=projections,
                                 kernels=kernels)
        state = "weights written" if result.weights_materialized else "weights declared only (not written)"
        console.print(
            f"exported {result.model_path} ({result.dtype}, opset {result.opset}, graph form "
            f"{result.runtime_config['graph_form']}): {result.num_nodes} nodes, "
            f"{result.num_initializers} initializers, {result.weight_bytes / 2**30:.2f} GiB of weights, {state}, "
            f"{len(result.manifest['states'])} state tensors, {result.seconds:.1f} s",
            highlight=False,
        )
        from k3export.genai import GENAI_CONFIG_FILE

        graphs = result.runtime_config.get("graphs", [])
        if graphs:
            console.print(f"image graphs: {', '.join(g['model_file'] for g in graphs)} (model.onnx takes "
                          "inputs_embeds)", highlight=False)
        if state_window:
            console.print(f"state window {state_window}: present_window.* outputs; no {GENAI_CONFIG_FILE} "
                          "(onnxruntime-genai's config cannot name them)", highlight=False)
        elif genai is None and result.weights_materialized and not (result.out_dir / GENAI_CONFIG_FILE).exists():
            console.print(f"no {GENAI_CONFIG_FILE}: onnxruntime-genai cannot run MXFP4 or NVFP4 experts as stored; "
                          "add --genai for the 8-bit graph it runs", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("export")(export)
