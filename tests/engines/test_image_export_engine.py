"""TensorRT-RTX and an image + text export: ``build`` makes a real engine of its decoder (on ``inputs_embeds``,
profiled like ``input_ids``), and the builder's refusal of ``vision.onnx`` that keeps the image graphs on ONNX
Runtime (`runtime.trt_runner`) is checked for real, so a TensorRT that builds it shows here. Running needs an
RTX-class GPU."""

from __future__ import annotations

import json

import pytest
from trt_builds import LIMITS, TARGET, export_fp32, in_child  # tests/engines is on sys.path

from k3export.converters.onnx.vision import VISION_FILE
from k3export.modeling import tiny_vision_model
from k3export.modeling.contract import INPUTS_EMBEDS


@pytest.fixture(scope="module")
def vl_export(tmp_path_factory):
    return export_fp32(tiny_vision_model(seed=4), tmp_path_factory, "trt_vl")


def test_the_decoder_of_an_image_export_builds_on_inputs_embeds(engine_of, vl_export):
    engine = engine_of(vl_export)
    sidecar = json.loads(engine.with_name(engine.name + ".json").read_text())
    for profile in sidecar["profiles"]:
        lo, _, hi = profile["shapes"][INPUTS_EMBEDS]
        assert lo[-1] == hi[-1] == 64 and hi[1] == (1 if profile["name"] == "decode" else LIMITS["max_seq"])
    assert engine.stat().st_size > 1 << 20


def test_tensorrt_rtx_does_not_build_the_vision_graph(rtx, vl_export):
    child = in_child(VISION_BUILD, vl_export / VISION_FILE, TARGET)
    said = [line for line in child.stdout.splitlines() if line.startswith("k3:")]  # TensorRT logs to stdout too
    assert said == ["k3: parsed", "k3: not built"] or child.returncode < 0 and said == ["k3: parsed"], \
        child.stdout + child.stderr


#: TensorRT-RTX's parser and builder on VISION_FILE for TARGET, in a child (`in_child`: a crash, a signal, is also
#: "not built"): prints "k3: parsed", then "k3: not built" when the builder returns no engine
VISION_BUILD = """
import sys
from k3export.plugins.flavour import load_flavour, parse_cc
rtx = load_flavour("tensorrt_rtx")
trt = rtx.trt
logger = trt.Logger(trt.Logger.ERROR)
builder = trt.Builder(logger)
network = builder.create_network(0)
parser = trt.OnnxParser(network, logger)
if not parser.parse_from_file(sys.argv[1]):
    sys.exit("not parsed")
print("\\nk3: parsed", flush=True)
config = builder.create_builder_config()
profile = builder.create_optimization_profile()
profile.set_shape("pixel_values", (4, 48), (64, 48), (256, 48))
profile.set_shape("image_grid_thw", (1, 3), (2, 3), (4, 3))
config.add_optimization_profile(profile)
config.num_compute_capabilities = 1
config.set_compute_capability(rtx.target_enum(parse_cc(sys.argv[2])), 0)
config.builder_optimization_level = 0
built = builder.build_serialized_network(network, config) is not None
print("\\nk3: built" if built else "\\nk3: not built")
"""
