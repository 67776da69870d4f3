# Copyright 2026 the k3export authors. Apache-2.0.
"""The exporter's edits of a graph by form (`apply_form`) and the value counts its passes read (`value_uses`).

The forms themselves, which consumer reads which and the branch names the builder writes are facts the runtimes
share, so they live below both in `k3export.artifacts.graph_forms`; they are imported here for the exporter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from k3export.artifacts.graph_forms import (DEFAULT_FORM, EXPERT_FORMATS, FORMS, FP8_READERS, FUNCTIONS, INLINED,
                                            INT64_MAX, KDA_ONE_TOKEN, MLA_QUERY_BLOCKS, ORT, READERS, STANDARD,
                                            TRT_SKIPPED_BRANCHES, GraphForm, check_export, check_fp8, check_reader,
                                            expert_format, fp8_projections, graph_form, has_mxfp4, readable)


def value_uses(nodes: Iterable[Any]) -> dict[str, int]:
    """How many node inputs name each value in `nodes` (``onnx.NodeProto``s) and in the graphs their attributes
    hold (``If`` branches, ``Loop`` bodies), which may read values from outside."""
    from onnx import AttributeProto

    counts: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            counts[name] = counts.get(name, 0) + 1
        for a in node.attribute:
            for g in [a.g] if a.type == AttributeProto.GRAPH else a.graphs:
                for name, n in value_uses(g.node).items():
                    counts[name] = counts.get(name, 0) + n
    return counts


def apply_form(model: Any, form: GraphForm) -> Any:
    """`model` (built for `form`, k3 functions attached; weights not loaded) as the file of that form: itself for
    a form that keeps the functions, else every k3 node replaced by its body (``onnx.inliner``) and the k3
    domain dropped from the imports."""
    if form.functions:
        return model
    from onnx import inliner

    domains = {f.domain for f in model.functions}
    inlined = inliner.inline_local_functions(model)
    keep = [o for o in inlined.opset_import if o.domain not in domains]
    del inlined.opset_import[:]
    inlined.opset_import.extend(keep)
    del inlined.functions[:]
    return inlined


__all__ = ["DEFAULT_FORM", "EXPERT_FORMATS", "FORMS", "FP8_READERS", "FUNCTIONS", "GraphForm", "INLINED",
           "INT64_MAX", "KDA_ONE_TOKEN", "MLA_QUERY_BLOCKS", "ORT", "READERS", "STANDARD", "TRT_SKIPPED_BRANCHES",
           "apply_form", "check_export", "check_fp8", "check_reader", "expert_format", "fp8_projections",
           "graph_form", "has_mxfp4", "readable", "value_uses"]
