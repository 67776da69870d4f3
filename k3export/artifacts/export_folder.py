"""An ONNX export folder, checked as a whole before any runtime sees a file of it (`load_export`).

    model.onnx               the graph; its weights live in external-data files
    model.onnx.data.NNNNN    external data (absent in a graph-only export, ``weights_materialized: false``)
    state_manifest.json      `StateManifest`: every input, output and carried state
    runtime_config.json      `RuntimeConfig`: model file, data files, the K3Config
    model.genai.onnx         optional (``export --genai`` of MXFP4 / NVFP4 experts): the graph ONNX Runtime runs, the
    model.genai.experts.q8.NNNNN   experts in their 8-bit form in these shards (`mxfp4.write_ort_form`)
    vision.onnx, embedding.onnx    an image + text export's image graphs (``runtime_config.json`` ``graphs``), each
    + their .data.NNNNN            with its own data shards; the decoder then takes ``inputs_embeds``

`load_export` reads both JSON files strictly, reads the graph without its weights
(``onnx.load(..., load_external_data=False)``) and checks its inputs and outputs against the manifest (names,
ranks, dtypes, static dims), that every node of the
``k3`` domain is a k3 op some runtime of ours implements (`k3export.ops.spec.ALL_SPECS`), and every external-data
reference of every tensor: the location lies inside the folder (links resolved), is listed in ``data_files``,
exists, and ``offset + length`` lies within the file. The ORT form, when there, is checked the same way (its
8-bit expert shards allowed besides ``data_files``) and as model.onnx's rewrite: the same nodes, and every
initializer but the experts' the same reference into the same data file. Each image graph is checked the same way
against its own ``data_files`` and its I/O in the manifest's ``graphs``. The config the runtime config carries
is built and the manifest checked against its contract on first use of `ExportFolder.config`: a `K3Config` is a
transformers config, whose import loads torch (~500 MiB resident), and an ONNX Runtime or OpenVINO run of the
export reads the manifest and the graph only. Every refusal is one `ArtifactError` line naming the file and the
field.
"""

from __future__ import annotations


import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterator

from k3export.dtypes import DTypeError, dtype as as_dtype
from k3export.modeling.contract import ATTENTION_MASK

from k3export.files import file_sha256, is_shard
from k3export.safety import check_finished, confined_file

from .codec import ArtifactError, fail
from .manifest import StateManifest
from .runtime_config import RuntimeConfig

MODEL_FILE = "model.onnx"
#: the graph ONNX Runtime (and onnxruntime-genai) runs for MXFP4 / NVFP4 experts, persisted by ``export --genai``: the
#: experts' lossless 8-bit form in shards ``{GENAI_DATA_PREFIX}NNNNN`` (cut like the data shards: at K3's size the
#: form is ~3.1 TB), everything else read from the export's own data files
GENAI_MODEL_FILE = "model.genai.onnx"
GENAI_DATA_PREFIX = "model.genai.experts.q8."


_EXTERNAL_KEYS = ("location", "offset", "length", "checksum")


IDENTITY_FULL_BYTES = 256 << 20
IDENTITY_BLOCKS = 256


