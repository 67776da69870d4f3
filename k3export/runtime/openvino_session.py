"""The OpenVINO session of an export (the loader beside `openvino_runner`, as `ort_session` is beside `ort_runner`).

`OpenVinoSession` compiles a graph file for OpenVINO's CPU plugin, with dynamic shapes, at fp32 inference
precision (the plugin's default on CPUs with bf16 arithmetic rounds fp32 matrix products to bf16, where the export
keeps fp32; a bf16 export rounds where its own Casts say), with no KV-cache compression and no dynamic quantization
of activations (`OPENVINO_CPU_CONFIG`), and puts it behind the session interface of `session.SessionRunner`.

Stateful form (``carried``): OpenVINO's ``MakeStateful`` pass turns each state input ``past_key_values.{i}.{kind}``
and its output ``present.{i}.{kind}`` into one variable of the compiled model (ReadValue / Assign), as OpenVINO
GenAI runs its LLMs: a call then feeds ``input_ids`` / ``attention_mask`` only and fetches the logits, and the state
stays in the infer request. `load_state` sets the variables from a given state (nothing when it is the request's
own, `CarriedState`); after each `run`, `carried_state` is the state the variables hold, read on access.

Nothing here imports torch: bench/peers.py times it as it runs.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from k3export.errors import K3ExportError
from k3export.modeling.contract import INPUT_IDS, INPUTS_EMBEDS

from . import ort_ops, pages
from .base import RuntimeUnavailable, to_numpy
from .images import with_weights
from .pages import release_mapped_pages

_log = logging.getLogger(__name__)

#: CPU plugin properties: every product at the precision the graph declares. OpenVINO 2026's CPU plugin otherwise
#: keeps a KV cache in u8 and quantizes activations per group of 32 before a matrix product, both lossy; a property
#: the installed plugin does not know is left out (`cpu_config`)
OPENVINO_CPU_CONFIG: dict[str, str] = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                       "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


def cpu_config(core: Any, device: str = "CPU") -> dict[str, str]:
    """`OPENVINO_CPU_CONFIG` less the properties `device` does not list as supported (an older plugin)."""
    supported = core.get_property(device, "SUPPORTED_PROPERTIES")
    return {k: v for k, v in OPENVINO_CPU_CONFIG.items() if k in supported}


def openvino_status() -> str | None:
    """None when OpenVINO is importable, else why not."""
    try:
        import openvino  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken native library
        return f"openvino is not importable ({type(exc).__name__}: {exc}); pip install openvino"
    return None


def _data_files(proto: Any, model_path: str | os.PathLike[str]) -> set[str]:
    """The resolved paths of the external data files `proto`'s initializers name, beside `model_path`."""
    folder = os.path.dirname(os.path.abspath(model_path))
    return {os.path.realpath(os.path.join(folder, e.value)) for t in proto.graph.initializer for e in t.external_data
            if e.key == "location"}


def _initializer_inputs(model: Any) -> set[str]:
    """The graph inputs of an ONNX graph that an initializer of the same name backs (ONNX's overridable
    initializers)."""
    return {i.name for i in model.graph.input} & {t.name for t in model.graph.initializer}


def _optional_inputs(ov: Any, model: Any, names: set[str]) -> dict[str, np.ndarray]:
    """Turn each of `names` back into an input of `model` (OpenVINO's ONNX frontend folds an initializer-backed
    input into a constant, so ``logits_to_keep`` could not be fed); returns {name: its default value}."""
    from openvino import opset13

    defaults: dict[str, np.ndarray] = {}
    params = []
    for node in model.get_ops():
        hit = names & node.get_output_tensor(0).get_names() if node.get_type_name() == "Constant" else set()
        if not hit:
            continue
        name = hit.pop()
        out = node.output(0)
        param = opset13.parameter(out.get_partial_shape(), out.get_element_type(), name=name)
        param.output(0).get_tensor().set_names({name})
        defaults[name] = np.array(node.get_data(), copy=True)
        out.replace(param.output(0))
        params.append(param)
    if params:
        model.add_parameters(params)
        model.validate_nodes_and_infer_types()
    return defaults


