"""OpenVINO runner: an export folder run by OpenVINO's CPU plugin.

OpenVINO's ONNX frontend expands no model-local function and its CPU plugin mis-runs ``If`` nodes with
dynamically shaped outputs. It reads the ``inlined`` form (`k3export.artifacts.graph_forms`) as written (not the
``standard`` one: it converts neither ``LinearAttention-27`` nor ``CausalConvWithState-27``), and the ``functions``
form, the file ONNX Runtime runs, through the k3 extension library (`ov_ext`, built at first use;
``K3EXPORT_OV_EXT=0`` turns it off): each k3 node becomes one of the library's operations (MXFP4 experts on the file's
4-bit bytes, and the fused ops the exporter writes, `k3export.ops.spec.FUSED_SPECS`, one operation each), and
each ``If`` its general branch (`ov_ext.general_branches`); `k3_ext` says whether it does. Where the library cannot
be built (no compiler) or does not take the graph, a functions-form export with dense experts is read with its
function bodies inlined into standard ops (`openvino_session.read_inlined`, slower), and one logged line says why;
an MXFP4 one is refused in one line. The compiled model is
`openvino_session.OpenVinoSession`, and so are an image + text export's image graphs (standard ONNX as written).

Two forms (runtime names ``openvino`` and ``openvino-stateless``), and ``openvino-decode-graph``: the stateful form
with its one-token calls at batch 1 on a second model compiled for one token (`OpenVinoSession` ``decode_graph``):

- stateful (default): every carried state (``past_key_values.{i}.{kind}`` -> ``present.{i}.{kind}``, the
  manifest's pairs) is a variable of the compiled model, as OpenVINO GenAI keeps its KV cache. A call feeds the
  ids and mask and fetches the logits. When the state given to `forward` is the previous call's own output (the
  request's variables hold it), nothing is copied in; any other state (a fresh start, a loaded, forked or
  rolled-back state) is first written into the variables. The returned state is an
  `openvino_session.CarriedState`: read from the variables on access, and copied out once before the request
  moves on, so an earlier `StepOutput` never changes. Without OpenVINO's MakeStateful pass, one warning and the
  stateless form.
- stateless: the carried state goes in and out through the graph's inputs and outputs like every other session
  (`session.SessionRunner`).
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import numpy as np

from k3export.artifacts import load_export
from k3export.errors import K3ExportError
from k3export.modeling.contract import LOGITS

from .base import StepOutput, Tensor
from .openvino_session import OpenVinoSession
from .ov_ext import general_branches
from .session import SessionRunner, keep_feed

_log = logging.getLogger(__name__)


class OpenVinoRunner(SessionRunner):
    """An export folder in either graph form under OpenVINO (CPU by default); `stateful`: keep the carried state in
    the compiled model's variables (module docstring; `stateful` afterwards says whether it is); `properties`: more
    CPU plugin properties; `decode_graph`: run one-token calls at batch 1 on a second model compiled for that shape
    (`OpenVinoSession`: faster decode, a second copy of the repacked projections); `kernels`: run a functions-form
    export through k3export's extension library (True, where it builds and converts the graph: `ov_ext.takes`) or
    with its function bodies inlined (False); None: ``K3EXPORT_OV_EXT`` decides (`k3export.switches`, on by default)."""

    name = "openvino"

    def __init__(self, export_dir: str | os.PathLike[str], *, device: str = "CPU", name: str | None = None,
                 threads: int | None = None, stateful: bool = True, properties: dict[str, Any] | None = None,
                 decode_graph: bool = False, kernels: bool | None = None) -> None:
        from k3export.artifacts.graph_forms import check_export

        export = load_export(export_dir)
        export.require_weights()
        lib, why_not = _extension(export, kernels)
        #: whether the functions form runs through the k3 extension library (`ov_ext`)
        self.k3_ext = lib is not None
        #: whether the functions form runs its function bodies inlined (no extension: `why_not`)
        self.inlined = why_not is not None
        try:
            check_export("openvino-k3ext" if lib else "openvino-inlined" if why_not else "openvino", export)
        except K3ExportError as exc:
            raise K3ExportError(f"{exc} (the k3 extension is not used: {why_not})" if why_not else str(exc)) from None
        if why_not and kernels is not False:  # asked for, or the default: say what it costs
            _log.warning("openvino: the k3 extension is not used (%s); running the functions form with its function "
                         "bodies inlined into standard ops, slower (docs/speed.md)", why_not)
        carried = {s.name: s.present for s in export.manifest.states} if stateful else None
        functions = self.k3_ext or self.inlined
        self.ov = OpenVinoSession(export.model_path, device, threads, carried=carried,
                                  extensions=(lib,) if lib else (), edit=general_branches if functions else None,
                                  inline_functions=self.inlined, properties=properties,
                                  decode_graph=decode_graph, graph=export.graph)
        self.device = device
        opener = partial(OpenVinoSession, device=device, threads=threads)  # the image graphs' sessions
        super().__init__(export, self.ov, name=name, open_graph=opener)

    @property
    def stateful(self) -> bool:
        """Whether the carried state lives in the compiled model's variables."""
        return bool(self.ov.carried)

    def forward(self, input_ids: np.ndarray, state: dict[str, Tensor], attention_mask: np.ndarray,
                images: Any = None) -> StepOutput:
        if not self.stateful:
            return super().forward(input_ids, state, attention_mask, images)
        feeds = {**self.token_feeds(input_ids, attention_mask, images), **keep_feed(self.ov, self.logits_to_keep)}
        self.ov.load_state(state)  # nothing copied when `state` is what the variables hold
        out = self.ov.run(feeds)
        hidden = [out[n] for n in self._hidden_outputs]
        return StepOutput(logits=out[LOGITS], state=self.ov.carried_state(), hidden=hidden or None,
                          window=self.window_of(out))

    def describe(self) -> str:
        form = ("stateful" if self.stateful else "stateless") + (
            ", k3 extension" if self.k3_ext else ", function bodies inlined" if self.inlined else "")
        return (f"{self.name} (openvino {self.ov.version} {self.device}, {form}, "
                f"{self.export.model_path.name}{self.image_note})")


def _extension(export: Any, kernels: bool | None = None) -> tuple[Any, str | None]:
    """(the k3 extension library, None) for a functions-form `export` the library converts (`ov_ext.takes`) where
    it builds; (None, why not) for another functions-form export; (None, None) for an inlined- or standard-form
    one, which needs no library (or which `check_export` refuses). `kernels`: `OpenVinoRunner`'s."""
    from k3export.artifacts.graph_forms import FUNCTIONS, expert_format

    from . import ov_ext

    if export.runtime.graph_form != FUNCTIONS.name:
        return None, None
    if kernels is False:
        return None, "kernels=False"
    if kernels is None and not ov_ext.enabled():
        return None, f"{ov_ext.ENV_SWITCH}=0"
    model = export.graph
    if expert_format(model) == "nvfp4":
        return None, "it converts no NVFP4 experts"
    if not ov_ext.takes(model):
        return None, "the graph does not compute in fp32, and the library's operations do"
    lib = ov_ext.library()
    return (lib, None) if lib else (None, f"it cannot be built here: {ov_ext.unavailable()}")


__all__ = ["OpenVinoRunner"]
