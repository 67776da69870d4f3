"""The ONNX Runtime process of runtime ``ort-webgpu`` (`webgpu_runner`): run with the Python of a second environment
that has ``onnxruntime-webgpu`` (it installs the same ``onnxruntime`` module as the main environment's build), as a
script: it imports numpy and onnxruntime only, nothing of k3export.

It answers requests on stdin with replies on stdout, each one message: a 4-byte little-endian length, that many
bytes of JSON (``layout``: each array's dtype and shape; no object dtype), then each array's bytes::

    {"op": "open", "path": ..., "providers": [...], "options": {...}}  -> the session's I/O, providers, adapter
    {"op": "run", "arrays": [input names]} + arrays                      -> {"arrays": [output names]} + arrays
                                                                           (the first also: "placement")

A failure answers ``{"error": message, "kind": "no_adapter" | "load" | "run"}`` and the worker goes on (a failed
open leaves it without a session). ONNX Runtime's and Dawn's own messages go to stderr.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import sys
import tempfile
from collections import Counter
from typing import Any, BinaryIO

import numpy as np

WEBGPU = "WebGpuExecutionProvider"
#: SessionOptions config key: keep which EP took each node (onnxruntime >= 1.24)
ASSIGNMENT_KEY = "session.record_ep_graph_assignment_info"
#: what Vulkan calls its device types, by VkPhysicalDeviceType; and the order Dawn prefers them in
DEVICE_TYPES = {0: "other", 1: "integrated GPU", 2: "discrete GPU", 3: "virtual GPU", 4: "CPU"}
PREFERENCE = (2, 1, 3, 0, 4)
#: PCI (and Khronos) vendor ids
VENDORS = {0x1002: "AMD", 0x10DE: "NVIDIA", 0x8086: "Intel", 0x13B5: "ARM", 0x5143: "Qualcomm", 0x106B: "Apple",
           0x10005: "Mesa"}


def _read(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError(f"the pipe ended {n - len(data)} bytes short")
    return data


def read_message(stream: BinaryIO) -> tuple[dict[str, Any], list[np.ndarray]] | None:
    """One message from `stream` (None at its end): the JSON header and the arrays it describes."""
    size = stream.read(4)
    if not size:
        return None
    if len(size) < 4:
        size += _read(stream, 4 - len(size))
    header = json.loads(_read(stream, struct.unpack("<I", size)[0]))
    arrays = []
    for dt, shape in header.pop("layout", ()):
        dtype = np.dtype(dt)
        if dtype.hasobject:
            raise ValueError(f"an array of dtype {dt} cannot come through the pipe")
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(_read(stream, count * dtype.itemsize), dtype).reshape(shape).copy())
    return header, arrays


def write_message(stream: BinaryIO, header: dict[str, Any], arrays: Any = ()) -> None:
    """`header` as JSON (with each array's dtype and shape), then each array's bytes."""
    arrays = [np.require(a, requirements="C") for a in arrays]  # ascontiguousarray would make a 0-d array 1-d
    body = json.dumps({**header, "layout": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
    stream.write(struct.pack("<I", len(body)) + body)
    for arr in arrays:
        stream.write(arr.tobytes())
    stream.flush()


def vulkan_adapter() -> dict[str, str] | None:
    """The Vulkan device Dawn runs the WebGPU EP on, as the Vulkan loader describes it (the first of Dawn's order: a
    discrete GPU, an integrated one, ..., a CPU device such as Mesa's lavapipe last): vendor, device, driver and
    backend; None when there is no Vulkan loader or device."""
    try:
        vk = ctypes.CDLL("libvulkan.so.1")
    except OSError:
        return None

    class AppInfo(ctypes.Structure):
        _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("pApplicationName", ctypes.c_char_p),
                    ("applicationVersion", ctypes.c_uint32), ("pEngineName", ctypes.c_char_p),
                    ("engineVersion", ctypes.c_uint32), ("apiVersion", ctypes.c_uint32)]

    class CreateInfo(ctypes.Structure):
        _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                    ("pApplicationInfo", ctypes.POINTER(AppInfo)), ("enabledLayerCount", ctypes.c_uint32),
                    ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                    ("ppEnabledExtensionNames", ctypes.c_void_p)]

    app = AppInfo(0, None, b"k3export", 1, b"k3export", 1, (1 << 22) | (2 << 12))  # Vulkan 1.2: driver properties
    info = CreateInfo(1, None, 0, ctypes.pointer(app), 0, None, 0, None)
    instance = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != 0:
        return None
    try:
        count = ctypes.c_uint32()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        devices = (ctypes.c_void_p * count.value)()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), devices)
        found = []
        for dev in devices[:count.value]:
            # VkPhysicalDeviceProperties2 (sType 1000059001) -> VkPhysicalDeviceDriverProperties (1000196000),
            # read at the offsets of their fixed layout: both are larger than what is read here
            props, driver = ctypes.create_string_buffer(1024), ctypes.create_string_buffer(1024)
            struct.pack_into("<i", props, 0, 1000059001)
            struct.pack_into("<Q", props, 8, ctypes.addressof(driver))
            struct.pack_into("<i", driver, 0, 1000196000)
            vk.vkGetPhysicalDeviceProperties2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            vk.vkGetPhysicalDeviceProperties2(ctypes.c_void_p(dev), props)
            vendor, device_type = struct.unpack_from("<I", props, 24)[0], struct.unpack_from("<I", props, 32)[0]
            found.append({
                "vendor": VENDORS.get(vendor, f"0x{vendor:x}"),
                "device": props.raw[36:36 + 256].split(b"\0")[0].decode(errors="replace"),
                "type": DEVICE_TYPES.get(device_type, str(device_type)),
                "driver": " ".join(driver.raw[o:o + 256].split(b"\0")[0].decode(errors="replace")
                                   for o in (20, 276)).strip(),
                "backend": "Vulkan",
                "_rank": PREFERENCE.index(device_type) if device_type in PREFERENCE else len(PREFERENCE),
            })
    finally:
        vk.vkDestroyInstance.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        vk.vkDestroyInstance(instance, None)
    if not found:
        return None
    best = min(found, key=lambda d: d["_rank"])
    return {k: v for k, v in best.items() if not k.startswith("_")}


def placement(profile: str) -> dict[str, Any]:
    """From ONNX Runtime's profile of one call: the nodes each execution provider ran (by their names, so a node
    inside a Loop body counts once), by op type; the copies between host and device apart (``Memcpy*``)."""
    with open(profile) as f:
        events = json.load(f)
    nodes: dict[str, dict[str, str]] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            args = e.get("args", {})
            nodes.setdefault(args.get("provider", "?"), {})[e["name"][:-len("_kernel_time")]] = args.get("op_name", "?")
    out: dict[str, Any] = {"copies": 0, "providers": {}}
    for ep, named in nodes.items():
        ops = Counter(op for op in named.values() if not op.startswith("Memcpy"))
        out["copies"] += sum(op.startswith("Memcpy") for op in named.values())
        out["providers"][ep] = dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))
    return out


class Worker:
    def __init__(self) -> None:
        self.session: Any = None
        self.profiling: str | None = None  # the folder of the first call's profile, until it is read

    def open(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            return {"error": f"{sys.executable} cannot import onnxruntime ({exc}): install onnxruntime-webgpu there",
                    "kind": "load"}
        providers = req["providers"]
        missing = [p for p in providers if p not in ort.get_available_providers()]
        if missing:
            return {"error": f"onnxruntime {ort.__version__} in {sys.executable} lacks {missing} (available: "
                             f"{ort.get_available_providers()}): install onnxruntime-webgpu there", "kind": "load"}
        adapter = vulkan_adapter() if WEBGPU in providers else None
        if WEBGPU in providers and adapter is None:
            return {"error": "no Vulkan device", "kind": "no_adapter"}
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        for key, value in req.get("options", {}).items():
            setattr(opts, key, value)
        opts.add_session_config_entry(ASSIGNMENT_KEY, "1")
        self.profiling = tempfile.mkdtemp(prefix="k3export-webgpu-profile-")
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(self.profiling, "call")
        try:
            self.session = ort.InferenceSession(req["path"], opts, providers=providers)
        except Exception as exc:  # ORT's own exception types, from its C++ core
            return {"error": " ".join(str(exc).split()), "kind": "load"}
        got = self.session.get_providers()
        if WEBGPU in providers and WEBGPU not in got:  # ORT's Python falls back to the CPU EP when the EP fails
            return {"error": "the WebGPU EP found no adapter", "kind": "no_adapter"}

        def io(args: Any) -> list[list[str]]:
            return [[a.name, a.type] for a in args]

        return {"version": ort.__version__, "providers": got, "adapter": adapter,
                "inputs": io(self.session.get_inputs()), "optional": io(self.session.get_overridable_initializers()),
                "outputs": io(self.session.get_outputs())}

    def run(self, req: dict[str, Any], arrays: list[np.ndarray]) -> tuple[dict[str, Any], list[np.ndarray]]:
        if self.session is None:
            return {"error": "no session is open", "kind": "run"}, []
        names = [o.name for o in self.session.get_outputs()]
        try:
            outs = self.session.run(names, dict(zip(req["arrays"], arrays)))
        except Exception as exc:
            return {"error": " ".join(str(exc).split()), "kind": "run"}, []
        reply: dict[str, Any] = {"arrays": names}
        if self.profiling is not None:  # the first call's placement; profiling ends with it
            reply["placement"] = placement(self.session.end_profiling())
            shutil.rmtree(self.profiling, ignore_errors=True)
            self.profiling = None
        return reply, outs

    def close(self) -> None:
        if self.profiling is not None:
            shutil.rmtree(self.profiling, ignore_errors=True)


def main() -> None:
    # the protocol gets stdout's pipe to itself: whatever else writes to fd 1 (a native library) goes to stderr
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    worker = Worker()
    try:
        while (msg := read_message(requests)) is not None:
            req, arrays = msg
            if req["op"] == "open":
                write_message(out, worker.open(req))
            elif req["op"] == "run":
                write_message(out, *worker.run(req, arrays))
            else:
                write_message(out, {"error": f"unknown request {req['op']!r}", "kind": "run"})
    finally:
        worker.close()


if __name__ == "__main__":
    main()
