"""Ops the ONNX reference evaluator runs differently from the standard, as the standard defines them (shared by the
ONNX tests that run k3 function bodies through `onnx.reference.ReferenceEvaluator(..., new_ops=[...])`)."""

from __future__ import annotations

import numpy as np
from onnx.reference.ops.op_pad import Pad_18


class Pad(Pad_18):
    """``Pad`` as the standard defines it: negative pads remove elements (onnx.reference's np.pad refuses them)."""

    op_domain = ""

    def _run(self, data, pads, constant_value=None, axes=None, mode=None):
        pads = np.asarray(pads)
        n = len(pads) // 2
        axes = range(data.ndim) if axes is None else [int(a) % data.ndim for a in axes]
        crop = [slice(None)] * data.ndim
        for i, a in enumerate(axes):
            crop[a] = slice(max(-int(pads[i]), 0), data.shape[a] - max(-int(pads[n + i]), 0))
        return super()._run(data[tuple(crop)], np.maximum(pads, 0), constant_value, axes, mode)
