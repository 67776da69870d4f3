"""OpenVINO runner: an export folder in the standard graph form run by OpenVINO's CPU plugin.

OpenVINO's ONNX frontend expands no model-local function and its CPU plugin mis-runs ``If`` nodes with
dynamically shaped outputs, so it reads the ``standard`` form only (`k3export.converters.onnx.forms`; an export
of another form is refused with one line naming the form). The carried state goes in and out through the graph's
inputs and outputs like every other session (`session.SessionRunner`); the compiled model is
`openvino_session.OpenVinoSession`, and so are an image + text export's image graphs (standard ONNX as written).
"""

from __future__ import annotations

import os
from functools import partial

from k3export.artifacts import load_export

from .openvino_session import OpenVinoSession
from .session import SessionRunner


class OpenVinoRunner(SessionRunner):
    """An export folder in the standard graph form under OpenVINO (CPU by default)."""

    name = "openvino"

    def __init__(self, export_dir: str | os.PathLike[str], *, device: str = "CPU", name: str | None = None,
                 threads: int | None = None) -> None:
        from k3export.converters.onnx.forms import check_export

        export = load_export(export_dir)
        export.require_weights()
        check_export(name or self.name, export)
        self.ov = OpenVinoSession(export.model_path, device, threads)
        self.device = device
        opener = partial(OpenVinoSession, device=device, threads=threads)  # the image graphs' sessions
        super().__init__(export, self.ov, name=name, open_graph=opener)

    def describe(self) -> str:
        return f"{self.name} (openvino {self.ov.version} {self.device}, {self.export.model_path.name}{self.image_note})"


__all__ = ["OpenVinoRunner"]
