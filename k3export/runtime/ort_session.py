"""The ONNX Runtime session of an export (the loader beside `ort_runner`, as Polygraphy keeps its loaders).

`ort_session` builds the ``onnxruntime.InferenceSession`` of a graph file: a graph with 4-bit experts runs them in
one of ONNX Runtime's views of them (`k3export.artifacts.expert_views`: the k3 library's on their own bytes, or the
lossless 8-bit form the export wrote a function for, its bytes converted into a temporary file that ORT
memory-maps and that is unlinked once the session holds it), any other graph is opened as it is. `OrtSession` puts
that session behind the session interface of `session.SessionRunner`.
Nothing here imports torch: running an export costs no model.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
import time
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from k3export.dtypes import dtype as as_dtype

from . import ort_ops, pages
from .base import RuntimeUnavailable, to_numpy

#: SessionOptions config key: the folder relative to which an in-memory model's external data is resolved
FOLDER_KEY = "session.model_external_initializers_file_folder_path"
_CACHE_PREFIX = "k3export-mxfp4-"  # a session's temporary folder for the 8-bit form, locked while it is built
_CACHE_LOCK = ".lock"


def _remove_stale_caches(root: Path) -> None:
    """Remove the 8-bit files that sessions killed while building them left in `root` (their lock is free; a
    folder still without its lock is being created). At K3's size each is terabytes."""
    for folder in root.glob(_CACHE_PREFIX + "*"):
        try:
            fd = os.open(folder / _CACHE_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live build
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)


