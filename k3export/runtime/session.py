"""`SessionRunner`: an exported graph run by a session (ONNX Runtime or TensorRT), driven by its manifest.

A session is anything with ``input_names``, ``output_names`` and ``run(feeds) -> {output name: tensor}`` that
casts each feed to the dtype its engine declares. The runner feeds every input the manifest declares
(``input_ids``, ``attention_mask``, every state) by name and reads back ``logits``, every ``present.*`` and the
optional ``hidden_states.*``: the one execution path of every session runtime. An image + text export (its decoder
on ``inputs_embeds``) also opens its image graphs with the runtime's `images.GraphOpener` (`images.ImageGraphs`):
``forward(..., images=loop.Images)`` at the prefill, ``takes_images`` true.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import numpy as np

from k3export.artifacts import ArtifactError, ExportFolder
from k3export.modeling.contract import ATTENTION_MASK, INPUT_IDS, INPUTS_EMBEDS, LOGITS, LOGITS_TO_KEEP

from .base import Runner, StepOutput, Tensor
from .images import IMAGE_GRAPHS_NOTE, GraphOpener, ImageGraphs


class Session(Protocol):
    """A session may also have ``carried``: the states it keeps itself, {state input: its output} (OpenVINO's
    stateful form), in neither list; its runner sets and reads them through the session (`OpenVinoRunner`)."""

    input_names: list[str]  # the inputs a call must feed
    output_names: list[str]

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]: ...


class SessionRunner(Runner):
    """`export` (a checked `ExportFolder`) run by `session`; the session's I/O must be the manifest's. `open_graph`
    opens the image graphs of an image + text export (`images.ImageGraphs`)."""

    def __init__(self, export: ExportFolder, session: Session, *, name: str | None = None, where: str = "",
                 open_graph: GraphOpener | None = None) -> None:
        self.export, self.session = export, session
        self.manifest = export.manifest
        if name:
            self.name = name
        where = where or str(export.model_path)
        ins, outs = self.manifest.graph_io()
        carried: dict[str, str] = getattr(session, "carried", {})
        for side, have, want in (("input", [*session.input_names, *carried], ins),
                                 ("output", [*session.output_names, *carried.values()], outs)):
            missing = [n for n in want if n not in have]
            extra = [n for n in have if n not in want]
            if missing or extra:
                raise ArtifactError(f"{where}: {side}s do not match {export.root / self.manifest.FILE} "
                                    f"(missing {missing[:4]}, unexpected {extra[:4]})")
        if LOGITS not in self.manifest.output_names:
            raise ArtifactError(f"{export.root}: a pipeline stage without logits runs only inside a pipeline")
        if export.has_vision and open_graph is None:
            raise ArtifactError(f"{export.root}: an image + text export, and runner {self.name} opens no image graphs")
        #: the image graphs' sessions (None for a text-only export)
        self.images = ImageGraphs(export, open_graph) if export.has_vision else None
        # read once: a decode step looks them up every call
        self._hidden_outputs = self.manifest.hidden_outputs
        self._window_outputs = self.manifest.window_outputs()

    def identity(self) -> str:
        return self.export.identity()

    @property
    def takes_images(self) -> bool:
        """Whether `forward` takes ``images`` (the export holds the image graphs)."""
        return self.images is not None

    @property
    def image_note(self) -> str:
        """What `describe` adds for the image graphs ("" for a text-only export)."""
        return IMAGE_GRAPHS_NOTE if self.takes_images else ""

    def _image_graphs(self) -> ImageGraphs:
        if self.images is None:
            raise ArtifactError(f"{self.export.root}: a text-only export cannot take images")
        return self.images

    def vision_stages(self, images: Any, expose: Any) -> dict[str, np.ndarray]:
        """Every vision stage's output on one prompt's images, the stages exposed by `expose`
        (`images.ImageGraphs.stages`)."""
        return self._image_graphs().stages(images, expose)

    def inputs_embeds(self, input_ids: np.ndarray, images: Any = None) -> np.ndarray:
        """The decoder's ``inputs_embeds``: the embedding graph on `input_ids` [B, T], `images`' features over the
        placeholder tokens at the prefill, none at a decode step."""
        return self._image_graphs().embed(input_ids, images)

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray,
                images: Any = None) -> StepOutput:
        return self.step_output(self.session.run(self.feeds(input_ids, state, attention_mask, images)))

    def feeds(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray,
              images: Any = None) -> dict[str, Any]:
        """Every graph input of one call, by name (``logits_to_keep`` when the session takes it)."""
        feeds = self.token_feeds(input_ids, attention_mask, images)
        for s in self.manifest.states:
            if s.name not in state:
                raise ArtifactError(f"{self.name}: state {s.name!r} missing from the fed state")
            feeds[s.name] = state[s.name]
        return {**feeds, **keep_feed(self.session, self.logits_to_keep)}

    def token_feeds(self, input_ids: np.ndarray, attention_mask: np.ndarray, images: Any = None) -> dict[str, Any]:
        """The graph inputs of one call other than the states and ``logits_to_keep``: ids (or their embeddings)
        and the mask."""
        if images is not None:
            self._image_graphs()
        feeds: dict[str, Any] = {}
        for t in self.manifest.inputs:
            if t.name == INPUT_IDS:
                feeds[t.name] = input_ids
            elif t.name == ATTENTION_MASK:
                feeds[t.name] = attention_mask
            elif t.name == INPUTS_EMBEDS:
                feeds[t.name] = self.inputs_embeds(input_ids, images)
            else:
                raise ArtifactError(f"{self.export.root}: input {t.name!r} has no value in a decode loop (a pipeline "
                                    "stage runs only inside a pipeline)")
        return feeds

    def step_output(self, out: dict[str, Any]) -> StepOutput:
        """The session's outputs of one call as a `StepOutput` (states by their manifest names)."""
        hidden = [out[n] for n in self._hidden_outputs]
        return StepOutput(logits=out[LOGITS], state={s.name: out[s.present] for s in self.manifest.states},
                          hidden=hidden or None, window=self.window_of(out))

    def window_of(self, out: dict[str, Any]) -> dict[str, Any] | None:
        """The state window among the session's outputs, by state name (None: the export has none)."""
        return {n: out[w] for n, w in self._window_outputs.items()} or None


def keep_feed(session: Session, logits_to_keep: int) -> dict[str, np.ndarray]:
    """The optional ``logits_to_keep`` feed, when one is asked for (> 0) and the session's graph takes it (an ONNX
    Runtime session of a graph that ends in logits); else nothing, and the graph returns every position."""
    if logits_to_keep and LOGITS_TO_KEEP in getattr(session, "optional_inputs", ()):
        return {LOGITS_TO_KEEP: _scalar(int(logits_to_keep))}
    return {}


@functools.lru_cache(maxsize=64)
def _scalar(value: int) -> np.ndarray:
    """A read-only int64 scalar, the same array at every call: a session bound to it last step need not rebind."""
    arr = np.array(value, np.int64)
    arr.flags.writeable = False
    return arr


__all__ = ["Session", "SessionRunner", "keep_feed"]
