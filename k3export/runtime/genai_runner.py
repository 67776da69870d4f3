# Copyright 2026 the k3export authors. Apache-2.0.
"""onnxruntime-genai runner: an export folder driven by ``og.Generator`` from its ``genai_config.json``.

genai carries the decode state itself (KV cache, conv and recurrent states, attention mask); this runner feeds it
tokens and reads back what the graph produced: ``logits`` and every ``present.*`` of the last run, by manifest
name, so the validation harness compares them like any other runtime's. The returned state also holds the
generator under `GENERATOR_KEY`; a state can only be fed back unchanged, to the runner that returned it.

How tokens go in (onnxruntime-genai 0.18):

* the prompt (any batch): ``append_tokens`` (for batch 1 also later chunks: continuous decoding);
* a decode token at batch > 1 (genai allows one ``append_tokens`` per generator there): ``set_logits`` with all
  mass on the fed token, ``generate_next_token`` (greedy picks it), then ``get_logits`` runs the graph on it.

genai builds the attention mask from the ids: 1 except a row's trailing ``pad_token_id`` tokens in a batch's
prompt (right padding), 1 for each later token. The runner refuses a mask genai would not build (left padding).

Images (an image + text export, `takes_images`): the prefill takes ``forward(..., images=loop.Images)``, as
every session runner does. genai cannot prepare MoonViT's inputs itself, so the runner hands it the processor's
tensors by name (`k3export.genai.vision_inputs`: ids, packed patches, grids, tokens per image) through
``Generator.set_inputs``, which runs vision -> embedding -> decoder on the prompt; decode steps append token ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from k3export.errors import K3ExportError

from . import pages
from .base import Runner, RuntimeUnavailable, StepOutput, Tensor

#: the key of the returned state that holds the generator (not a graph tensor)
GENERATOR_KEY = "genai.generator"


def genai_status() -> str | None:
    """None when onnxruntime-genai is importable, else why not."""
    try:
        import onnxruntime_genai  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken native library
        return f"onnxruntime-genai is not importable ({type(exc).__name__}: {exc}); pip install 'k3export[genai]'"
    return None


def check_genai_export(export_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`k3export.genai.check_export`, naming the fix for an export with MXFP4 / NVFP4 experts written without the
    graph genai runs (``export --genai``)."""
    from k3export.artifacts import MODEL_FILE
    from k3export.genai import GENAI_CONFIG_FILE, GenaiError, check_export

    root = Path(export_dir)
    if not (root / GENAI_CONFIG_FILE).is_file() and (root / MODEL_FILE).is_file():
        import onnx

        from k3export.artifacts.graph_forms import has_mxfp4

        if has_mxfp4(onnx.load(str(root / MODEL_FILE), load_external_data=False)):
            raise GenaiError(f"{root / GENAI_CONFIG_FILE}: no such file: this export keeps its routed experts in "
                             "MXFP4 or NVFP4, which onnxruntime-genai's ONNX Runtime cannot run as stored; export "
                             "again with --genai to add the 8-bit graph it runs (9 bits per expert weight more on "
                             "disk)")
    return check_export(root)


def genai_mask(input_ids: np.ndarray, pad_token_id: int, first: bool) -> np.ndarray:
    """The mask genai builds for the new tokens `input_ids` [B, T] (module docstring)."""
    mask = np.ones(input_ids.shape, dtype=np.int64)
    if first and input_ids.shape[0] > 1:
        for row, ids in zip(mask, input_ids):
            n = len(ids)
            while n > 0 and ids[n - 1] == pad_token_id:
                n -= 1
            row[n:] = 0
    return mask


