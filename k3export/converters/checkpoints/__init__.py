"""Checkpoint readers and converters: released Kimi K3 (MXFP4 experts), NVIDIA's NVFP4 K3 and Kimi-Linear layouts
-> ours.

* `load_pretrained` - `K3ForCausalLM` straight from a released / Kimi-Linear / converted folder;
* `convert` - streaming, resumable, parallel conversion into our sharded safetensors layout;
* `make_plan` / `scan_checkpoint` - what a conversion would do, validated from headers alone;
* `decode_mxfp4` - MXFP4 (E2M1 + E8M0) decoding, bit-identical to compressed-tensors;
* `nvfp4` - NVIDIA's NVFP4 experts and FP8 block weights (decoding, checks) and the bit-exact MXFP4 -> NVFP4 cast
  (``convert --experts nvfp4``);
* `synthetic.write_checkpoint` - synthetic checkpoints in the released / NVIDIA NVFP4 / Kimi-Linear layouts.
"""

from __future__ import annotations

from .convert import MANIFEST_NAME, ConversionInterrupted, convert
from .layouts import LAYOUTS, expected_tensors
from .loader import load_pretrained
from .mxfp4 import decode_mxfp4, pack_mxfp4
from .plan import Plan, make_plan, plan_to_json, scan_checkpoint
from .safetensors_io import SafetensorsFile, open_checkpoint, write_safetensors

__all__ = [
    "LAYOUTS", "MANIFEST_NAME", "ConversionInterrupted", "Plan", "SafetensorsFile", "convert", "decode_mxfp4",
    "expected_tensors", "load_pretrained", "make_plan", "open_checkpoint", "pack_mxfp4", "plan_to_json",
    "scan_checkpoint", "write_safetensors",
]