def make_stateful(graph: Any, pairs: dict[str, str]) -> dict[str, str] | str:
    """Apply OpenVINO's MakeStateful pass to `graph` in place: each input of `pairs` ({input name: output name})
    and its output become one variable. Returns {input name: variable id}, or why the pass could not run (the
    graph is then unchanged or the caller drops it)."""
    try:
        from openvino.passes import MakeStateful, Manager
    except ImportError as exc:  # an OpenVINO without the public pass
        return f"openvino.passes.MakeStateful is not importable ({exc})"
    try:
        manager = Manager()
        manager.register_pass(MakeStateful(dict(pairs)))
        manager.run_passes(graph)
    except Exception as exc:  # noqa: BLE001 - the pass reports a graph it cannot rewrite as a generic error
        return f"MakeStateful failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    # each ReadValue keeps the tensor name of the input it replaced: the variable of that state
    ids = {}
    for node in graph.get_ops():
        if node.get_type_name() == "ReadValue":
            for name in node.output(0).get_names() & pairs.keys():
                ids[name] = node.get_variable_id()
    if set(ids) != set(pairs):
        return f"MakeStateful left no variable for {sorted(set(pairs) - set(ids))[:2]}"
    return ids


class CarriedState(Mapping[str, np.ndarray]):
    """The state a stateful `OpenVinoSession` holds in its variables after one call, by state name: a value is read
    (copied out) on first access and kept. Before the session changes its variables (the next call, or a state set
    from elsewhere), it copies whatever was not read yet into this object (`_detach`): a state handed out is never
    changed by a later call. Values are read-only arrays (the variables are the truth while this state is live)."""

    def __init__(self, session: OpenVinoSession) -> None:
        self._session: OpenVinoSession | None = session  # None once detached: every value is then in `_values`
        self._values: dict[str, np.ndarray] = {}

    @property
    def live(self) -> bool:
        """Whether the session's variables still hold this state (it can be fed back with nothing copied)."""
        return self._session is not None

    def __getitem__(self, name: str) -> np.ndarray:
        value = self._values.get(name)
        if value is None:
            if self._session is None or name not in self._session.carried:
                raise KeyError(name)
            value = self._values[name] = self._session.read_variable(name)
            value.flags.writeable = False
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._session.carried if self._session is not None else self._values)

    def __len__(self) -> int:
        return len(self._session.carried if self._session is not None else self._values)

    def _detach(self) -> None:
        for name in list(self):
            self[name]
        self._session = None

    def __repr__(self) -> str:
        return f"CarriedState({'live' if self.live else 'copied'}, {list(self)})"


def read_beside(core: Any, proto: Any, model_path: str | os.PathLike[str]) -> Any:
    """`proto` (an edited form of `model_path`'s graph, weights not loaded) read by `core`. OpenVINO resolves
    external data only inside the folder of the file it reads (links resolved), so `proto` is written to a private
    temporary folder holding hard links to the folder's files (the export folder is only read: it may be
    read-only), removed once read (OpenVINO has mapped the data by then). Where the temporary folder is on another
    file system (no hard link across), it is written beside `model_path` under a hidden temporary name instead,
    removed once read; OSError when neither takes a file."""
    folder = os.path.dirname(os.path.abspath(model_path))
    try:
        with tempfile.TemporaryDirectory(prefix="k3export-ov-") as tmp:
            for entry in os.scandir(folder):
                if entry.is_file(follow_symlinks=False):
                    os.link(entry.path, os.path.join(tmp, entry.name))
            return _read_written(core, proto, tmp)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
    return _read_written(core, proto, folder)


