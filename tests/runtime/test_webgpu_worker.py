"""The ort-webgpu worker's pipe protocol and its reading of ONNX Runtime's profile: no GPU, no second environment."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest

from k3export.runtime.webgpu_runner import Placement
from k3export.runtime.webgpu_worker import placement, read_message, write_message


def test_arrays_come_through_the_pipe_as_they_went_in():
    arrays = [np.arange(6, dtype=np.int64).reshape(2, 3), np.array(7, np.int64), np.ones((1, 0, 4), np.float32),
              np.array([[True, False]]), np.linspace(-1, 1, 5, dtype=np.float16),
              np.arange(12, dtype=np.float32).reshape(3, 4).T]  # not contiguous
    pipe = io.BytesIO()
    write_message(pipe, {"op": "run", "arrays": ["a", "b", "c", "d", "e", "f"]}, arrays)
    write_message(pipe, {"op": "open"})
    pipe.seek(0)
    header, got = read_message(pipe)
    assert header == {"op": "run", "arrays": ["a", "b", "c", "d", "e", "f"]}
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert read_message(pipe) == ({"op": "open"}, [])
    assert read_message(pipe) is None  # the end of the pipe


def test_an_object_array_or_a_short_pipe_is_refused():
    body = json.dumps({"layout": [["|O", [1]]]}).encode()
    with pytest.raises(ValueError, match="dtype"):
        read_message(io.BytesIO(struct.pack("<I", len(body)) + body + b"\0" * 8))
    pipe = io.BytesIO()
    write_message(pipe, {"op": "run"}, [np.zeros(4, np.float32)])
    with pytest.raises(EOFError, match="short"):
        read_message(io.BytesIO(pipe.getvalue()[:-3]))


def test_placement_counts_each_node_once_per_provider_and_the_copies_apart(tmp_path):
    def node(name: str, op: str, provider: str) -> dict:
        return {"cat": "Node", "name": f"{name}_kernel_time", "args": {"op_name": op, "provider": provider}}

    gpu, cpu = "WebGpuExecutionProvider", "CPUExecutionProvider"
    events = [node("mm", "MatMul", gpu), node("body/mul", "Mul", gpu), node("body/mul", "Mul", gpu),  # a Loop body
              node("shape", "Shape", cpu), node("loop", "Loop", cpu), node("copy_in", "MemcpyFromHost", gpu),
              node("copy_out", "MemcpyToHost", gpu), {"cat": "Session", "name": "model_run"},
              {"cat": "Node", "name": "mm_fence_before", "args": {"op_name": "MatMul", "provider": gpu}}]
    (tmp_path / "p.json").write_text(json.dumps(events))
    got = placement(str(tmp_path / "p.json"))
    assert got == {"copies": 2, "providers": {gpu: {"MatMul": 1, "Mul": 1}, cpu: {"Loop": 1, "Shape": 1}}}
    p = Placement(got["providers"], got["copies"])
    assert (p.nodes(gpu), p.total, p.webgpu_share) == (2, 4, 0.5)
    assert p.summary() == "WebGPU EP ran 2 of 4 nodes (50%), CPU EP 2 (Loop 1, Shape 1, ...), 2 host/device copies"