def _identity_digest(path: Path) -> str:
    """`ExportFolder.identity`'s digest of one file: whole when small, else its size and sampled blocks."""
    size = path.stat().st_size
    if size <= IDENTITY_FULL_BYTES:
        return file_sha256(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        for i in range(IDENTITY_BLOCKS):
            fh.seek(i * (size - 4096) // (IDENTITY_BLOCKS - 1))
            h.update(fh.read(4096))
    return h.hexdigest()


def is_genai_data(name: str) -> bool:
    """Whether `name` is a shard of the ORT form's 8-bit experts."""
    return is_shard(name, GENAI_DATA_PREFIX)


@dataclass
class ExportFolder:
    """A checked export folder: its two documents, the config they were made from (`config`, checked on first
    use), the model path, and the path of the persisted ORT form when the folder holds one (ONNX Runtime opens it
    instead of rewriting model.onnx)."""

    root: Path
    runtime: RuntimeConfig
    manifest: StateManifest
    model_path: Path
    ort_form_path: Path | None = None
    ort_form_data: tuple[str, ...] = ()  # the 8-bit expert shards the ORT form reads
    graph_paths: dict[str, Path] = field(default_factory=dict)  # role -> checked image graph file
    #: model.onnx's graph as it was checked (weights not loaded): a runtime opening the export reads it from here
    graph: Any = field(default=None, repr=False, compare=False)

    @property
    def config(self) -> Any:
        """The `K3Config` of the runtime config, the manifest checked against its contract on first use."""
        return self._configs()[0]

    @property
    def vision_config(self) -> Any:
        """The `K3VisionConfig` of an image + text export, else None (checked as `config`)."""
        return self._configs()[1]

    def _configs(self) -> tuple[Any, Any]:
        if "_checked" not in self.__dict__:
            rc_path, man_path = self.root / RuntimeConfig.FILE, self.root / StateManifest.FILE
            config = self.runtime.k3_config(rc_path)
            vision_config = self.runtime.k3_vision_config(rc_path)
            pid = self.runtime.media_placeholder_token_id
            if pid is not None and not pid < config.vocab_size:
                raise fail(rc_path, "media_placeholder_token_id", f"{pid} is not a token id of the config's "
                                                                   f"vocabulary ({config.vocab_size})")
            self.manifest.check_config(config, man_path, vision_config)
            self.__dict__["_checked"] = config, vision_config
        return self.__dict__["_checked"]

    @property
    def has_vision(self) -> bool:
        """Whether the export holds the image graphs (its decoder then takes ``inputs_embeds``)."""
        return bool(self.graph_paths)

    @property
    def dtype(self) -> str:
        return self.manifest.dtype

    @property
    def supports_padding(self) -> bool:
        return ATTENTION_MASK in self.manifest.input_names

    @property
    def data_paths(self) -> list[Path]:
        return [self.root / name for name in self.runtime.data_files]

    @property
    def file_names(self) -> list[str]:
        """Every file of the export, relative: model, data shards, manifest, runtime config, the ORT form and its
        8-bit experts (what `load_export` checked)."""
        names = [self.runtime.model_file, *self.runtime.data_files, self.manifest.FILE, self.runtime.FILE]
        if self.ort_form_path is not None:
            names += [GENAI_MODEL_FILE, *self.ort_form_data]
        for g in self.runtime.graphs:
            names += [g.model_file, *g.data_files]
        return names

    def file_digests(self) -> dict[str, str]:
        """sha256 of every file of the export (`file_names`), by relative name: what validation.json records and
        what a push checks against it."""
        return {name: file_sha256(self.root / name) for name in self.file_names}

    def identity(self) -> str:
        """sha256 naming this export (what a saved state records it belongs to, `saved_state.State`): every file
        of it (`file_names`) by name, each hashed whole up to `IDENTITY_FULL_BYTES` and, past that (a data shard
        of a large export), by its size and `IDENTITY_BLOCKS` evenly spaced 4 KiB blocks: another model differs
        in every block, and hashing terabytes of weights per saved state would cost more than the state."""
        cached = self.__dict__.get("_identity")
        if cached is None:
            h = hashlib.sha256()
            for name in self.file_names:
                h.update(name.encode() + b"\0" + _identity_digest(self.root / name).encode())
            cached = self.__dict__["_identity"] = h.hexdigest()
        return cached

    def require_weights(self) -> None:
        """`ArtifactError` for a graph-only export (its weights were declared but never written)."""
        if not self.runtime.weights_materialized:
            raise fail(self.root / RuntimeConfig.FILE, "weights_materialized",
                       "false: a graph-only export (--no-weights) cannot run; export with weights")

    @classmethod
    def load(cls, folder: str | os.PathLike[str], *, finishing: bool = False) -> ExportFolder:
        """Read and check the export in `folder` (`k3export.converters.onnx.load_export` also takes a Hub id).
        A folder k3export marked partial is refused, except with `finishing`: the writer's own last check."""
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise ArtifactError(f"{root}: not an export folder")
        if not finishing:
            check_finished(root)
        rc_path, man_path = root / RuntimeConfig.FILE, root / StateManifest.FILE
        for p in (rc_path, man_path):
            if not os.path.lexists(p):
                raise ArtifactError(f"{root} is not a k3export ONNX export: {p.name} is missing")
        runtime = RuntimeConfig.read(root)
        manifest = StateManifest.read(root)
        model_path = root / runtime.model_file
        model = _load_graph(model_path)
        check_graph(model, manifest, model_path, man_path)
        check_k3_ops(model, model_path)
        referenced = check_external_data(model, root, runtime.data_files, model_path, rc_path,
                                         runtime.weights_materialized)
        unused = sorted(set(runtime.data_files) - referenced)
        if unused:
            raise fail(rc_path, "data_files", f"lists {unused[0]!r}, which {model_path.name} never references")
        _check_opset(model, runtime.opset, model_path, rc_path)
        ort_form, ort_data = _check_ort_form(root, runtime, manifest, model, model_path, rc_path, man_path)
        graphs = {g.role: _check_image_graph(root, runtime, manifest, g, rc_path, man_path) for g in runtime.graphs}
        return cls(root, runtime, manifest, model_path, ort_form, ort_data, graphs, model)


load_export = ExportFolder.load


def _load_graph(path: Path) -> Any:
    import onnx

    if path.is_file() and path.stat().st_size == 0:  # protobuf reads no bytes as an empty model: a far-off error
        raise fail(path, "", "is empty (0 bytes): not an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except MemoryError:
        raise fail(path, "", "is too large to read") from None
    except Exception as exc:  # noqa: BLE001 - protobuf DecodeError, OSError, ...: one line either way
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise fail(path, "", f"is not a readable ONNX model ({type(exc).__name__}{': ' + first if first else ''})") \
            from None
    if not model.HasField("graph"):
        raise fail(path, "", "is not an ONNX model (it holds no graph)")
    return model


def _elem_name(elem: int) -> str | None:
    try:
        return as_dtype(int(elem)).name
    except DTypeError:
        return None


def _check_image_graph(root: Path, runtime: RuntimeConfig, manifest: StateManifest, files: Any, rc_file: Path,
                       man_file: Path) -> Path:
    """The path of one image graph (`runtime_config.GraphFiles`), checked like the decoder: readable, its I/O the
    manifest's entry of its role, its external data inside the folder, in its own ``data_files``, within them."""
    path = root / files.model_file
    model = _load_graph(path)
    spec = manifest.graph(files.role)
    io = ({t.name: (t.dtype, t.shape) for t in spec.inputs}, {t.name: (t.dtype, t.shape) for t in spec.outputs})
    check_io(model, io, path, man_file)
    referenced = check_external_data(model, root, files.data_files, path, rc_file, runtime.weights_materialized)
    unused = sorted(set(files.data_files) - referenced)
    if unused:
        raise fail(rc_file, "graphs", f"lists {unused[0]!r} for {files.model_file}, which never references it")
    _check_opset(model, runtime.opset, path, rc_file)
    return path


def check_graph(model: Any, manifest: StateManifest, model_file: Any, manifest_file: Any) -> None:
    """The graph's inputs and outputs are exactly the manifest's (names, ranks, dtypes, static dims)."""
    check_io(model, manifest.graph_io(), model_file, manifest_file)


def check_io(model: Any, io: tuple[dict[str, Any], dict[str, Any]], model_file: Any, manifest_file: Any) -> None:
    """The graph's inputs and outputs are exactly `io` ({name: (dtype, shape)} of the inputs, of the outputs)."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    want_in, want_out = io
    for side, declared, want in (("input", [v for v in graph.input if v.name not in inits], want_in),
                                 ("output", list(graph.output), want_out)):
        have = {v.name: v for v in declared}
        for name in want:
            if name not in have:
                raise fail(model_file, f"{side} {name}", f"missing: {Path(str(manifest_file)).name} declares it")
        for name, vi in have.items():
            if name not in want:
                raise fail(model_file, f"{side} {name}", f"is not declared in {Path(str(manifest_file)).name}")
            dt, shape = want[name]
            if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
                raise fail(model_file, f"{side} {name}", "is not a tensor of known rank")
            tt = vi.type.tensor_type
            got = _elem_name(tt.elem_type)
            if got != dt:
                raise fail(model_file, f"{side} {name}", f"has dtype {got or tt.elem_type}, the manifest says {dt}")
            dims = tt.shape.dim
            if len(dims) != len(shape):
                raise fail(model_file, f"{side} {name}", f"has rank {len(dims)}, the manifest says {len(shape)} "
                                                         f"{list(shape)}")
            for axis, (d, m) in enumerate(zip(dims, shape)):
                if d.HasField("dim_value") and isinstance(m, int) and d.dim_value != m:
                    raise fail(model_file, f"{side} {name}", f"axis {axis} is {d.dim_value}, the manifest says {m}")


def _nodes(model: Any) -> Iterator[Any]:
    """Every node of the model: the graph's, its subgraphs' (If / Loop / Scan bodies) and its functions'."""
    def graph_nodes(nodes: Any) -> Iterator[Any]:
        for node in nodes:
            yield node
            for a in node.attribute:
                if a.HasField("g"):
                    yield from graph_nodes(a.g.node)
                for g in a.graphs:
                    yield from graph_nodes(g.node)

    yield from graph_nodes(model.graph.node)
    for f in model.functions:
        yield from graph_nodes(f.node)


def check_k3_ops(model: Any, model_file: Any) -> None:
    """Every node of the ``k3`` domain names a k3 op (`k3export.ops.spec.LIBRARY_SPECS`: the ops our runtimes, ONNX
    functions and TensorRT plugins implement, and the fused ops); another is refused here, naming it, not by a
    runtime later."""
    from k3export.ops.spec import LIBRARY_SPECS, NAMESPACE

    for node in _nodes(model):
        if node.domain == NAMESPACE and node.op_type not in LIBRARY_SPECS:
            raise fail(model_file, f"node {node.name or node.op_type}",
                       f"is {NAMESPACE} op {node.op_type!r}, which no k3export runtime implements (the {NAMESPACE} "
                       f"ops: {', '.join(LIBRARY_SPECS)})")


def _tensors(model: Any) -> Iterator[Any]:
    """Every TensorProto of the model: initializers, sparse initializers, node attributes (subgraphs and
    function bodies included)."""

    def graph_tensors(g: Any) -> Iterator[Any]:
        yield from g.initializer
        for sp in g.sparse_initializer:
            yield sp.values
            yield sp.indices
        for node in g.node:
            yield from node_tensors(node)

    def node_tensors(node: Any) -> Iterator[Any]:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            sparse = ([a.sparse_tensor] if a.HasField("sparse_tensor") else []) + list(a.sparse_tensors)
            for sp in sparse:
                yield sp.values
                yield sp.indices
            if a.HasField("g"):
                yield from graph_tensors(a.g)
            for g in a.graphs:
                yield from graph_tensors(g)

    yield from graph_tensors(model.graph)
    for f in model.functions:
        for node in f.node:
            yield from node_tensors(node)


def _nonneg_int(text: str, file: Any, field: str) -> int:
    if not text.isdigit() or len(text) > 20:
        raise fail(file, field, f"{text!r} is not a non-negative integer")
    return int(text)


def _check_opset(model: Any, opset: int, model_file: Path, rc_file: Path) -> None:
    imported = {o.domain: o.version for o in model.opset_import}.get("", None)
    if imported != opset:
        raise fail(rc_file, "opset", f"{opset}, but {model_file.name} imports opset {imported}")


def _check_ort_form(root: Path, runtime: RuntimeConfig, manifest: StateManifest, model: Any, model_file: Path,
                    rc_file: Path, man_file: Path) -> tuple[Path | None, tuple[str, ...]]:
    """The path of `root`'s ORT form (None when it has none) and the 8-bit shards it reads, checked like `model`
    (`model_file`) and as its rewrite, so that a runtime may run it in the model's stead."""
    path = root / GENAI_MODEL_FILE
    if not os.path.lexists(path):
        return None, ()
    if not runtime.weights_materialized:
        raise fail(path, "", "is in a graph-only export (weights_materialized: false), but it is written from the "
                             "weights: remove it or export again")
    ort = _load_graph(path)
    check_graph(ort, manifest, path, man_file)
    check_k3_ops(ort, path)
    shards = [p.name for p in root.iterdir() if is_genai_data(p.name)]
    referenced = check_external_data(ort, root, [*runtime.data_files, *shards], path, rc_file, True)
    _check_opset(ort, runtime.opset, path, rc_file)
    if ort.graph.node != model.graph.node:
        raise fail(path, "graph.node", f"differs from {model_file.name}'s: it is not that graph's ORT form")
    theirs = {t.name: t for t in model.graph.initializer}
    # the quantized experts (MXFP4's or NVFP4's weights and scales): rewritten into the shards
    from .expert_views import q8_tensors

    experts = {item.tensor.name for item in q8_tensors(model)}
    for t in ort.graph.initializer:
        src = theirs.pop(t.name, None)
        if src is None:
            raise fail(path, f"tensor {t.name}", f"is not an initializer of {model_file.name}")
        same = t.dims == src.dims if t.name in experts else t == src
        if not same:
            raise fail(path, f"tensor {t.name}", f"differs from {model_file.name}'s")
    if theirs:
        raise fail(path, f"tensor {next(iter(theirs))}", f"missing: {model_file.name} has it")
    return path, tuple(sorted(r for r in referenced if is_genai_data(r)))


def check_external_data(model: Any, root: Path, allowed: Collection[str], model_file: Any, rc_file: Any,
                        materialized: bool) -> set[str]:
    """Every external-data reference lies inside `root`, is one of the `allowed` files (model.onnx: ``data_files``)
    and, when the weights were written (`materialized`), within its file. Returns the files referenced."""
    import onnx

    sizes: dict[str, int] = {}
    listed = set(allowed)
    referenced: set[str] = set()
    for t in _tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL and not len(t.external_data):
            continue
        field = f"tensor {t.name}"
        kv: dict[str, str] = {}
        for e in t.external_data:
            if e.key not in _EXTERNAL_KEYS:
                raise fail(model_file, field, f"unknown external-data key {e.key!r}")
            kv[e.key] = e.value
        if t.data_location != onnx.TensorProto.EXTERNAL:
            raise fail(model_file, field, "has external-data entries but is not marked EXTERNAL")
        if "location" not in kv:
            raise fail(model_file, f"{field} location", "missing")
        loc = kv["location"]
        real = confined_file(root, loc, error=ArtifactError, file=model_file, field=f"{field} location",
                             must_exist=materialized)
        if loc not in listed:
            raise fail(rc_file, "data_files", f"lacks {loc!r}, which {Path(str(model_file)).name} references")
        referenced.add(loc)
        offset = _nonneg_int(kv.get("offset", "0"), model_file, f"{field} offset")
        if any(d < 0 for d in t.dims):
            raise fail(model_file, f"{field} dims", f"{list(t.dims)} has a negative dim")
        try:
            bits = as_dtype(t.data_type).bits
        except DTypeError:
            raise fail(model_file, field, f"has data type {t.data_type}, which k3export does not read") from None
        nbytes = math.ceil(math.prod(t.dims) * bits / 8)
        if "length" in kv:
            length = _nonneg_int(kv["length"], model_file, f"{field} length")
            if length != nbytes:
                raise fail(model_file, f"{field} length", f"{length}, but the tensor {list(t.dims)} holds {nbytes} "
                                                          "bytes")
        if materialized:
            if loc not in sizes:
                sizes[loc] = real.stat().st_size
            if offset + nbytes > sizes[loc]:
                raise fail(model_file, f"{field} offset", f"bytes [{offset}, {offset + nbytes}) lie past the end of "
                                                          f"{loc} ({sizes[loc]} bytes)")
    return referenced


__all__ = ["ExportFolder", "GENAI_DATA_PREFIX", "GENAI_MODEL_FILE", "MODEL_FILE", "check_external_data", "check_graph",
           "check_io", "check_k3_ops", "is_genai_data", "load_export"]
