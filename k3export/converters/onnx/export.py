# Copyright 2026 the k3export authors. Apache-2.0.
"""`export_onnx`: K3 model / checkpoint folder / config -> an export folder (see the package docstring)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import onnx
import torch
from onnx import helper

from k3export.artifacts import (GENAI_DATA_PREFIX, GENAI_MODEL_FILE, MODEL_FILE, ORT_SESSION_OPTIONS, ExportFolder,
                                ResumeRecord, RuntimeConfig, StateManifest, write_bytes_atomic)
from k3export.artifacts.expert_views import Q8_OVERLOAD
from k3export.artifacts.graph_forms import expert_block
from k3export.errors import ConfigError, ExportError, K3ExportError
from k3export.files import CONFIG_NAME, file_identity, read_config_json
from k3export.modeling.configuration_k3 import K3Config, K3ConfigError

from .builder import WeightSpec
from .forms import READERS, GraphForm, apply_form, graph_form, readable
from .fp8 import choose_projections, keep_fp8
from .functions import DOMAIN, DOMAIN_VERSION, all_functions
from .fused_bodies import add_fused_functions
from .graph import K3GraphBuilder
from .mxfp4 import ort_form_bytes, ort_form_shards, resolve_experts, use_mxfp4_function, write_ort_form
from .opsets import DEFAULT_OPSET, IR_VERSION, SUPPORTED_OPSETS, check_graph_opset, check_opset, export_dtype
from .quantize import (ACCURACY_LEVELS, DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, MS_DOMAIN, check_quantize,
                       quantize_projections)
from .shards import DEFAULT_MAX_SHARD_BYTES, RESUME_DIR, recorded_digests, resume_record, write_resume_record
from .weights import (
    CheckpointSource, ModuleSource, WeightSource, initializer, plan_layout, write_weights,
)

@dataclass
class ExportResult:
    out_dir: Path
    model_path: Path
    dtype: str  # canonical activation dtype name
    opset: int
    weights_materialized: bool
    num_nodes: int
    num_initializers: int
    weight_bytes: int
    data_files: list[str]
    seconds: float
    manifest: dict[str, Any] = field(repr=False, default_factory=dict)  # the JSON written to state_manifest.json
    runtime_config: dict[str, Any] = field(repr=False, default_factory=dict)  # ... and to runtime_config.json
    #: sha256 of each data shard, computed while it was written (a resumable export's; else empty)
    data_sha256: dict[str, str] = field(repr=False, default_factory=dict)


# ---------------------------------------------------------------------------------------------- input checks
def resolve_model(model_or_dir: Any, weights: bool, allow_nonfinite: bool = False
                  ) -> tuple[K3Config, WeightSource | None, Path | None, dict[str, Any] | None]:
    """(config, weight source or None, the checkpoint folder read and its parsed config.json, both None for an
    in-memory model or config). config.json is read once: the weight source and `resolve_experts` take the dict."""
    from k3export.modeling.configuration_k3 import K3VLConfig
    from k3export.modeling.modeling_k3 import K3ForCausalLM
    from k3export.modeling.modeling_k3_vision import K3ForConditionalGeneration

    if isinstance(model_or_dir, K3ForConditionalGeneration):  # its text model; `resolve_vision` the rest
        model_or_dir = model_or_dir.language_model
    if isinstance(model_or_dir, K3VLConfig):
        model_or_dir = model_or_dir.text_config
    if isinstance(model_or_dir, K3ForCausalLM):
        return model_or_dir.config, (ModuleSource(model_or_dir, allow_nonfinite) if weights else None), None, None
    if isinstance(model_or_dir, K3Config):
        if weights:
            raise ExportError("a bare K3Config has no weights: pass weights=False (--no-weights) or a model")
        return model_or_dir, None, None, None
    if isinstance(model_or_dir, torch.nn.Module):
        raise ExportError(f"{type(model_or_dir).__name__} is not a K3ForCausalLM")
    if not isinstance(model_or_dir, (str, os.PathLike)):
        raise ExportError(f"cannot export {type(model_or_dir).__name__}: pass a K3ForCausalLM, a K3Config or a folder")
    folder = Path(model_or_dir).expanduser()
    if not folder.is_dir():
        if folder.exists():
            raise ExportError(f"{folder} is not a folder")
        from k3export.artifacts import snapshot  # a Hub id resolves to a local snapshot

        folder = Path(snapshot(str(model_or_dir)))
    data = read_config_json(folder, ExportError)
    try:
        config = K3Config.from_released_dict(data)
    except (K3ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{folder / CONFIG_NAME}: {exc}") from None
    # every layout streams through its shard headers, one tensor at a time: no model is built
    return config, (CheckpointSource(folder, allow_nonfinite, config_json=data) if weights else None), folder, data


def resolve_vision(model_or_dir: Any, config_json: dict[str, Any] | None) -> Any:
    """The `K3VLConfig` of an image + text source (a `K3ForConditionalGeneration`, a `K3VLConfig`, or a checkpoint
    folder whose config.json has a ``vision_config``); None for a text-only one."""
    from k3export.modeling.configuration_k3 import K3VLConfig
    from k3export.modeling.modeling_k3_vision import K3ForConditionalGeneration

    if isinstance(model_or_dir, K3ForConditionalGeneration):
        return model_or_dir.config
    if isinstance(model_or_dir, K3VLConfig):
        return model_or_dir
    if config_json is None or not isinstance(config_json.get("vision_config"), dict):
        return None
    try:
        return K3VLConfig.from_released_dict(config_json)
    except (K3ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{CONFIG_NAME}: {exc}") from None


def _write_processor(folder: Path, vl: Any, source_folder: Path | None) -> None:
    """The export's image processor (``preprocessor_config.json`` + ``processor_config.json``, `K3Processor`): the
    source checkpoint's settings when it has them, else the tower's patch and merge sizes with the default budget."""
    from k3export.modeling.image_processing_k3 import K3ImageProcessor, K3Processor

    if source_folder is not None and (source_folder / "preprocessor_config.json").is_file():
        image_processor = K3ImageProcessor.from_pretrained(str(source_folder))
    else:
        v = vl.vision_config
        image_processor = K3ImageProcessor(patch_size=v.patch_size, merge_kernel_size=list(v.merge_kernel_size),
                                           max_frames_per_chunk=v.init_pos_emb_time)
    K3Processor(image_processor, media_placeholder_token_id=vl.media_placeholder_token_id).save_pretrained(folder)


# ---------------------------------------------------------------------------------------------- export
def build_model_proto(config: K3Config, dtype: Any, opset: int, debug_outputs: bool = False,
                      attention_mask: bool = True, layers: range | None = None,
                      experts: str = "dense", form: str | GraphForm | None = None,
                      inputs_embeds: bool = False, state_window: int = 0, quantize: str | None = None,
                      block_size: int = DEFAULT_BLOCK_SIZE,
                      accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                      fp8: frozenset[str] = frozenset(), kernels: bool | None = None
                      ) -> tuple[onnx.ModelProto, K3GraphBuilder]:
    """The graph with weights declared only (initializers added by the caller); `layers`: a pipeline stage;
    `experts`: ``"mxfp4"`` declares the routed experts as MXFP4 (`mxfp4`); `form`: the graph form (`forms`);
    `inputs_embeds`: the decoder takes ``inputs_embeds`` instead of ``input_ids`` (an image + text export);
    `state_window`: W > 0 adds the ``present_window.*`` outputs (`K3GraphBuilder.kda_window`); `quantize`
    (``int8`` / ``int4``): the dense projections as ``MatMulNBits`` over `block_size`-weight blocks at
    `accuracy_level` (`quantize`); `fp8`: the weights kept block FP8 (`fp8.keep_fp8`); `kernels`: write the k3
    library's fused ops (`write_fused`; None: where the form keeps k3 functions)."""
    form = graph_form(form)
    kernels = check_kernels(kernels, form)
    bits = check_quantize(quantize, block_size)
    b = K3GraphBuilder(config, export_dtype(dtype), debug_outputs=debug_outputs, attention_mask=attention_mask,
                       layers=layers, experts=experts, form=form, inputs_embeds=inputs_embeds,
                       state_window=state_window, quantize=bits is not None, fp8=fp8)
    b.build()
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)]
    if bits is not None:
        if b.act.name != "float32":
            raise ExportError(f"--quantize {quantize}: MatMulNBits takes fp32 activations on ONNX Runtime's CPU "
                              f"provider; export with --dtype fp32, not {b.act.name}")
        if accuracy_level not in ACCURACY_LEVELS:
            raise ExportError(f"accuracy_level {accuracy_level!r}: MatMulNBits exports use one of {ACCURACY_LEVELS}")
        quantize_projections(b, bits, block_size, accuracy_level)
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    if (form.gated_delta_net or form.ort_contrib) and MS_DOMAIN not in {o.domain for o in opsets}:
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    if fp8:
        keep_fp8(b)
    graph = helper.make_graph(b.nodes, "k3_decoder", b.inputs, b.outputs, initializer=b.constants)
    model = helper.make_model(
        graph,
        opset_imports=opsets,
        ir_version=IR_VERSION,
        functions=all_functions(config, opset, form),
        producer_name="k3export",
        doc_string="Kimi K3 decoder (prefill + decode); state I/O in state_manifest.json",
    )
    if experts in ("mxfp4", "nvfp4"):
        use_mxfp4_function(model, opset, form, nvfp4=experts == "nvfp4",
                           block=expert_block(config.moe_intermediate_size, config.expert_input_size))
    if kernels:
        write_fused(model, config, opset, experts)
    return apply_form(model, form), b