def ort_session(model_path: str | os.PathLike[str], sess_options: Any = None, providers: list[str] | None = None,
                *, model: Any = None, cache_dir: str | os.PathLike[str] | None = None, k3_ops: bool = False,
                graph: Any = None) -> Any:
    """An ``onnxruntime.InferenceSession`` of an export; 4-bit experts run in the 8-bit form
    (`expert_views.q8_view`).

    `model`: the graph to run instead of `model_path`'s own (e.g. `lowp.emulate_low_precision` of it), external
    data still relative to `model_path`'s folder. `cache_dir`: where the temporary 8-bit file is written (default
    the system temporary folder); it is deleted before this returns (ORT keeps it mapped), and what a process killed
    while building left there is removed first. `sess_options` gets the external-data folder entry added. A graph
    without MXFP4 experts, and nothing for the library to fuse, is opened as it is, by path (ORT resolves its
    external data next to it): so is an export's persisted 8-bit form (``model.genai.onnx``,
    `mxfp4.write_ort_form`), which `OrtRunner` hands here when the export folder holds it, instead of converting
    the experts of model.onnx (at K3's size a ~3.1 TB temporary file per session).
    `k3_ops`: the k3 custom-op library is registered on `sess_options` (`ort_ops.register`): ORT runs its kernels in
    place of the k3 functions of the same name, the fused ops the export wrote included (an export without them
    runs unfused, `ort_ops.note_unfused` says so once); its kernels read the 4-bit experts' own bytes
    (`expert_views.packed_view`: retyped, not converted), so no 8-bit form is written. `graph`: `model_path`'s own
    graph (weights not loaded) where the caller has parsed it already."""
    import onnxruntime as ort

    from k3export.artifacts.expert_views import packed_view
    from k3export.artifacts.graph_forms import has_mxfp4

    path = Path(model_path)
    so = sess_options if sess_options is not None else ort.SessionOptions()
    providers = providers or ["CPUExecutionProvider"]
    proto = model if model is not None else graph if graph is not None else _graph(path)
    mxfp4 = has_mxfp4(proto)  # FP4 experts: MXFP4 or NVFP4
    if k3_ops:
        ort_ops.note_unfused(proto, path)
        if mxfp4:  # the library's form: MXFP4 / NVFP4 experts on their own bytes (mapped)
            so.add_session_config_entry(FOLDER_KEY, str(path.parent.resolve()))
            return _from_bytes(packed_view(proto), so, providers, path)
    if not mxfp4:
        if model is None:
            return ort.InferenceSession(str(path), so, providers=providers)
        so.add_session_config_entry(FOLDER_KEY, str(path.parent.resolve()))
        return _from_bytes(proto, so, providers, path)
    _remove_stale_caches(Path(cache_dir or tempfile.gettempdir()))
    tmp = Path(tempfile.mkdtemp(prefix=_CACHE_PREFIX, dir=cache_dir))
    lock = os.open(tmp / _CACHE_LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rewritten, root = _q8_model(proto, path, tmp)
        so.add_session_config_entry(FOLDER_KEY, str(root))
        return _from_bytes(rewritten, so, providers, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)


def _q8_model(model: Any, path: Path, tmp: Path) -> tuple[Any, Path]:
    """`model` in the 8-bit view (`expert_views.q8_view`), its converted experts in one file of `tmp`, each at a
    4 KiB-aligned offset (the pages ORT maps); an export without that view's function is one line naming it."""
    from k3export.artifacts import ArtifactError
    from k3export.artifacts.expert_views import has_q8_form, q8_tensors, q8_view, write_q8_tensor

    if not has_q8_form(model):
        raise ArtifactError(f"{path}: plain ONNX Runtime cannot run its 4-bit routed experts: the file has no 8-bit "
                            "form of them (the k3::moe_experts overload 'q8' this k3export writes); re-export it, or "
                            "run it with the k3 library (kernels=True)")
    location, places, offset = "experts.q8", [], 0
    with open(tmp / location, "wb") as fh:
        for item in q8_tensors(model):
            offset = -(-offset // 4096) * 4096
            fh.seek(offset)
            places.append((location, offset))
            write_q8_tensor(fh, path.parent, item)
            offset += item.nbytes
    return q8_view(model, path.parent, tmp, places)


def _from_bytes(model: Any, so: Any, providers: list[str], path: Path) -> Any:
    """A session of `model` (a rewritten form of the file at `path`): ORT's load errors name no file when the graph
    comes as bytes, so they name `path` here, in ORT's own exception type."""
    import onnxruntime as ort

    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    except Exception as exc:
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        raise type(exc)(f"{path}: {exc}") from None


def _graph(model_path: str | os.PathLike[str]) -> Any:
    """`model_path`'s graph without its weights."""
    import onnx

    return onnx.load(str(model_path), load_external_data=False)


#: SessionOptions config key: whether ORT's intra-op threads spin while waiting for work
SPIN_KEY = "session.intra_op.allow_spinning"


#: how long `outside_cores` watches the machine; and how long its answer is reused (sessions come in bursts)
OUTSIDE_WINDOW_S, OUTSIDE_REUSE_S = 0.1, 10.0
#: other processes' cores that still leave room for spinning (a background process or two on a quiet machine)
OUTSIDE_SLACK = 0.5
_outside: tuple[float, float | None] | None = None  # (when measured, cores)


def outside_cores() -> float | None:
    """Cores that other processes kept busy over the last `OUTSIDE_WINDOW_S` seconds: the busy time of /proc/stat
    less this process's own CPU time (every thread of it); None where /proc/stat cannot be read. Not the load
    average: that counts this process's own recent work (a prefill, a warm-up), so on a quiet 2-core machine a
    2-thread session would never spin, and a decode step there takes 1.19x as long without spinning."""
    global _outside
    now = time.monotonic()
    if _outside is not None and now - _outside[0] < OUTSIDE_REUSE_S:
        return _outside[1]

    def busy() -> int:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait

    try:
        hz = os.sysconf("SC_CLK_TCK")
        b0, own0, t0 = busy(), os.times(), time.monotonic()
        time.sleep(OUTSIDE_WINDOW_S)
        b1, own1, t1 = busy(), os.times(), time.monotonic()
    except (OSError, ValueError):
        cores = None
    else:
        own = own1.user + own1.system - own0.user - own0.system
        cores = max(0.0, ((b1 - b0) / hz - own) / (t1 - t0))
    _outside = (now, cores)
    return cores


def spinning_pays(threads: int) -> bool:
    """Whether ORT's intra-op threads should spin between nodes: only while the machine has a core for each of
    them besides what other processes use (`outside_cores`, with `OUTSIDE_SLACK`). Spinning makes a decode step
    1.19x as fast on an idle machine; on a busy one the spinning threads take the cores the working ones need,
    and a step with it took 3.6x as long (`bench/ort_options.py`, docs/speed.md)."""
    outside = outside_cores()
    if outside is None:  # nothing to go by: ORT's default
        return True
    return outside + threads <= (os.cpu_count() or 1) + OUTSIDE_SLACK


#: the numpy dtypes ORT's IO binding takes as they are (no bfloat16: ml_dtypes' has no ORT element type there)
_ORT_NUMPY = frozenset(np.dtype(t) for t in (np.float32, np.float16, np.float64, np.int64, np.int32, np.int8,
                                               np.uint8, np.bool_))


class OutputBuffers:
    """The numpy buffers ONNX Runtime writes a session's outputs into, by output name. A buffer is handed out again
    only when nothing outside the pool references it any more (its reference count says so; a view keeps its base
    referenced): so in a decode loop a constant-size state alternates between two buffers, ``present`` of step t
    being step t + 1's ``past`` as it lies, while a state the caller keeps (a saved or rolled-back state) is never
    written over."""

    #: buffers kept per output: the state being fed and the one of the step before it
    KEEP = 2

    def __init__(self) -> None:
        self._pool: dict[str, list[np.ndarray]] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A C-contiguous buffer of `shape` and `dtype` for output `name`, reused when one is free."""
        pool = self._pool.setdefault(name, [])
        shape, dtype = tuple(shape), np.dtype(dtype)
        for i in range(len(pool)):
            # 2 references: the pool's list and getrefcount's own argument
            if pool[i].shape == shape and pool[i].dtype == dtype and sys.getrefcount(pool[i]) == 2:
                return pool[i]
        buf = np.empty(shape, dtype)
        # a growing state's older buffers never fit again; past KEEP the oldest leaves (whoever holds it keeps it)
        pool[:] = [buf] + [b for b in pool if b.shape == buf.shape and b.dtype == dtype][:self.KEEP - 1]
        return buf


class OrtSession:
    """An ``onnxruntime.InferenceSession`` behind the session interface: feeds cast to the graph's input dtypes
    (bfloat16 via ml_dtypes), outputs as numpy; `options` set on its ``SessionOptions`` (an export's
    ``runtime_config.json`` recommends them); `model`: run this graph instead of `model_path`'s own (`ort_session`).
    A graph with MXFP4 experts runs them in ORT's lossless 8-bit form, rewritten when the session is built; a graph
    already in that form (an export's persisted ``model.genai.onnx``) is opened as the file it is. `k3_ops`: register
    the k3 custom-op library (`ort_ops`: the k3 nodes run as native kernels, not their function bodies) when it can
    be built here (default: `ort_ops.enabled`, on the CPU provider alone); `k3_ops` afterwards says whether it
    was. `graph`: `model_path`'s own graph (weights not loaded) where the caller has parsed it already."""

    def __init__(self, model_path: str | os.PathLike[str], providers: list[str] | None = None,
                 threads: int | None = None, options: dict[str, Any] | None = None, *, model: Any = None,
                 k3_ops: bool | None = None, graph: Any = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:  # pragma: no cover
            raise RuntimeUnavailable(f"onnxruntime is not importable: {exc}") from exc
        available = ort.get_available_providers()
        providers = providers or ["CPUExecutionProvider"]
        missing = [p for p in providers if p not in available]
        if missing:
            raise RuntimeUnavailable(f"onnxruntime lacks {missing} (available: {available})")
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        for key, value in (options or {}).items():  # what the export recommends (`RuntimeConfig.session_options`)
            if not hasattr(opts, key):
                raise RuntimeUnavailable(f"onnxruntime {ort.__version__} SessionOptions has no {key!r} (asked for by "
                                         "the export's runtime_config.json session_options)")
            setattr(opts, key, value)
        if threads:
            opts.intra_op_num_threads = threads
        #: whether ORT's worker threads spin between nodes (`spinning_pays`)
        self.spinning = spinning_pays(threads or opts.intra_op_num_threads or os.cpu_count() or 1)
        if not self.spinning:
            opts.add_session_config_entry(SPIN_KEY, "0")
        #: whether the k3 custom-op library is registered on this session (`ort_ops`: fp32 graphs; MXFP4 experts
        #: then run from their 4-bit bytes)
        graph = model if model is not None else graph if graph is not None else _graph(model_path)
        self.k3_ops = ort_ops.used(graph, providers, k3_ops) and ort_ops.register(opts)
        # MXFP4 experts: the 8-bit form; others as they are. `model`: `model_path`'s graph edited in memory
        self.session = ort_session(model_path, opts, providers, model=model, k3_ops=self.k3_ops, graph=graph)
        #: bytes of resident memory (ORT's prepacked products) collapsed into 2 MiB pages (`pages.huge_pages`)
        self.huge_pages = pages.session_loaded("CPUExecutionProvider" in providers)
        self.providers = self.session.get_providers()
        self._types = {i.name: as_dtype(i.type).numpy for i in self.session.get_inputs()}
        self.input_names = list(self._types)
        optional = self.session.get_overridable_initializers()  # inputs with a default (``logits_to_keep``)
        self.optional_inputs = [i.name for i in optional]
        self._types.update({i.name: as_dtype(i.type).numpy for i in optional})
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._out_types = {o.name: np.dtype(as_dtype(o.type).numpy) for o in self.session.get_outputs()}
        self._bindable = all(t in _ORT_NUMPY for t in self._out_types.values())
        #: the output buffers `run_bound` writes into
        self.buffers = OutputBuffers()
        self._bindings: list[_Binding | None] = [None, None]  # `_binding`
        self._calls = 0

    def _cast(self, feeds: dict[str, Any]) -> dict[str, np.ndarray]:
        cast = {}
        for name, value in feeds.items():
            dt = self._types[name]
            if type(value) is np.ndarray and value.dtype == dt and value.flags.c_contiguous:
                cast[name] = value  # as it lies: a decode step's states are the session's own outputs
                continue
            arr = to_numpy(value, np.float32) if hasattr(value, "detach") else np.asarray(value)
            cast[name] = np.require(arr.astype(dt, copy=False), requirements="C")  # keeps a scalar 0-d
        return cast

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        return dict(zip(self.output_names, self.session.run(self.output_names, self._cast(feeds))))

    def _binding(self) -> _Binding:
        """The IO binding of this call. Two bindings alternate: in a decode loop each finds its state buffers bound
        as they were two calls back (the same buffers), and rebinds only the names whose buffer moved (the ids, the
        mask, a growing state)."""
        i = self._calls % 2
        self._calls += 1
        b = self._bindings[i]
        if b is None:
            b = self._bindings[i] = _Binding(self.session.io_binding())
        return b

    def run_bound(self, feeds: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """`run` through ONNX Runtime's IO binding: every feed bound where it lies (a state this session returned
        last step is read in place), each output named in `shapes` written straight into a buffer of that shape
        (`OutputBuffers`: a constant-size state reuses the buffer of two steps back once nothing else holds it),
        any other output allocated by ORT. Outputs of a dtype numpy has no ORT name for (bfloat16) go through
        `run`."""
        cast = self._cast(feeds)
        if not self._bindable or any(a.dtype not in _ORT_NUMPY for a in cast.values()):
            return self.run(feeds)
        b = self._binding()
        if b.inputs - cast.keys():  # an optional input fed before (``logits_to_keep``), not now: unbound
            b.clear_inputs()
        for name, arr in cast.items():
            b.bind_input(name, arr)
        out: dict[str, np.ndarray] = {}
        for name in self.output_names:
            shape = shapes.get(name)
            if shape is None:
                b.bind_output(name, None)
            else:
                buf = out[name] = self.buffers.take(name, shape, self._out_types[name])
                b.bind_output(name, buf)
        self.session.run_with_iobinding(b.io)
        if len(out) == len(self.output_names):
            return out  # filled in the outputs' order
        got = dict(zip(self.output_names, b.io.get_outputs()))
        return {n: out[n] if n in out else got[n].numpy() for n in self.output_names}


class _Binding:
    """An ``onnxruntime.IOBinding`` and the host arrays bound to it, by name: binding a name to the array it is
    already bound to (the same living array, same shape and dtype) does nothing. The binds go to ORT's own binding
    object with one CPU device object: the Python wrapper builds a device at every bind (~4 us, and ~10 names are
    rebound a decode step); where the wrapper has no such object, through its public methods."""

    def __init__(self, io: Any) -> None:
        self.io = io
        #: name -> (weak reference to the bound array, its shape, its dtype); None: an output ORT allocates
        self._keys: dict[str, tuple[Any, tuple[int, ...], np.dtype] | None] = {}
        #: the names bound as inputs
        self.inputs: set[str] = set()
        try:
            import onnxruntime as ort

            self._raw, self._cpu = io._iobinding, ort.OrtDevice.make("cpu", 0)._get_c_device()
        except AttributeError:  # pragma: no cover - another onnxruntime's wrapper
            self._raw = None

    def _bind(self, output: bool, name: str, arr: np.ndarray) -> bool:
        """Bind input or output `name` to `arr` unless it is bound to it already; whether it bound."""
        # an identity check, not the data pointer: reading ``ctypes.data`` costs ~1 us, and a step binds ~35 names
        key = self._keys.get(name)
        if key is not None and key[0]() is arr and key[1] == arr.shape and key[2] == arr.dtype:
            return False
        if self._raw is not None:
            bind = self._raw.bind_output if output else self._raw.bind_input
            bind(name, self._cpu, arr.dtype, arr.shape, arr.ctypes.data)
        else:  # pragma: no cover
            bind = self.io.bind_output if output else self.io.bind_input
            bind(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        # weakly: a strong reference would keep `OutputBuffers` from ever reusing a fed state's buffer
        self._keys[name] = (weakref.ref(arr), arr.shape, arr.dtype)
        return True

    def bind_input(self, name: str, arr: np.ndarray) -> None:
        if self._bind(False, name, arr):
            self.inputs.add(name)

    def bind_output(self, name: str, arr: np.ndarray | None) -> None:
        """Output `name` written into `arr`, or (None) into memory ORT allocates."""
        if arr is not None:
            self._bind(True, name, arr)
            return
        self.io.bind_output(name, "cpu")
        self._keys[name] = None

    def clear_inputs(self) -> None:
        self.io.clear_binding_inputs()
        for name in self.inputs:
            del self._keys[name]
        self.inputs.clear()


#: ONNX Runtime's providers for a CUDA device (CPU kept for the ops CUDA lacks)
CUDA_PROVIDERS = ["CUDAExecutionProvider", "CPUExecutionProvider"]


def ort_graph_opener(providers: list[str] | None = None, threads: int | None = None,
                     options: dict[str, Any] | None = None, kernels: bool | None = None) -> Any:
    """An `images.GraphOpener` of `OrtSession`s with these providers, threads, session options and `kernels` (the
    k3 library on or off; None: the environment's default), for an image + text export's image graphs."""
    return partial(OrtSession, providers=providers, threads=threads, options=options, k3_ops=kernels)


__all__ = ["CUDA_PROVIDERS", "FOLDER_KEY", "SPIN_KEY", "OrtSession", "OutputBuffers", "ort_graph_opener", "ort_session",
           "spinning_pays"]
