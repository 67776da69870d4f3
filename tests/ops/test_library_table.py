"""The k3 native libraries against the op table (`k3export.ops.spec.LIBRARY_SPECS`): the C++ attribute structs are
generated from it (`sources.attributes_header`), every ONNX Runtime kernel and OpenVINO operation takes its name and
attributes from one of them, and no binding spells an attribute or op name by hand (a renamed attribute or op
changes the generated header, and the bindings follow or fail to compile)."""

import re

from k3export.ops.sources import CSRC, attributes_header, binding_sources
from k3export.ops.spec import LIBRARY_SPECS


def _own(binding: str) -> str:
    return "\n".join(p.read_text() for p in binding_sources(CSRC / binding) if p.parent.name != "kernels")


ORT, OV = _own("ort_k3.cpp"), _own("ov_k3.cpp")
STRUCTS = {"".join(w.capitalize() for w in op.split("_")): op for op in LIBRARY_SPECS}


def _ops(source: str, registered: str) -> set[str]:
    """The table's ops of the classes `source` registers (`registered`: the pattern of a registration)."""
    attrs = dict(re.findall(r"(?:struct|class) (\w+)\b[^{;]*\{\s*(?:public:\s*)?using Attrs = k3::attrs::(\w+);",
                            source))
    attrs.update(re.findall(r"struct (\w+) : Kernel<k3::attrs::(\w+)>", source))  # ORT's (ort_k3/common.hpp)
    return {STRUCTS[attrs[cls]] for cls in re.findall(registered, source)}


def test_the_generated_header_declares_every_attribute_of_every_op():
    header = attributes_header()
    for op, spec in LIBRARY_SPECS.items():
        struct = re.search(r"struct %s \{(.*?)\n\};" % next(k for k, v in STRUCTS.items() if v == op), header, re.S)
        assert struct, op
        assert f'name = "{op}";' in struct.group(1)
        for name, _ in spec.attributes:
            assert f'v("{name}", {name}, true);' in struct.group(1), (op, name)
        for name, _ in spec.library_attributes:
            assert f'v("{name}", {name}, false);' in struct.group(1), (op, name)


def test_ort_library_registers_the_table():
    assert _ops(ORT, r"op<(\w+)>\(\)") == set(LIBRARY_SPECS)


def test_openvino_extension_converts_spec_ops():
    # the 4-bit experts are a moe_experts / moe_route_experts node whose weights are FLOAT4E2M1 (no op of their own)
    assert _ops(OV, r"onnx_node<(\w+)>\(\)") == set(LIBRARY_SPECS) - {"moe_experts_mxfp4", "moe_experts_nvfp4",
                                                                     "moe_route_experts_mxfp4"}
    assert _ops(OV, r"OpExtension<(\w+)>") == _ops(OV, r"onnx_node<(\w+)>\(\)")


def test_no_binding_spells_an_attribute_or_an_op_by_hand():
    names = {n for spec in LIBRARY_SPECS.values() for n, _ in (*spec.attributes, *spec.library_attributes)}
    for source in (ORT, OV):
        assert not re.findall(r'(?:GetAttribute|get_attribute|on_attribute)\s*(?:<[^>]*>)?\s*\(\s*"', source)
        assert not re.findall(r'(?:OPENVINO_OP|CreateLiteCustomOp<\w+>)\s*\(\s*"', source)
        assert not {n for n in names if f'"{n}"' in source}, "an attribute name written by hand"