def check_kernels(kernels: bool | None, form: GraphForm) -> bool:
    """Whether an export of `form` writes the fused ops (`kernels`; None: the forms that keep k3 functions do);
    ExportError for a form that inlines them."""
    if kernels is None:
        return form.functions
    if kernels and not form.functions:
        raise ExportError(f"--kernels: the fused k3 ops are k3 functions, which graph form {form.name!r} inlines; "
                          "export with --form functions or --form ort, or with --no-kernels")
    return kernels


def write_fused(model: onnx.ModelProto, config: K3Config, opset: int, experts: str = "dense") -> int:
    """Write into `model` (in place, weights not needed) the k3 library's fused ops in place of the standard-op
    subgraphs they stand for (`fusions.fuse`), each a k3 function whose body is that subgraph (`fused_bodies`):
    ONNX Runtime with the k3 library and OpenVINO with the k3 extension run each as one kernel, any other consumer
    its body. The router fused with MXFP4 experts also gets ONNX Runtime's 8-bit overload (`expert_views.q8_view`);
    NVFP4 experts stay apart from their router (the library has no fused kernel of them). Returns how many nodes
    were fused."""
    from . import graph
    from .fused_bodies import moe_route_experts_function
    from .fusions import fuse

    n = fuse(model, route_experts=experts != "nvfp4")
    add_fused_functions(model, opset, graph.MLA_QUERY_BLOCK, config.kda_conv_kernel,
                        (config.kda_num_heads, config.kda_head_dim, config.kda_head_dim))
    if experts == "mxfp4" and any(f.name == "moe_experts" and f.overload == Q8_OVERLOAD for f in model.functions) \
            and any(node.op_type == "moe_route_experts" for node in model.graph.node):
        model.functions.append(moe_route_experts_function(opset, scales=True, overload=Q8_OVERLOAD))
    return n


