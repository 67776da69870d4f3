"""`k3export generate`: text in, streamed text out, through any runtime (greedy).

    k3export generate MODEL_DIR "prompt"                          # PyTorch (the reference)
    k3export generate EXPORT_DIR "prompt" --runtime genai --chat  # onnxruntime-genai: its tokenizer, its loop
    k3export generate EXPORT_DIR "prompt" --runtime ort           # ONNX Runtime through k3export's decode loop
    k3export generate MODEL_OR_EXPORT "What is in this picture?" --image cat.png   # image + text

torch and triton run a checkpoint folder (or the one given by --model); ort, ort-cuda, genai, trt, openvino,
openvino-stateless, openvino-decode-graph and onnx-reference run an export folder (or --onnx; trt also needs
--engine; openvino runs either graph form, the functions form through k3export's OpenVINO extension of the k3 ops
where it builds, its carried state kept in the compiled model's variables; openvino-stateless feeds and fetches it
every step; openvino-decode-graph runs the decode steps on a second model compiled for one token: faster, with a
second copy of the repacked projections);
pipeline (the default there) and ray run a pipeline export (`export --stages N`: its stages chained in this
process, or one Ray actor each). The tokenizer comes from the folder given: a checkpoint's tiktoken files (copied by
`convert`) or an export's tokenizer.json (written by `export`, beside pipeline.json for a pipeline). genai uses
onnxruntime-genai's own tokenizer, chat template and generator; every other runtime uses the transformers tokenizer
and `k3export.runtime.loop.Decoding`. Generation stops at the model's eos or after --max-new-tokens.

``--image PATH`` (repeatable) runs a checkpoint with a vision tower (torch, triton: `K3ForConditionalGeneration`) or
an export of one on any export runtime (vision.onnx -> embedding.onnx -> decoder; genai gets the processor's
tensors, as it cannot express MoonViT's preprocessing, and its tokens are printed by the transformers tokenizer,
as for the other runtimes): the folder's `K3Processor` (``preprocessor_config.json``) resizes and packs the images
and expands one ``<|kimi_image_placeholder|>`` per image in the prompt; a prompt without placeholders gets them in
front, one per image, in order (with ``--chat``, as image parts of the user's turn, which the chat template writes
as placeholders: `k3export.tokenizer.chat_prompt`). A text-only model refuses images in one line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import KernelsOption, user_errors

# what runs the model: the options of generate, chat and cache
ModelOption = Annotated[Path | None, typer.Option("--model", help="Checkpoint folder, when MODEL_OR_EXPORT is an "
                                                                   "export.")]
OnnxOption = Annotated[Path | None, typer.Option("--onnx", help="ONNX export folder, when MODEL_OR_EXPORT is a "
                                                                 "checkpoint.")]
EngineOption = Annotated[Path | None, typer.Option("--engine", help="TensorRT engine (runtime trt).")]
DeviceOption = Annotated[str, typer.Option("--device", help="cpu or cuda (torch, triton).")]

RUNTIMES = ("torch", "triton", "ort", "ort-cuda", "ort-webgpu", "genai", "trt", "openvino", "openvino-stateless",
            "openvino-decode-graph", "onnx-reference", "pipeline", "ray")
_CHECKPOINT_RUNTIMES = ("torch", "triton")
_PIPELINE_RUNTIMES = ("pipeline", "ray")  # a pipeline export's stages chained in this process, or on Ray actors


def _is_pipeline(folder: Path) -> bool:
    return (folder / "pipeline.json").is_file()


def _is_export(folder: Path) -> bool:
    """An ONNX export: one graph (state_manifest.json) or a pipeline of stages (pipeline.json)."""
    return (folder / "state_manifest.json").is_file() or _is_pipeline(folder)


def _default_runtime(path: Path) -> str:
    return "pipeline" if _is_pipeline(path) else "ort" if _is_export(path) else "torch"


def _folders(path: Path, runtime: str, model: Path | None, onnx: Path | None) -> tuple[Path | None, Path | None]:
    """(checkpoint folder, export folder) for `runtime`, from PATH and the --model / --onnx options."""
    from k3export.errors import K3ExportError

    if not path.is_dir():
        raise K3ExportError(f"{path}: not a folder (a checkpoint or an ONNX export)")
    # an option that would be ignored is refused: a run must not silently use other files than the ones named
    for option, folder, want_export in (("--model", model, False), ("--onnx", onnx, True)):
        if folder is not None and not folder.is_dir():
            raise K3ExportError(f"{option} {folder}: not a folder")
        if folder is not None and _is_export(folder) != want_export:
            raise K3ExportError(f"{option} {folder}: expected " + (
                "a k3export ONNX export (it has no state_manifest.json)" if want_export else
                "a checkpoint folder, not an ONNX export"))
    if _is_export(path) and onnx is not None:
        raise K3ExportError(f"--onnx is for a checkpoint MODEL_OR_EXPORT; {path} is an ONNX export already")
    if not _is_export(path) and model is not None:
        raise K3ExportError(f"--model is for an ONNX export MODEL_OR_EXPORT; {path} is the checkpoint already")
    if runtime == "genai" and model is not None:
        raise K3ExportError("--model is not used by runtime genai: onnxruntime-genai runs the export with the "
                            "export's own tokenizer")
    ckpt, export = (model, path) if _is_export(path) else (path, onnx)
    if runtime in _CHECKPOINT_RUNTIMES and ckpt is None:
        raise K3ExportError(f"runtime {runtime} runs a checkpoint; {path} is an ONNX export (pass --model MODEL_DIR)")
    if runtime not in _CHECKPOINT_RUNTIMES and export is None:
        raise K3ExportError(f"runtime {runtime} runs an ONNX export; {path} is a checkpoint (pass --onnx EXPORT_DIR, "
                            "made by `k3export export`)")
    if export is not None and runtime not in _CHECKPOINT_RUNTIMES and \
            _is_pipeline(export) != (runtime in _PIPELINE_RUNTIMES):
        raise K3ExportError(f"{export}: a pipeline export runs on runtime {' or '.join(_PIPELINE_RUNTIMES)}, not "
                            f"{runtime}" if _is_pipeline(export) else
                            f"runtime {runtime} runs a pipeline export (pipeline.json); {export} is one graph")
    return ckpt, export


def _config(folder: Path) -> Any:
    """The checked `K3Config` of a checkpoint (config.json) or an export (runtime_config.json); None without one.
    Errors name the file."""
    if (folder / "config.json").is_file():
        from k3export.checkpoint_io import load_config

        return load_config(folder)
    if _is_pipeline(folder):
        from k3export.pipeline import load_pipeline

        return load_pipeline(folder).config
    if _is_export(folder):
        from k3export.artifacts.runtime_config import RuntimeConfig

        return RuntimeConfig.read(folder).k3_config(folder / RuntimeConfig.FILE)
    return None


def _text_stream(decode: Any) -> Any:
    """A function ids-so-far -> new text to print (holds back a partial UTF-8 character)."""
    shown = ""

    def new_text(ids: list[int], final: bool = False) -> str:
        nonlocal shown
        text = decode(ids)
        if text.endswith("\ufffd") and not final:
            return ""
        if not text.startswith(shown):  # a merge rewrote the tail: print only what is new from here on
            shown = text
            return ""
        out, shown = text[len(shown):], text
        return out

    return new_text


def open_runner(runtime: str, ckpt: Path | None, export: Path | None, engine: Path | None, device: str,
                images: bool = False, kernels: bool | None = None) -> Any:
    """The runner of `runtime` (a checkpoint's model loaded for torch / triton), keeping the last logits only;
    `kernels`: `Target.kernels`."""
    from k3export.pipeline import PIPELINE_RUNNERS
    from k3export.runtime import RUNNERS, Target

    model = None
    if runtime in _CHECKPOINT_RUNTIMES:
        from k3export.runtime.torch_runner import load_model, load_vision_model

        model = (load_vision_model if images else load_model)(ckpt, device=device)
    factory = RUNNERS.get(runtime) or PIPELINE_RUNNERS[runtime]
    runner = factory(Target(model=model, onnx_dir=export, engine=engine, device=device,
                            pipeline_dir=export if runtime in _PIPELINE_RUNTIMES else None, kernels=kernels))
    runner.logits_to_keep = 1  # only the next token's: no [prompt, vocab] logits
    return runner


def _runner_tokens(runtime: str, ckpt: Path | None, export: Path | None, engine: Path | None, device: str,
                   prompt_ids: list[int], max_new: int, eos: set[int], prefill_chunk: int = 0,
                   images: Any = None, prefix: Path | None = None, draft: str | None = None,
                   kernels: bool | None = None) -> Iterator[int]:
    """Greedy tokens from k3export's decode loop on `runtime`; the prompt fed `prefill_chunk` tokens at a time
    (0: at once); `images` (`k3export.runtime.loop.Images`) go to the prefill; `prefix`: a saved state whose tokens
    start `prompt_ids` (only the rest is fed); `draft`: speculative decoding (`k3export.runtime.speculate`)."""
    import numpy as np

    from k3export.artifacts import State
    from k3export.runtime import Decoding, next_tokens
    from k3export.runtime.loop import with_images

    runner = open_runner(runtime, ckpt, export, engine, device, images is not None, kernels)
    try:
        start = None if prefix is None else State.load(prefix, runner, batch=1)
        if start is not None and start.tokens[0].tolist() != prompt_ids[:start.past]:
            from k3export.errors import K3ExportError

            raise K3ExportError(f"{prefix}: the saved state's tokens do not start the prompt")
        if draft is not None:
            from k3export.runtime.speculate import speculative_tokens

            yield from speculative_tokens(runner, prompt_ids, max_new, eos, draft, start=start)
            return
        d = Decoding(with_images(runner, images), start)
        rest = prompt_ids[0 if start is None else start.past:]
        step = prefill_chunk or len(rest)
        for first in range(0, len(rest), step):  # the carried state makes chunks one prefill
            out = d.feed(np.asarray([rest[first:first + step]], dtype=np.int64))
        for _ in range(max_new):
            tok = int(next_tokens(out)[0])
            if tok in eos:
                return
            yield tok
            out = d.feed(np.asarray([[tok]], dtype=np.int64))
    finally:
        runner.close()


def _check_draft(draft: str, config: Any) -> None:
    """Refuse, from its config alone and before the target model loads, a --draft that is neither
    ``prompt-lookup`` nor a checkpoint / export folder of the target's vocabulary."""
    from k3export.errors import K3ExportError

    if draft == "prompt-lookup":
        return
    folder = Path(draft)
    if not folder.is_dir() or not ((folder / "config.json").is_file() or _is_export(folder)):
        raise K3ExportError(f"--draft {draft}: expected 'prompt-lookup' or a draft checkpoint / export folder")
    if _is_pipeline(folder):
        raise K3ExportError(f"--draft {draft}: a pipeline export cannot draft; give a checkpoint or one-graph export")
    theirs = _config(folder)
    if config is not None and theirs is not None and int(theirs.vocab_size) != int(config.vocab_size):
        raise K3ExportError(f"--draft {draft}: the draft model's vocabulary ({theirs.vocab_size}) is not the "
                            f"target's ({config.vocab_size})")


def eos_ids(config: Any) -> set[int]:
    """The eos ids of a checked config (each a token id of the model); none without a config."""
    eos = None if config is None else config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _check_takes_images(runtime: str, ckpt: Path | None, export: Path | None) -> None:
    """Refuse images for a text-only checkpoint or export in one line, before anything is loaded."""
    from k3export.errors import K3ExportError

    if runtime in _CHECKPOINT_RUNTIMES:
        from k3export.files import read_config_json

        folder, has = ckpt, isinstance(read_config_json(ckpt, K3ExportError).get("vision_config"), dict)
    else:
        from k3export.artifacts.runtime_config import RuntimeConfig

        folder, has = export, bool(RuntimeConfig.read(export).graphs)
    if not has:
        raise K3ExportError(f"{folder}: a text-only {'checkpoint' if runtime in _CHECKPOINT_RUNTIMES else 'export'} "
                            "cannot take images (--image needs a model with a vision tower, or an export of one)")


def _image_inputs(folder: Path, tok: Any, text: str, images: list[Path]) -> tuple[list[int], Any]:
    """(prompt ids with each image's placeholder expanded, `loop.Images`) from `folder`'s `K3Processor`."""
    from k3export.errors import K3ExportError
    from k3export.modeling.image_processing_k3 import K3Processor
    from k3export.runtime.loop import Images

    if not (folder / "preprocessor_config.json").is_file():
        raise K3ExportError(f"{folder}: no preprocessor_config.json: --image needs a checkpoint with a vision tower "
                            "(or an export of one)")
    processor = K3Processor.from_pretrained(folder, tokenizer=tok)
    inputs = processor(text=text, images=[str(p) for p in images], return_tensors="np")
    return list(inputs["input_ids"][0]), Images(inputs["pixel_values"], inputs["grid_thws"])


def text_side(path: Path, runtime: str | None, model: Path | None = None,
              onnx: Path | None = None) -> tuple[str, Path | None, Path | None, Any, Any]:
    """(runtime, checkpoint folder, export folder, tokenizer, checked config) of a text command (chat, cache) on
    `path`; genai is refused: it carries its own state, which cannot be saved or resumed."""
    from k3export.errors import K3ExportError
    from k3export.tokenizer import has_tokenizer, load_tokenizer

    runtime = runtime or _default_runtime(path)
    if runtime not in RUNTIMES or runtime == "genai":
        raise K3ExportError(f"runtime {runtime!r}: choose from {', '.join(r for r in RUNTIMES if r != 'genai')} "
                            "(onnxruntime-genai carries its own state: it cannot save or resume one)")
    ckpt, export = _folders(path, runtime, model, onnx)
    tok_dir = path if has_tokenizer(path) else next((f for f in (ckpt, export) if f and has_tokenizer(f)), None)
    if tok_dir is None:
        raise K3ExportError(f"{path}: no tokenizer (tiktoken.model or tokenizer.json)")
    config = _config(ckpt if ckpt is not None else export)  # type: ignore[arg-type]
    return runtime, ckpt, export, load_tokenizer(tok_dir, None if config is None else int(config.vocab_size)), config


def generate_text(path: Path, prompt: str, *, runtime: str | None = None, max_new_tokens: int = 64,
                  chat: bool = False, model: Path | None = None, onnx: Path | None = None, engine: Path | None = None,
                  device: str = "cpu", prefill_chunk: int = 0, images: list[Path] | None = None,
                  prefix_state: Path | None = None, draft: str | None = None,
                  kernels: bool | None = None) -> Iterator[str]:
    """Pieces of generated text, as they come (the command prints them). `prefill_chunk` > 0 feeds the prompt that
    many tokens at a time: activation memory bounded by the chunk, not the prompt (not with genai, which takes the
    prompt whole). `images`: image files for the prompt (module docstring). `prefix_state`: a ``.k3state`` of a
    cached prefix (``k3export cache``); the prompt continues it (with `chat`, as a user turn after its system
    turn). `draft`: speculative decoding, ``prompt-lookup`` or a draft model / export folder. `kernels`: the
    native kernels on or off (`Target.kernels`; None: the environment's default)."""
    from k3export.errors import K3ExportError
    from k3export.tokenizer import chat_prompt, has_tokenizer, load_tokenizer

    runtime = runtime or _default_runtime(path)
    if runtime not in RUNTIMES:
        raise K3ExportError(f"unknown runtime {runtime!r}; choose from {', '.join(RUNTIMES)}")
    if prefill_chunk < 0 or (prefill_chunk and runtime == "genai"):
        raise K3ExportError(f"--prefill-chunk {prefill_chunk}: expected a token count >= 1 (0: the whole prompt at "
                            "once), and not with genai, whose generator takes the prompt whole")
    if images and prefill_chunk:
        raise K3ExportError(f"--prefill-chunk {prefill_chunk}: a prompt with images is fed whole (its image tokens "
                            "are spliced in one prefill)")
    if (prefix_state or draft) and (images or runtime == "genai"):
        raise K3ExportError(f"{'--prefix-state' if prefix_state else '--draft'} is not with "
                            f"{'--image' if images else 'genai'}: " + (
                                "a prompt with images is prefilled whole" if images else
                                "onnxruntime-genai starts every generator from its own zero state"))
    ckpt, export = _folders(path, runtime, model, onnx)
    if images:
        _check_takes_images(runtime, ckpt, export)
    if runtime == "genai" and not images:
        yield from _genai_text(export, prompt, max_new_tokens, chat)  # type: ignore[arg-type]
        return
    tok_dir = path if has_tokenizer(path) else next((f for f in (ckpt, export) if f and has_tokenizer(f)), None)
    if tok_dir is None:
        raise K3ExportError(f"{path}: no tokenizer (tiktoken.model or tokenizer.json); `convert` copies it from the "
                            "source and `export` writes it")
    config = _config(ckpt if ckpt is not None else export)  # type: ignore[arg-type]  # read once, checked
    if draft is not None:
        _check_draft(draft, config)
    tok = load_tokenizer(tok_dir, None if config is None else int(config.vocab_size))
    pixels, parts, text = None, 0, prompt
    if images:  # images the prompt places nowhere go in front of it, in order
        from k3export.modeling.image_processing_k3 import IMAGE_PLACEHOLDER

        if IMAGE_PLACEHOLDER not in prompt:
            parts = len(images)
            text = IMAGE_PLACEHOLDER * parts + prompt
    if chat and prefix_state is None:  # images as image parts of the user's turn: the template writes them
        text = chat_prompt(tok, prompt, images=parts)
    if images:
        source = ckpt if runtime in _CHECKPOINT_RUNTIMES else export
        ids, pixels = _image_inputs(source, tok, text, list(images))  # type: ignore[arg-type]
    elif prefix_state is not None:  # the cached prefix's text, then the prompt, tokenized at once
        from k3export.artifacts import State
        from k3export.conversation import chat_suffix, continue_prefix

        cached = State.read(prefix_state, None if config is None else int(config.vocab_size)).tokens
        if cached.shape[0] != 1:
            raise K3ExportError(f"{prefix_state}: a state of batch {cached.shape[0]}; generate continues batch 1")
        ids = continue_prefix(tok, cached[0].tolist(), chat_suffix(tok, prompt) if chat else prompt)
    else:
        ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        raise K3ExportError("the prompt is empty")
    eos = eos_ids(config)
    new_text = _text_stream(lambda t: tok.decode(t, skip_special_tokens=True))
    out: list[int] = []
    if runtime == "genai":  # images (text goes through genai's own loop above): GenaiRunner in the shared loop
        from k3export.runtime.genai_runner import check_genai_export

        _check_context(export, check_genai_export(export), len(ids), max_new_tokens)  # type: ignore[arg-type]
    for t in _runner_tokens(runtime, ckpt, export, engine, device, ids, max_new_tokens, eos, prefill_chunk, pixels,
                            prefix_state, draft, kernels):
        out.append(t)
        piece = new_text(out)
        if piece:
            yield piece
    tail = new_text(out, final=True)
    if tail:
        yield tail


def _check_context(export: Path, cfg: dict[str, Any], prompt_len: int, max_new: int) -> None:
    """Refuse, before genai allocates its cache, a prompt + --max-new-tokens past the context the export's
    genai_config.json declares (genai would raise a RuntimeError of its own mid-way)."""
    from k3export.errors import K3ExportError

    context = int(cfg["model"]["context_length"])
    if prompt_len + max_new > context:
        raise K3ExportError(f"{export / 'genai_config.json'}: the prompt ({prompt_len} tokens) + --max-new-tokens "
                            f"{max_new} needs {prompt_len + max_new} tokens, past its context_length {context}")


def _genai_text(export: Path, prompt: str, max_new_tokens: int, chat: bool) -> Iterator[str]:
    """onnxruntime-genai end to end: og.Tokenizer (and its chat template), og.Generator with the search options
    of genai_config.json, og.TokenizerStream."""
    from k3export.errors import K3ExportError
    from k3export.runtime.genai_runner import check_genai_export, genai_status
    from k3export.tokenizer import chat_messages

    why = genai_status()
    if why is not None:
        raise K3ExportError(why)
    import numpy as np
    import onnxruntime_genai as og

    cfg = check_genai_export(export)
    if chat:  # genai renders the template itself: parse it first, so a broken one is named (`check_chat_template`)
        from k3export.tokenizer import read_tokenizer_source

        read_tokenizer_source(export / cfg["model"].get("tokenizer_dir", "."))
    try:
        model = og.Model(str(export))
    except Exception as exc:  # noqa: BLE001 - genai reports every file it cannot read as a RuntimeError
        raise K3ExportError(f"{export}: onnxruntime-genai cannot load the export: {str(exc).splitlines()[0]}") \
            from None
    try:
        tokenizer = og.Tokenizer(model)
    except Exception as exc:  # noqa: BLE001 - genai reports a missing or unreadable tokenizer as RuntimeError
        raise K3ExportError(f"{export}: onnxruntime-genai cannot load the tokenizer: {exc}") from None
    text = tokenizer.apply_chat_template(json.dumps(chat_messages(prompt)), add_generation_prompt=True) if chat \
        else prompt
    ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
    if ids.size == 0:
        raise K3ExportError("the prompt is empty")
    _check_context(export, cfg, int(ids.size), max_new_tokens)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=int(ids.size) + max_new_tokens)
    gen = og.Generator(model, params)
    gen.append_tokens(ids[None])
    stream = tokenizer.create_stream()
    while not gen.is_done():
        gen.generate_next_token()
        piece = stream.decode(int(gen.get_next_tokens()[0]))
        if piece:
            yield piece