class GenaiRunner(Runner):
    """An export folder under onnxruntime-genai (CPU unless `providers` names others, e.g. ``["cuda"]``)."""

    name = "genai"

    def __init__(self, export_dir: str | os.PathLike[str], *, name: str | None = None,
                 providers: list[str] | None = None) -> None:
        why = genai_status()
        if why is not None:
            raise RuntimeUnavailable(why)
        import onnxruntime_genai as og

        from k3export.artifacts import load_export

        from k3export.artifacts.graph_forms import check_export

        self.export = load_export(export_dir)
        self.export.require_weights()
        check_export(name or self.name, self.export)
        self.manifest = self.export.manifest
        self.root = Path(self.export.root)
        genai_config = check_genai_export(self.root)
        model = genai_config["model"]
        self.pad_token_id = int(model["pad_token_id"])
        self.eos_token_ids = {int(i) for i in model["eos_token_id"]}
        self.max_length = int(genai_config["search"]["max_length"])
        self.vocab_size = int(model["vocab_size"])
        if name:
            self.name = name
        self._og = og
        config = og.Config(str(self.root))
        config.clear_providers()
        for p in providers or []:
            config.append_provider(p)
        self.providers = list(providers or ["cpu"])
        self.model = og.Model(config)
        #: bytes of resident memory (ORT's prepacked products) collapsed into 2 MiB pages (`pages.huge_pages`)
        self.huge_pages = pages.session_loaded(self.providers == ["cpu"])
        #: the tower's config of an image + text export, as the runtime config holds it (None: text-only)
        self.vision_config = self.export.runtime.vision_config if self.export.has_vision else None

    def identity(self) -> str:
        return self.export.identity()

    @property
    def takes_images(self) -> bool:
        """Whether `forward` takes ``images`` (the export holds the image graphs and genai's vision section)."""
        return self.vision_config is not None

    def _image_inputs(self, input_ids: np.ndarray, images: Any) -> Any:
        """`images` (`loop.Images`) and the prompt as genai's named inputs, checked as `OrtRunner` checks them
        (genai runs a mismatched prompt silently)."""
        from k3export.genai import NUM_IMAGE_TOKENS_INPUT, vision_inputs
        from k3export.modeling.contract import IMAGE_GRID_THW, PIXEL_VALUES, vision_feeds

        from .images import check_placeholders

        if self.vision_config is None:
            raise K3ExportError(f"{self.export.root}: a text-only export cannot take images")
        if input_ids.shape[0] != 1:
            raise K3ExportError(f"{self.name}: onnxruntime-genai takes images with one prompt (batch 1), got "
                                f"batch {input_ids.shape[0]}")
        feeds = vision_feeds(self.vision_config, images.pixel_values, images.grid_thws)  # refuses in one line
        named = vision_inputs(input_ids, feeds[PIXEL_VALUES], feeds[IMAGE_GRID_THW],
                              self.vision_config["merge_kernel_size"])
        check_placeholders(input_ids, self.export.runtime.media_placeholder_token_id,
                           int(named[NUM_IMAGE_TOKENS_INPUT].sum()))
        tensors = self._og.NamedTensors()
        for key, value in named.items():
            tensors[key] = value
        return tensors

    # -- state handling: genai owns the state; the dict carries it from call to call
    def _start(self, state: dict[str, Tensor], batch: int) -> Any:
        for s in self.manifest.states:
            v = state.get(s.name)
            if v is None or (s.past_axis is not None and np.shape(v)[s.past_axis] != 0) or np.any(np.asarray(v)):
                raise K3ExportError(f"{self.name}: onnxruntime-genai starts from its own zero state; it cannot "
                                    f"resume from a given state ({s.name} is not the initial one)")
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(batch_size=batch, max_length=self.max_length)
        return self._og.Generator(self.model, params)

    def _resume(self, state: dict[str, Tensor]) -> tuple[Any, np.ndarray]:
        gen, last, mask = state[GENERATOR_KEY]
        if any(state.get(name) is not value for name, value in last.items()):
            raise K3ExportError(f"{self.name}: the state fed back is not the one this runner returned (onnxruntime-"
                                "genai carries its own state; a changed state cannot be fed to it)")
        return gen, mask

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray,
                images: Any = None) -> StepOutput:
        B, T = input_ids.shape
        first = GENERATOR_KEY not in state
        if images is not None and not first:
            raise K3ExportError(f"{self.name}: images go with the prompt (the first call); onnxruntime-genai runs the "
                                "vision graph once per generator")
        named = self._image_inputs(np.asarray(input_ids), images) if images is not None else None
        gen, past_mask = (self._start(state, B), np.zeros((B, 0), np.int64)) if first else self._resume(state)
        mask = np.concatenate([past_mask, genai_mask(input_ids, self.pad_token_id, first)], axis=1)
        if not np.array_equal(np.asarray(attention_mask), mask):
            raise K3ExportError(f"{self.name}: onnxruntime-genai builds the attention mask from the ids (1, except a "
                                "batch prompt's trailing pad tokens); it cannot run this mask (left padding?)")
        ids = np.ascontiguousarray(input_ids, dtype=np.int32)
        if named is not None:
            gen.set_inputs(named)  # the prompt's ids with the images: genai runs the three graphs on it
        elif first or B == 1:
            gen.append_tokens(ids)
        elif T == 1:  # batch > 1: genai appends once per generator; later tokens go through its search
            forced = np.full((B, self.vocab_size), -1e30, dtype=np.float32)
            forced[np.arange(B), ids[:, 0]] = 0.0
            gen.set_logits(forced)
            gen.generate_next_token()
            picked = np.asarray(gen.get_next_tokens()).reshape(-1)
            if not np.array_equal(picked, ids[:, 0]):
                raise K3ExportError(f"{self.name}: onnxruntime-genai appended {picked.tolist()} instead of "
                                    f"{ids[:, 0].tolist()} (a sequence that reached eos is finished in genai)")
            gen.get_logits()  # runs the graph on the new tokens
        else:
            raise K3ExportError(f"{self.name}: onnxruntime-genai takes a batch's prompt in one call (chunked "
                                "prefill works at batch 1 only)")
        out: dict[str, Tensor] = {s.name: gen.get_output(s.present) for s in self.manifest.states}
        out[GENERATOR_KEY] = (gen, {s.name: out[s.name] for s in self.manifest.states}, mask)
        return StepOutput(logits=gen.get_output("logits"), state=out)

    def describe(self) -> str:
        graph = (self.export.ort_form_path or self.export.model_path).name  # the graph genai_config names
        from .images import IMAGE_GRAPHS_NOTE

        images = IMAGE_GRAPHS_NOTE if self.takes_images else ""
        return f"{self.name} (onnxruntime-genai {self._og.__version__} {'/'.join(self.providers)}, {graph}{images})"

    def close(self) -> None:
        self.model = None


__all__ = ["GENERATOR_KEY", "GenaiRunner", "genai_mask", "genai_status"]
