"""The k3 native libraries' registrations against the op table (`k3export.ops.spec.LIBRARY_SPECS`): every op the
ONNX Runtime library registers and every k3 node the OpenVINO extension converts is a spec'd op, and every attribute
either binding reads is one its ops declare (a renamed attribute or op fails here, not at a session's load)."""

import re

from k3export.ops.sources import CSRC, binding_sources
from k3export.ops.spec import LIBRARY_SPECS

ORT = (CSRC / "ort_k3.cpp").read_text()
OV = "\n".join(p.read_text() for p in binding_sources(CSRC / "ov_k3.cpp") if p.parent.name != "kernels")
ATTRIBUTES = {n for spec in LIBRARY_SPECS.values() for n in spec.attribute_names}


def test_ort_library_registers_the_table():
    registered = set(re.findall(r'CreateLiteCustomOp<\w+>\(\s*"(\w+)"', ORT))
    assert registered == set(LIBRARY_SPECS)
    read = set(re.findall(r'attr<[\w:]+>\(info, "(\w+)"\)', ORT))
    assert read and read <= ATTRIBUTES, read - ATTRIBUTES


def test_openvino_extension_converts_spec_ops():
    converted = set(re.findall(r'onnx_node\(\s*"(\w+)"', OV))
    # the 4-bit experts are a moe_experts / moe_route_experts node whose weights are FLOAT4E2M1 (no op of their own)
    assert converted == set(LIBRARY_SPECS) - {"moe_experts_mxfp4", "moe_experts_nvfp4", "moe_route_experts_mxfp4"}
    read = set(re.findall(r'get_attribute<[\w:]+>\("(\w+)"\)', OV))
    assert read and read <= ATTRIBUTES, read - ATTRIBUTES