def _stored_fp8(source: WeightSource | None, folder: Path | None, config_json: dict[str, Any] | None
                ) -> frozenset[str]:
    """Our names of the weights the source stores in block FP8 (from the shard headers: a graph-only export of a
    Model-Optimizer folder reads them too); none for an in-memory model."""
    if isinstance(source, CheckpointSource):
        return source.fp8_names
    if folder is None or config_json is None:
        return frozenset()
    from k3export.converters.checkpoints.layouts import FP8_BLOCK, quantization_format
    from k3export.converters.checkpoints.plan import scan_checkpoint

    if quantization_format(config_json) != "nvfp4":
        return frozenset()
    scan = scan_checkpoint(folder, config_json=config_json)
    try:
        return frozenset(name for name, t in scan.tensors.items() if t.kind == FP8_BLOCK)
    finally:
        scan.close()


def _check_state_window(window: Any) -> int:
    from k3export.artifacts.manifest import MAX_STATE_WINDOW

    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= MAX_STATE_WINDOW:
        raise ExportError(f"state_window={window!r}: expected an int in [0, {MAX_STATE_WINDOW}] (the draft tokens a "
                          "verify call may take back)")
    return window


def _prepare_out(out: Path, overwrite: bool) -> None:
    from k3export.safety import EXPORT, check_output

    check_output(out, EXPORT, overwrite=overwrite)  # early; again with the sources, under the lock, when writing