def _read_written(core: Any, proto: Any, folder: str) -> Any:
    fd, tmp = tempfile.mkstemp(prefix=".k3export-", suffix=".onnx", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(proto.SerializeToString())
        return core.read_model(tmp)
    finally:
        os.unlink(tmp)


def read_inlined(core: Any, proto: Any, model_path: str | os.PathLike[str]) -> Any:
    """`proto` (`model_path`'s graph, weights not loaded) with its model-local functions inlined (``onnx.inliner``),
    read by `core` (`read_beside`)."""
    import onnx.inliner

    try:
        return read_beside(core, onnx.inliner.inline_local_functions(proto), model_path)
    except OSError as exc:
        raise K3ExportError(f"openvino: cannot write the inlined graph of {model_path} to a temporary folder "
                            f"or beside it ({exc.strerror}); "
                            "export with --form inlined for OpenVINO") from None


@contextlib.contextmanager
def _releasing(files: set[str], every: float = 0.02) -> Iterator[None]:
    """`release_mapped_pages(files)` every `every` seconds while the block runs (OpenVINO's compile, which releases
    the GIL): the plugin reads every weight once while compiling (a scan of each fp32 constant for subnormals, then
    the projections' repacking), so without this the whole file is resident at once, the build's peak."""
    if not files:
        yield
        return
    done = threading.Event()

    def run() -> None:
        while not done.wait(every):
            release_mapped_pages(files)

    thread = threading.Thread(target=run, name="k3export-release-pages", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class _Request:
    """An infer request of a compiled model, its ports by name and its variables by state name."""

    def __init__(self, compiled: Any, inputs: list[str], outputs: list[str], variables: dict[str, str]) -> None:
        self.request = compiled.create_infer_request()
        # the one-token model may have compiled an input away: one token leaves ``logits_to_keep`` nothing to choose
        names = {n for port in compiled.inputs for n in port.get_names()}
        self.inputs = {n: compiled.input(n) for n in inputs if n in names}
        self.outputs = {n: compiled.output(n) for n in outputs}
        by_id = {v.name: v for v in self.request.query_state()} if variables else {}
        self.variables = {name: by_id[vid] for name, vid in variables.items()}


def for_one_token(graph: Any) -> Any:
    """`graph` (an ``openvino.Model``) reshaped for one token at batch 1: ``input_ids`` [1, 1] (``inputs_embeds``
    [1, 1, hidden]) and every other input's leading batch dimension 1; the cache length stays dynamic."""
    shapes = {}
    for port in graph.inputs:
        dims = list(port.get_partial_shape())
        if port.get_any_name() in (INPUT_IDS, INPUTS_EMBEDS):
            shapes[port] = [1, 1, *dims[2:]]
        elif dims and dims[0].is_dynamic:
            shapes[port] = [1, *dims[1:]]
    graph.reshape(shapes)
    return graph


def _one_token_call(feeds: Mapping[str, Any]) -> bool:
    tokens = feeds.get(INPUT_IDS, feeds.get(INPUTS_EMBEDS))
    return tokens is not None and tuple(np.shape(tokens))[:2] == (1, 1)


class OpenVinoSession:
    """A compiled OpenVINO model behind the session interface: feeds cast to the graph's input types (bfloat16 as
    its bytes), outputs as numpy (bfloat16 via ml_dtypes); an input an initializer backs (``logits_to_keep``) is
    optional, as in ONNX Runtime. `model`: compile this graph (`model_path`'s, edited in memory and loaded without
    its external data, which is read from beside `model_path`) instead of the file's own.

    `carried` ({state input: its output}): keep those states in the compiled model's variables (module docstring);
    they are then neither in `input_names` nor in `output_names` but in `carried`. When the pass cannot run, one
    warning is logged and the session is stateless (`carried` empty, `stateless_reason` says why).

    `extensions`: OpenVINO extension libraries added to the core before the graph is read (`ov_ext.library`: the
    k3 operations and their ONNX conversions); `edit`: called on the ``openvino.Model`` read, before anything else
    (`ov_ext.general_branches`); `inline_functions`: read the graph with its model-local functions inlined into
    the standard ops of their bodies (`read_inlined`), a functions-form export without the extension. With the
    extension the file is read as it is: its k3 nodes, the fused ops the exporter wrote included, become the
    extension's operations (an export without fused ops runs unfused: `ort_ops.note_unfused` says so once).
    `properties`: more properties to compile with, over `OPENVINO_CPU_CONFIG` and `threads` (``PERF_COUNT``: the
    request's per-operation times, `bench/ort_nodes.py --openvino`).

    `decode_graph`: compile the graph a second time with batch and tokens fixed to 1 (`for_one_token`; the cache length
    stays dynamic), which a call of one token at batch 1 runs: OpenVINO's CPU plugin runs a statically shaped
    operation without the per-call shape work of a dynamic one (docs/speed.md has the figures). The second compiled
    model holds its own repacked copy of the dense projections. A stateful session moves the state between the two
    requests' variables when a call goes to the other one (after a prefill, before a multi-token call). `graph`:
    `model_path`'s graph (weights not loaded) where the caller has parsed it already (`ExportFolder.graph`)."""

    def __init__(self, model_path: str | os.PathLike[str], device: str = "CPU", threads: int | None = None, *,
                 model: Any = None, carried: dict[str, str] | None = None,
                 extensions: tuple[str | os.PathLike[str], ...] = (),
                 edit: Callable[[Any], Any] | None = None, inline_functions: bool = False,
                 properties: dict[str, Any] | None = None, decode_graph: bool = False, graph: Any = None) -> None:
        why = openvino_status()
        if why is not None:
            raise RuntimeUnavailable(why)
        import openvino as ov

        self._ov = ov
        core = ov.Core()
        for lib in extensions:  # before read_model: a library's frontend conversions apply while reading
            core.add_extension(str(lib))
        config: dict[str, Any] = cpu_config(core, device) if device.startswith("CPU") else {}
        if threads:
            config["INFERENCE_NUM_THREADS"] = int(threads)
        if properties:
            supported = core.get_property(device, "SUPPORTED_PROPERTIES")
            unknown = sorted(set(properties) - set(supported))
            if unknown:
                raise K3ExportError(f"openvino {ov.__version__} device {device} has no property {unknown[0]!r} "
                                    f"(asked for in properties; it lists {len(supported)} it supports)")
            config.update(properties)
        import onnx

        if model is None:
            proto = graph if graph is not None else onnx.load(str(model_path), load_external_data=False)
            if extensions:
                ort_ops.note_unfused(proto, model_path)
            graph = read_inlined(core, proto, model_path) if inline_functions else core.read_model(str(model_path))
        else:  # read from memory with its weights inlined: OpenVINO resolves external data only beside a file
            proto = with_weights(model, model_path)
            graph = core.read_model(io.BytesIO(proto.SerializeToString()))
        if edit is not None:
            edit(graph)
        one = for_one_token(graph.clone()) if decode_graph else None
        one_variables: dict[str, str] = {}
        # the graph's own names, read before compiling: compilation folds a pass-through (an fp32 -> fp32 Cast of
        # a state) into its neighbour, and the merged tensor then answers to an internal name as well
        self.input_names = [i.get_any_name() for i in graph.inputs]
        self.output_names = [o.get_any_name() for o in graph.outputs]
        self._defaults = _optional_inputs(ov, graph, _initializer_inputs(proto))
        #: inputs with a default (``logits_to_keep``), fed their default when a call leaves them out
        self.optional_inputs = list(self._defaults)
        #: the states kept in variables, {state input: output} ({}: every state is fed and fetched)
        self.carried: dict[str, str] = {}
        #: why a session asked for `carried` states runs stateless (None: it does not)
        self.stateless_reason: str | None = None
        variables: dict[str, str] = {}
        if carried:
            types = {i.get_any_name(): i.get_element_type() for i in graph.inputs}
            found = make_stateful(graph, carried)
            if one is not None and not isinstance(found, str):
                one_found = make_stateful(one, carried)
                if isinstance(one_found, str):  # the general model took the pass: so must its one-token copy
                    raise K3ExportError(f"openvino: the one-token graph is not stateful ({one_found})")
                one_variables = one_found
            if isinstance(found, str):
                self.stateless_reason = found
                _log.warning("openvino: %s; running the stateless form (every state fed and fetched each call)", found)
            else:
                self.carried, variables = dict(carried), found
                carried_out = set(carried.values())
                self.input_names = [n for n in self.input_names if n not in carried]
                self.output_names = [n for n in self.output_names if n not in carried_out]
        files = _data_files(proto, model_path) if model is None else set()
        with _releasing(files):
            self.compiled = core.compile_model(graph, device, config)
            one_compiled = core.compile_model(one, device, config) if one is not None else None
        del graph, one  # the read model's constants map the files; what the compiled model reads faults back
        #: bytes of the export's mapped weight files whose resident pages were dropped after compiling
        self.released = release_mapped_pages(files)
        #: bytes of resident memory (the repacked projections) collapsed into 2 MiB pages (`pages.huge_pages`)
        self.huge_pages = pages.session_loaded()
        self.version = ov.__version__
        self._general = _Request(self.compiled, self.input_names + self.optional_inputs, self.output_names, variables)
        #: the general model's infer request (every call but the one-token model's)
        self.request = self._general.request
        #: the one-token model's request, ports and variables (`decode_graph`), None without one
        self.one_token: _Request | None = None
        if one_compiled is not None:
            self.one_token = _Request(one_compiled, self.input_names + self.optional_inputs, self.output_names,
                                      one_variables)
        self._holder = self._general  # the request whose variables hold the state
        self._types = {n: p.get_element_type() for n, p in self._general.inputs.items()}
        if self.carried:
            self._types.update({name: types[name] for name in self.carried})
        #: the state the variables hold, when it was handed out by `carried_state` (None: nobody holds it)
        self._live: CarriedState | None = None
        self._loaded = False  # whether the variables hold a state set by `load_state` or computed by `run`

    def _tensor(self, name: str, value: Any) -> Any:
        ov = self._ov
        want = self._types[name]
        if want == ov.Type.bf16:
            import ml_dtypes

            bits = np.require(to_numpy(value, np.float32).astype(ml_dtypes.bfloat16), requirements="C").view(np.uint16)
            tensor = ov.Tensor(ov.Type.bf16, ov.Shape(list(bits.shape)))
            tensor.data.view(np.uint16)[...] = bits
            return tensor
        arr = to_numpy(value, np.float32) if hasattr(value, "detach") else np.asarray(value)
        # np.require keeps a scalar 0-d (np.ascontiguousarray makes it [1]: logits_to_keep)
        return ov.Tensor(np.require(arr.astype(want.to_dtype(), copy=False), requirements="C"))

    def _array(self, tensor: Any) -> np.ndarray:
        """A copy of an OpenVINO tensor (the request reuses its buffers next call), bfloat16 via ml_dtypes."""
        if tensor.element_type == self._ov.Type.bf16:
            import ml_dtypes

            return np.array(tensor.data, copy=True).view(np.uint16).view(ml_dtypes.bfloat16)
        return np.array(tensor.data, copy=True)

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One inference on `feeds` (every input of `input_names`; optional ones default); the outputs of
        `output_names`, copied. A stateful session runs from the state its variables hold (`load_state` first)."""
        if self.carried:
            if not self._loaded:
                raise K3ExportError("a stateful OpenVINO session runs from a state: call load_state first")
            self._move_on()
        feeds = {**self._defaults, **feeds}
        req = self.one_token if self.one_token is not None and _one_token_call(feeds) else self._general
        if req is not self._holder:
            for name, variable in req.variables.items():  # copied: each request keeps variables of its own
                variable.state = self._holder.variables[name].state
            self._holder = req
        req.request.infer({req.inputs[name]: self._tensor(name, value) for name, value in feeds.items()
                           if req is self._general or name in req.inputs})
        return {name: self._array(req.request.get_tensor(port)) for name, port in req.outputs.items()}

    def _move_on(self) -> None:
        """The variables are about to change: the state handed out for them keeps its values (copied now)."""
        if self._live is not None:
            self._live._detach()
            self._live = None

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Set the variables to `state` (every name of `carried`); nothing is copied when `state` is the one they
        hold (this session's live `carried_state`)."""
        if state is self._live and self._live is not None:
            return
        missing = [n for n in self.carried if n not in state]
        if missing:
            raise K3ExportError(f"state {missing[0]!r} missing from the fed state")
        self._move_on()
        self._holder = self._general  # takes every batch; a one-token call moves the state over
        for name, variable in self._holder.variables.items():
            variable.state = self._tensor(name, state[name])
        self._loaded = True

    def carried_state(self) -> CarriedState:
        """The state the variables hold now (after a `run`), read on access; see `CarriedState`."""
        if self._live is None:
            self._live = CarriedState(self)
        return self._live

    def read_variable(self, name: str) -> np.ndarray:
        """A copy of the value variable `name` holds (a state name of `carried`)."""
        return self._array(self._holder.variables[name].state)


__all__ = ["OPENVINO_CPU_CONFIG", "CarriedState", "OpenVinoSession", "cpu_config", "make_stateful", "openvino_status"]