def generate(
    model_or_export: Path = typer.Argument(..., metavar="MODEL_OR_EXPORT",
                                           help="Checkpoint folder (torch, triton) or ONNX export folder."),
    prompt: str = typer.Argument(..., help="The prompt text."),
    runtime: str | None = typer.Option(None, "--runtime", help="torch, triton, ort, ort-cuda, ort-webgpu, genai, trt, "
                                                               "openvino, "
                                                               "openvino-stateless, openvino-decode-graph, "
                                                               "onnx-reference, pipeline or "
                                                               "ray. Default: torch for a checkpoint, ort for an "
                                                               "export, pipeline for a pipeline export."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Most tokens to generate."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user turn with the chat template."),
    model: ModelOption = None,
    onnx: OnnxOption = None,
    engine: EngineOption = None,
    device: DeviceOption = "cpu",
    kernels: KernelsOption = None,
    prefill_chunk: int = typer.Option(0, "--prefill-chunk", help="Feed the prompt this many tokens at a time "
                                      "(bounds activation memory by the chunk; 0: the whole prompt at once)."),
    image: list[Path] | None = typer.Option(None, "--image", help="An image for the prompt (repeatable; a model "
                                            "with a vision tower or an export of one; torch, triton, ort, "
                                            "ort-cuda, genai). Placed at each <|kimi_image_placeholder|>, else "
                                            "in front."),
    prefix_state: Path | None = typer.Option(None, "--prefix-state", help="A saved state of a cached prefix "
                                             "(k3export cache); the prompt continues it, only its own tokens fed."),
    draft: str | None = typer.Option(None, "--draft", help="Speculative decoding: 'prompt-lookup' (n-grams of the "
                                     "prompt, no model) or a draft checkpoint / export folder with the same "
                                     "tokenizer. The tokens are those of plain greedy decoding."),
) -> None:
    """Generate text from PROMPT (greedy), streamed to stdout as it is produced."""
    with user_errors():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stdout carries the generated text only
        for piece in generate_text(model_or_export, prompt, runtime=runtime, max_new_tokens=max_new_tokens,
                                   chat=chat, model=model, onnx=onnx, engine=engine, device=device,
                                   prefill_chunk=prefill_chunk, images=image or None, prefix_state=prefix_state,
                                   draft=draft, kernels=kernels):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