def source_identity(folder: Path) -> dict[str, list[int]]:
    """{file: `file_identity`} of a checkpoint folder's safetensors and JSON files: how a resumed export (or
    pipeline) recognises the source it started from, as a resumed conversion does."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))
    return {p.name: file_identity(p.stat()) for p in files}


def _resume_key(source: CheckpointSource, layout: list[tuple[WeightSpec, str, int]], dtype: str,
                allow_nonfinite: bool) -> str:
    """A hash of what determines an export's data bytes: the layout (every weight's name, shape, dtype, parts,
    shard and offset), the options, and the identity of every checkpoint file (`source_identity`)."""
    from k3export import __version__

    payload = {
        "version": __version__, "dtype": dtype, "allow_nonfinite": allow_nonfinite,
        "layout": [[s.name, list(s.shape), s.dtype.name, list(s.parts), loc, off] for s, loc, off in layout],
        "quantized": [[s.name, s.quant.role, s.quant.bits, s.quant.block_size] for s, _, _ in layout if s.quant],
        "sources": source_identity(source.folder),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _prepare_resume(work: Path, key: str, data_files: list[str], restart: bool) -> None:
    """Make a resumable partial export folder ready (`shards.resume_record`): of a run with the same key only the
    data shards stay (`write_weights` checks them against their records); files a killed run may have left
    half-written, or that make the folder look complete, go."""
    from k3export.safety import MARKER, remove_except

    if resume_record(work, ResumeRecord.FILE, key, restart, "export", ExportError) is not None:
        remove_except(work, {MARKER, RESUME_DIR, *data_files})
    write_resume_record(work, ResumeRecord.FILE, ResumeRecord(key))


def export_onnx(model_or_dir: Any, out_dir: str | os.PathLike[str], *, dtype: Any = "fp32",
                opset: int | None = None, weights: bool = True, overwrite: bool = False,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, debug_outputs: bool = False,
                attention_mask: bool = True, layers: range | None = None, experts: str | None = None,
                allow_nonfinite: bool = False, genai: bool | None = None, form: str | None = None,
                vision: bool | None = None, progress: Callable[[int, int], None] | None = None,
                state_window: int = 0, quantize: str | None = None,
                block_size: int = DEFAULT_BLOCK_SIZE, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                projections: str | None = None, kernels: bool | None = None) -> ExportResult:
    """Export a K3 decoder to ``out_dir`` (model.onnx + sharded external data + state manifest + runtime config).

    ``model_or_dir``: a `K3ForCausalLM`, a k3export / Kimi-Linear / released K3 checkpoint folder or Hub id, or a
    `K3Config` with ``weights=False``. ``debug_outputs`` adds ``hidden_states.{i}`` [batch, seq, hidden] after
    every layer (PyTorch's ``output_hidden_states``) to the outputs. ``attention_mask`` (default on) adds the
    ``attention_mask`` input [batch, total_sequence_length] for left-padded batches; ``False`` leaves it out (then
    every row of a batch must have the same length). ``layers`` exports a pipeline stage (a contiguous range).
    ``experts``: ``"mxfp4"`` keeps the routed experts as the checkpoint's MXFP4 bytes (FLOAT4E2M1 + FLOAT8E8M0,
    see `mxfp4`), ``"dense"`` writes them in the export dtype; by default MXFP4 when the source keeps MXFP4.
    ``vision``: an image + text export of a source with a vision tower (a `K3ForConditionalGeneration`, a
    `K3VLConfig`, a ``kimi_k3`` folder with ``vision_config``): ``vision.onnx`` and ``embedding.onnx``
    (`vision.write_vision_graphs`) beside a decoder that takes ``inputs_embeds``, the processor files, and both
    graphs in the manifest and the runtime config. Default: yes for such a source's whole decoder; ``False``: the
    text decoder alone (``input_ids``, vision tensors not read), what a pipeline stage of it is.
    ``genai``: write ``genai_config.json`` for onnxruntime-genai (whole decoders only; an image + text export gets
    its ``vision`` and ``embedding`` sections, `k3export.genai.genai_config`). Default: yes for dense
    experts (genai runs ``model.onnx``); for MXFP4 and NVFP4 experts only when asked, since genai's ONNX Runtime
    cannot run their standard form and needs a second graph over an 8-bit copy of them
    (`k3export.genai.GENAI_MODEL_FILE`, 9 bits per expert weight more on disk); `load_export` checks that graph, and
    ``OrtRunner`` runs it instead of rewriting the experts into a temporary file each session. ``progress(bytes written, bytes in all)`` follows
    the weights, then that 8-bit copy. ``form``: the graph form (`forms`: ``"functions"``, the default, k3 functions
    kept, what ONNX Runtime runs fastest; ``"standard"``, opset-27 standard ops, KDA as ``LinearAttention`` and
    ``CausalConvWithState``, MLA as ``Attention``, for any opset-27 consumer; ``"inlined"``, inlined into standard
    ops of earlier opsets, for OpenVINO; ``"ort"``, KDA as ``com.microsoft::GatedDeltaNet`` and MLA as ``Attention``,
    for a plain ONNX Runtime session), recorded in ``runtime_config.json``. ``state_window``: W > 0 also
    returns every constant-size state after each of a call's last W positions before its end (``present_window.*``,
    `k3export.modeling.contract`), so speculative decoding takes back up to W rejected draft tokens without a second
    call (docs/state.md); onnxruntime-genai's config cannot name these outputs, so such an export gets no genai
    config. ``quantize``: ``"int8"`` / ``"int4"`` stores the dense projections weight-only block-quantized, as
    ``com.microsoft::MatMulNBits`` over blocks of ``block_size`` weights (`quantize`; fp32 exports), quantized from
    the source's weights as they are written; the routed experts stay as ``experts`` says. ``accuracy_level``:
    MatMulNBits' (4: int8 activations, ONNX Runtime's fast path; 0: fp32 activations), recorded in
    ``runtime_config.json``. ``projections``: ``"fp8"`` keeps the weights the checkpoint stores in block FP8
    (NVIDIA's NVFP4 release: its attention projections) as FLOAT8E4M3FN + fp32 scales dequantised in the graph
    (`fp8`); ``"dense"`` writes them decoded in the export dtype; by default FP8 when the source stores them (and
    without ``quantize``). ``kernels``: write the k3 library's fused ops, each a k3 function whose body is the
    standard-op subgraph it stands for (`write_fused`: ONNX Runtime with the k3 ops library and OpenVINO with the k3
    extension run each as one kernel; docs/speed.md); default: for the forms that keep k3 functions.
    The folder is built in a hidden temporary sibling, checked with `load_export`, and renamed into place at the
    end, so an interrupted export never leaves a complete-looking folder. From a checkpoint folder the sibling is
    ``.OUT.partial`` and is kept when a run fails or is killed: the next run keeps every data shard it finished
    (checked by size and sha256) and writes the rest; a source changed since is refused unless ``overwrite``.
    """
    t0 = time.perf_counter()
    act = export_dtype(dtype)
    opset = check_opset(graph_form(form).opset if opset is None else opset)  # None: the form's (`GraphForm.opset`)
    out = Path(out_dir).expanduser().absolute()
    _prepare_out(out, overwrite)
    config, source, source_folder, config_json = resolve_model(model_or_dir, weights, allow_nonfinite)
    experts = resolve_experts(experts, source, config_json=config_json)
    stored_fp8 = _stored_fp8(source, source_folder, config_json)
    projections = choose_projections(projections, stored_fp8, quantize, opset)
    whole = layers is None or layers == range(config.num_hidden_layers)
    try:
        vl = resolve_vision(model_or_dir, config_json)
    except ConfigError as why:
        if vision:
            raise
        # a vision_config that is not MoonViT-V2's: the text model exports as from any text checkpoint (its
        # loader skips the vision tensors); the image graphs need the tower k3export implements
        warnings.warn(f"{why}; exporting the text model alone (input_ids)", stacklevel=2)
        vl = None
    if vision is None:
        vision = vl is not None and whole
    elif vision and vl is None:
        raise ExportError("vision=True, but the model has no vision tower (no vision_config): an image + text "
                          "export needs one")
    elif vision and layers is not None and layers.start != 0:
        raise ExportError("only a pipeline's first stage (layers from 0) carries the vision graphs: export the "
                          "later stages text-only (vision=False)")
    state_window = _check_state_window(state_window)
    if genai is None:
        genai = whole and experts == "dense" and not state_window
    elif genai and state_window:
        raise ExportError("onnxruntime-genai's config cannot name the state window's outputs (present_window.*): "
                          "export with --state-window or with --genai, not both")
    elif genai and not whole:
        raise ExportError("onnxruntime-genai runs whole decoders: a pipeline stage gets no genai_config.json")
    form = graph_form(form)
    if not any(form.name in readable(consumer, experts) for consumer in READERS):
        readers = sorted({f for consumer in READERS for f in readable(consumer, experts)})
        raise ExportError(f"no runtime reads graph form {form.name!r} with {experts} experts: export with --form "
                          f"{' or --form '.join(readers)}")
    # quantized experts: genai runs a second graph over an 8-bit copy of them (`mxfp4.write_ort_form`)
    genai_q8 = bool(genai) and experts in ("mxfp4", "nvfp4")
    if genai_q8 and not form.functions:
        raise ExportError(f"onnxruntime-genai runs {experts.upper()} experts through the k3 moe_experts function, "
                          f"which graph form {form.name!r} inlines: export with --form functions, or without --genai")
    if genai_q8 and source is None:
        raise ExportError(f"the genai form of {experts.upper()} experts is an 8-bit copy of their bytes: a graph-only "
                          "export (--no-weights) cannot write it; export with weights, or without --genai")

    model, b = build_model_proto(config, act, opset, debug_outputs, attention_mask, layers, experts, form,
                                 inputs_embeds=vision, state_window=state_window, quantize=quantize,
                                 block_size=block_size, accuracy_level=accuracy_level,
                                 fp8=stored_fp8 if projections == "fp8" else frozenset(), kernels=kernels)
    specs: list[WeightSpec] = list(b.weights.values())
    layout = plan_layout(specs, max_shard_bytes)
    model.graph.initializer.extend(initializer(s, loc, off) for s, loc, off in layout)
    check_graph_opset(model, opset)  # after the initializers: type inference reads the weights' dtypes
    data_files = sorted({loc for _, loc, _ in layout})
    weight_bytes = sum(s.nbytes for s in specs)
    manifest = StateManifest.from_config(config, act, layers=b.layers, attention_mask=attention_mask,
                                         debug_outputs=debug_outputs,
                                         vision_config=vl.vision_config if vision else None,
                                         state_window=state_window, recurrent_axes=form.recurrent_axes(state_window))
    runtime = RuntimeConfig(model_file=MODEL_FILE, data_files=data_files, weights_materialized=source is not None,
                            weight_bytes=weight_bytes, opset=opset, graph_form=form.name,
                            config=RuntimeConfig.config_json(config), session_options=dict(ORT_SESSION_OPTIONS),
                            quantize=quantize, quantize_block_size=block_size if quantize else None,
                            quantize_accuracy_level=accuracy_level if quantize else None)
    vision_source = None
    if vision:
        from .vision import VisionSource

        if source is not None:  # the vision tensors (and the embedding table) by their graph names
            vision_source = VisionSource(model_or_dir if source_folder is None else source_folder, vl,
                                         allow_nonfinite, config_json=config_json)
        runtime.vision_config = RuntimeConfig.config_json(vl.vision_config)
        runtime.media_placeholder_token_id = int(vl.media_placeholder_token_id)

    from k3export.safety import EXPORT, output_folder

    # the bar runs over the weights, then over the 8-bit experts of genai's graph (K3: ~3.1 TB more)
    total = weight_bytes + (ort_form_bytes(model) if genai_q8 else 0)
    # a checkpoint folder's export resumes where a killed or failed run stopped, one finished data shard at a time
    key = _resume_key(source, layout, act.name, allow_nonfinite) if isinstance(source, CheckpointSource) else None
    # locked, built in a hidden sibling, renamed into place; never replaces a source or a folder k3export did not write
    with output_folder(out, EXPORT, overwrite=overwrite, resumable=key is not None,
                       sources=[model_or_dir, getattr(model_or_dir, "_k3_source", None)]) as tmp:
        if key is not None:  # genai's 8-bit shards resume like the data shards, when they are asked for again
            genai_shards = ort_form_shards(model, GENAI_DATA_PREFIX, max_shard_bytes) if genai_q8 else []
            _prepare_resume(tmp, key, [*data_files, *genai_shards], overwrite)
        try:
            if source is not None:
                write_weights(layout, tmp, source, resume_key=key,
                              progress=None if progress is None else lambda d, _: progress(d, total))
            if vision:
                _write_image_graphs(tmp, vl, vision_source, runtime, act, opset, max_shard_bytes, source_folder)
            manifest.write(tmp)
            runtime.write(tmp)
            if whole and source_folder is not None:
                from k3export.tokenizer import write_export_tokenizer

                write_export_tokenizer(source_folder, tmp, vocab_size=config.vocab_size)
            write_bytes_atomic(tmp, MODEL_FILE, model.SerializeToString())
            if genai:
                from k3export.genai import write_genai_config

                genai_file = MODEL_FILE
                if genai_q8:
                    write_ort_form(model, tmp, GENAI_MODEL_FILE, GENAI_DATA_PREFIX, max_shard_bytes,
                                   None if progress is None else lambda d, _: progress(weight_bytes + d, total),
                                   resume_key=key)
                    genai_file = GENAI_MODEL_FILE
                image = {} if not vision else {  # genai's vision and embedding sections
                    "graphs": {g.role: g.model_file for g in runtime.graphs},
                    "image_token_id": vl.media_placeholder_token_id}
                write_genai_config(tmp, config, dtype=act.name, model_file=genai_file, **image)  # after the tokenizer
            digests = recorded_digests(tmp, data_files, key) if key is not None else {}
            shutil.rmtree(tmp / RESUME_DIR, ignore_errors=True)
            ExportFolder.load(tmp, finishing=True)  # the reader accepts what was written, before it looks complete
        except BaseException:
            if key is not None:  # the partial folder is kept to resume from: it must not look complete
                (tmp / MODEL_FILE).unlink(missing_ok=True)
            raise
        finally:
            if vision_source is not None:
                vision_source.close()
    return ExportResult(
        out_dir=out, model_path=out / MODEL_FILE, dtype=act.name, opset=opset,
        weights_materialized=source is not None, num_nodes=len(model.graph.node),
        num_initializers=len(model.graph.initializer), weight_bytes=weight_bytes, data_files=data_files,
        seconds=time.perf_counter() - t0, manifest=manifest.to_json(), runtime_config=runtime.to_json(),
        data_sha256=digests)


def _write_image_graphs(folder: Path, vl: Any, source: Any, runtime: RuntimeConfig, act: Any, opset: int,
                        max_shard_bytes: int, source_folder: Path | None) -> None:
    """``vision.onnx`` + ``embedding.onnx`` (their data when `source` is given) and the processor files into the
    folder being built; both graphs recorded in `runtime` (``graphs``)."""
    from k3export.artifacts.runtime_config import GraphFiles
    from k3export.modeling.contract import EMBEDDING_ROLE, VISION_ROLE

    from .vision import write_vision_graphs

    vision_graph, embedding_graph = write_vision_graphs(folder, vl, source, dtype=act, opset=opset,
                                                        max_shard_bytes=max_shard_bytes)
    runtime.graphs = [GraphFiles(VISION_ROLE, vision_graph.model_file, vision_graph.data_files),
                      GraphFiles(EMBEDDING_ROLE, embedding_graph.model_file, embedding_graph.data_files)]
    _write_processor(folder, vl, source_folder)


def load_export(dir_or_hub_id: str | os.PathLike[str]) -> ExportFolder:
    """`ExportFolder.load` of an export folder, or of a Hub repo id fetched through `k3export.artifacts.snapshot`."""
    path = Path(dir_or_hub_id).expanduser()
    if isinstance(dir_or_hub_id, str) and not path.exists():
        from k3export.artifacts import snapshot

        path = Path(snapshot(dir_or_hub_id))
    return ExportFolder.load(path)


__all__ = ["ExportFolder", "ExportResult", "K3ExportError", "SUPPORTED_OPSETS", "export_onnx", "load_export"]
