"""Bad inputs and faults, generated on the fly: each `Case` damages a fresh copy of a fixture and names the command.

A case's `setup(ctx)` builds what it needs under ``ctx.tmp`` (the source copy is ``ctx.src``, the output
``ctx.out``, files that must never change go to ``ctx.protect``) and returns the command line. `expect` lists what
the one error line must name (a file, tensor or field). Cases whose behaviour belongs to a part of k3export not
built yet carry `needs` (what is missing): they are marked xfail (not strict) while it is. `surface` groups the
cases by what they attack (convert, export, validate, tokenizer files, chat templates, genai_config.json,
pipeline.json, generate's budgets, deploy-plan's stage plans, ...).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from _harness import SECRET, SHARD, Ctx

INDEX = "model.safetensors.index.json"
SHARD1, SHARD2, SHARD3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
EMBED = "language_model.model.embed_tokens.weight"
Q_PROJ = "language_model.model.layers.0.self_attn.o_proj.weight"
NORM = "language_model.model.norm.weight"
EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
SCALE = EXPERT + ".weight_scale"

@dataclass
class Case:
    id: str
    setup: Callable[[Ctx], list]
    expect: tuple[str, ...] = ()
    code: int = 2
    source: str = "released"  # fixture copied to ctx.src: "released", "tiny" or "none"
    fsize: int | None = None  # RLIMIT_FSIZE in bytes (a disk that fills)
    as_extra: int | None = None  # RLIMIT_AS above what the process has mapped (a memory bomb)
    needs: str | None = None
    timeout: float = 120  # seconds; a memory or time bomb must be refused well within it
    surface: str = ""  # what the case attacks (counted by `test_corpus_size`); default: from its id
    skip: Callable[[], str | None] | None = None  # a reason to skip here (this machine cannot show the case)
    mode: str = "fork"  # "exec": a process of its own (`Cli.start`), for commands the pre-imported one cannot run

    def __post_init__(self) -> None:
        if self.as_extra:
            self.timeout = min(self.timeout, 30)
        if not self.surface:
            head = self.id.split("-")[0]
            self.surface = head if head in ("tiny", "export", "validate", "info") else (
                "cli" if self.id == "unknown-command" else "convert")


# ---------------------------------------------------------------------------------------------- editing helpers
def convert(ctx: Ctx, *extra) -> list:
    return ["convert", ctx.src, ctx.out, "--max-shard-size", str(SHARD), "--no-progress", *extra]


def weight_map(src: Path) -> dict[str, str]:
    return json.loads((src / INDEX).read_text())["weight_map"]


def shard_of(src: Path, tensor: str) -> Path:
    return src / weight_map(src)[tensor]


def edit_tensors(src: Path, tensor: str, edit: Callable[[dict], None]) -> Path:
    """Rewrite the shard holding `tensor` with safetensors' own writer after `edit(tensors)`; keep the index."""
    path = shard_of(src, tensor)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = json.loads((src / INDEX).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != path.name or k in tensors}
    index["weight_map"].update({k: path.name for k in tensors})
    (src / INDEX).write_text(json.dumps(index))
    return path


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path: Path, header: dict | bytes, data: bytes) -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def edit_header(src: Path, name: str, edit: Callable[[dict], object]) -> None:
    path = src / name
    header, data = read_header(path)
    result = edit(header)
    write_header(path, result if result is not None else header, data)


def set_config(src: Path, **fields) -> None:
    cfg = json.loads((src / "config.json").read_text())
    target = cfg["text_config"] if "text_config" in cfg else cfg
    for k, v in fields.items():
        if v is DELETE:
            target.pop(k, None)
        else:
            target[k] = v
    (src / "config.json").write_text(json.dumps(cfg))


DELETE = object()


def outside(ctx: Ctx, name: str = "secret.txt", data: bytes | None = None) -> Path:
    """A file outside every folder the command may touch, holding the planted token (a leak would show)."""
    folder = ctx.tmp / "outside"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_bytes(data if data is not None else f"private key material {SECRET}\n".encode())
    ctx.protect(folder)
    ctx.secrets_ok.append(path)
    return path


def link_out(ctx: Ctx, name: str, data: bytes | None = None) -> str:
    """Replace ``src/name`` by a symlink to a copy of it outside the source (a link escaping the folder)."""
    target = outside(ctx, name.replace("/", "_"), data if data is not None else (ctx.src / name).read_bytes())
    (ctx.src / name).unlink()
    os.symlink(target, ctx.src / name)
    return name


def nested_json(depth: int = 100_000) -> bytes:
    return b"[" * depth + b"]" * depth


def marked(folder: Path, kind: str, state: str = "complete") -> Path:
    from k3export.safety import write_marker

    folder.mkdir(parents=True, exist_ok=True)
    write_marker(folder, kind, state)
    (folder / "old-artifact.bin").write_bytes(b"k3export wrote this")
    return folder


def foreign(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names or ("notes.txt",):
        (folder / name).write_bytes(b"the user's own file, not k3export's\n")
    return folder


# ---------------------------------------------------------------------------------------------- convert: bad sources
def _truncate(ctx):
    p = ctx.src / SHARD1
    p.write_bytes(p.read_bytes()[:-100])
    return convert(ctx)


def _header_garbage(ctx):
    p = ctx.src / SHARD1
    raw = bytearray(p.read_bytes())
    raw[8:12] = b"\x00\xff]]"
    p.write_bytes(bytes(raw))
    return convert(ctx)


def _header_len_past_end(ctx):
    p = ctx.src / SHARD1
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    return convert(ctx)


def _header_len_huge(ctx):
    p = ctx.src / SHARD1
    p.write_bytes(struct.pack("<Q", 2**62) + p.read_bytes()[8:])
    return convert(ctx)


def _header_nested(ctx):
    _, data = read_header(ctx.src / SHARD1)
    write_header(ctx.src / SHARD1, nested_json(), data)
    return convert(ctx)


def _header_list(ctx):
    edit_header(ctx.src, SHARD1, lambda h: [1, 2, 3])
    return convert(ctx)


def _offsets_past_end(ctx):
    def edit(h):
        begin = h[EMBED]["data_offsets"][0] + 10**9
        n = h[EMBED]["data_offsets"][1] - h[EMBED]["data_offsets"][0]
        h[EMBED]["data_offsets"] = [begin, begin + n]

    edit_header(ctx.src, SHARD1, edit)
    return convert(ctx)


def _offsets_overlap(ctx):
    def edit(h):
        names = [k for k in h if k != "__metadata__"]
        a, b = sorted(names, key=lambda k: h[k]["data_offsets"][0])[:2]
        n = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + n]

    edit_header(ctx.src, SHARD1, edit)
    return convert(ctx)


def _unknown_dtype(ctx):
    edit_header(ctx.src, SHARD1, lambda h: h[EMBED].__setitem__("dtype", "F128"))
    return convert(ctx)


def _negative_shape(ctx):
    edit_header(ctx.src, SHARD1, lambda h: h[EMBED].__setitem__("shape", [-1, 64]))
    return convert(ctx)


def _shape_bomb(ctx):  # shape claims 2^62 elements: must fail on the header, never allocate
    edit_header(ctx.src, SHARD1, lambda h: h[EMBED].__setitem__("shape", [2**31, 2**31]))
    return convert(ctx)


def _metadata_not_strings(ctx):
    edit_header(ctx.src, SHARD1, lambda h: h.__setitem__("__metadata__", {"format": 7}))
    return convert(ctx)


def _header_huge_int(ctx):
    header, data = read_header(ctx.src / SHARD1)
    blob = json.dumps(header).encode().replace(b'"data_offsets": [0,', b'"data_offsets": [' + b"9" * 5000 + b",", 1)
    write_header(ctx.src / SHARD1, blob, data)
    return convert(ctx)


def _index_no_weight_map(ctx):
    (ctx.src / INDEX).write_text(json.dumps({"metadata": {}}))
    return convert(ctx)


def _index_weight_map_list(ctx):
    (ctx.src / INDEX).write_text(json.dumps({"weight_map": [SHARD1]}))
    return convert(ctx)


def _index_is_list(ctx):
    (ctx.src / INDEX).write_text("[1, 2, 3]")
    return convert(ctx)


def _index_nested(ctx):
    (ctx.src / INDEX).write_bytes(nested_json())
    return convert(ctx)


def _index_not_utf8(ctx):
    (ctx.src / INDEX).write_bytes(b'{"weight_map": {"\xff\xfe": 1}}')
    return convert(ctx)


def _index_missing_shard(ctx):
    (ctx.src / SHARD2).unlink()
    return convert(ctx)


def _index_names(ctx, target: str) -> list:
    index = json.loads((ctx.src / INDEX).read_text())
    index["weight_map"] = {k: (target if v == SHARD1 else v) for k, v in index["weight_map"].items()}
    (ctx.src / INDEX).write_text(json.dumps(index))
    return convert(ctx)


def _index_dotdot(ctx):
    outside(ctx, SHARD1, (ctx.src / SHARD1).read_bytes())
    return _index_names(ctx, f"../outside/{SHARD1}")


def _index_absolute(ctx):
    target = outside(ctx, SHARD1, (ctx.src / SHARD1).read_bytes())
    return _index_names(ctx, str(target))


def _index_nested_dotdot(ctx):
    outside(ctx, SHARD1, (ctx.src / SHARD1).read_bytes())
    (ctx.src / "sub").mkdir()
    return _index_names(ctx, f"sub/../../outside/{SHARD1}")


def _index_subdir_link(ctx):  # a folder inside the source that is a link out of it
    outside(ctx, SHARD1, (ctx.src / SHARD1).read_bytes())
    os.symlink(ctx.tmp / "outside", ctx.src / "weights")
    return _index_names(ctx, f"weights/{SHARD1}")


def _shard_link_out(ctx):
    link_out(ctx, SHARD2)
    return convert(ctx)


def _index_link_out(ctx):
    link_out(ctx, INDEX)
    return convert(ctx)


def _config_link_out(ctx):
    link_out(ctx, "config.json")
    return convert(ctx)


def _tokenizer_link_out(ctx):  # a passthrough file pointing at a private key
    (ctx.src / "tiktoken.model").unlink()
    os.symlink(outside(ctx, "id_ed25519"), ctx.src / "tiktoken.model")
    return convert(ctx)


def _shard_fifo(ctx):
    (ctx.src / SHARD3).unlink()
    os.mkfifo(ctx.src / SHARD3)
    return convert(ctx)


def _shard_dir(ctx):
    (ctx.src / SHARD3).unlink()
    (ctx.src / SHARD3).mkdir()
    return convert(ctx)


def _shard_dangling(ctx):
    (ctx.src / SHARD3).unlink()
    os.symlink(ctx.tmp / "nowhere.safetensors", ctx.src / SHARD3)
    return convert(ctx)


def _shard_dev_zero(ctx):
    (ctx.src / SHARD3).unlink()
    os.symlink("/dev/zero", ctx.src / SHARD3)
    return convert(ctx)


def _config_missing(ctx):
    (ctx.src / "config.json").unlink()
    return convert(ctx)


def _config_bad_json(ctx):
    (ctx.src / "config.json").write_text('{"model_type": "kimi_k3", ')
    return convert(ctx)


def _config_list(ctx):
    (ctx.src / "config.json").write_text("[1, 2]")
    return convert(ctx)


def _config_nested(ctx):
    (ctx.src / "config.json").write_bytes(b'{"a": ' + nested_json() + b"}")
    return convert(ctx)


def _config_not_utf8(ctx):
    (ctx.src / "config.json").write_bytes(b'{"model_type": "\xff"}')
    return convert(ctx)


def _missing_tensor(ctx):
    edit_tensors(ctx.src, EMBED, lambda t: t.pop(EMBED))
    return convert(ctx)


def _wrong_shape(ctx):
    edit_tensors(ctx.src, Q_PROJ, lambda t: t.__setitem__(Q_PROJ, t[Q_PROJ][:, :-1].contiguous()))
    return convert(ctx)


def _wrong_dtype(ctx):
    edit_tensors(ctx.src, NORM, lambda t: t.__setitem__(NORM, t[NORM].to(torch.int32)))
    return convert(ctx)


def _unexpected_tensor(ctx):
    edit_tensors(ctx.src, NORM, lambda t: t.__setitem__("language_model.model.layers.99.mystery.weight",
                                                        torch.zeros(4, dtype=torch.bfloat16)))
    return convert(ctx)


def _unknown_quant(ctx):
    cfg = json.loads((ctx.src / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (ctx.src / "config.json").write_text(json.dumps(cfg))
    return convert(ctx)


def _poison(value: float, name: str = Q_PROJ, to: torch.dtype | None = None):
    def setup(ctx):
        def edit(t):
            if to is not None:
                t[name] = t[name].to(to)
            t[name][1, 2] = value

        edit_tensors(ctx.src, name, edit)
        return convert(ctx)

    return setup


def _nan_scale(keep: bool):
    def setup(ctx):
        edit_tensors(ctx.src, SCALE, lambda t: t[SCALE].__setitem__((0, 0), 255))
        return convert(ctx, *(["--keep-mxfp4"] if keep else []))

    return setup


def _nan_allowed(ctx):
    _poison(float("nan"))(ctx)
    return convert(ctx, "--allow-nonfinite")


def _pickle_only(ctx):
    for p in ctx.src.glob("*.safetensors"):
        p.unlink()
    (ctx.src / INDEX).unlink()
    (ctx.src / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    return convert(ctx)


def _empty_source(ctx):
    for p in ctx.src.iterdir():
        p.unlink()
    return convert(ctx)


def _source_is_file(ctx):
    f = ctx.tmp / "a-file"
    ctx.protect(f)
    f.write_text("x")
    return ["convert", f, ctx.out, "--no-progress"]


def _source_missing(ctx):
    return ["convert", ctx.tmp / "no-such-folder", ctx.out, "--no-progress"]


def _config_field(**fields):
    def setup(ctx):
        set_config(ctx.src, **fields)
        return convert(ctx)

    return setup


# ---------------------------------------------------------------------------------------------- convert: outputs
def _out_foreign(*names, overwrite=False):
    def setup(ctx):
        foreign(ctx.out, *names)
        return convert(ctx, *(["--overwrite"] if overwrite else []))

    return setup


def _out_is_file(ctx):
    ctx.out.write_text("a file, not a folder")
    return convert(ctx)


def _out_is_src(ctx):
    ctx.out = ctx.src
    return convert(ctx, "--overwrite")


def _out_inside_src(ctx):
    ctx.out = ctx.src / "converted"
    return convert(ctx)


def _out_contains_src(ctx):
    ctx.out = ctx.src.parent
    return convert(ctx, "--overwrite")


def _out_link_to_src(ctx):
    os.symlink(ctx.src, ctx.out)
    return convert(ctx, "--overwrite")


def _out_link_elsewhere(ctx):
    (ctx.tmp / "elsewhere").mkdir()
    os.symlink(ctx.tmp / "elsewhere", ctx.out)
    return convert(ctx)


def _out_marked(kind, state="complete"):
    def setup(ctx):
        marked(ctx.out, kind, state)
        return convert(ctx, "--overwrite")

    return setup


def _out_parent_file(ctx):
    (ctx.out.parent / "parent").write_text("a file")
    ctx.out = ctx.out.parent / "parent" / "out"
    return convert(ctx)


def _out_parent_readonly(ctx):
    (ctx.out.parent / "ro").mkdir()
    os.chmod(ctx.out.parent / "ro", 0o555)
    ctx.out = ctx.out.parent / "ro" / "out"
    return convert(ctx)


def _partial(ctx) -> Path:
    return ctx.out.parent / f".{ctx.out.name}.partial"


def _partial_link(ctx):
    (ctx.tmp / "elsewhere").mkdir()
    os.symlink(ctx.tmp / "elsewhere", _partial(ctx))
    ctx.protect(ctx.tmp / "elsewhere")
    return convert(ctx)


def _partial_foreign(ctx):
    foreign(_partial(ctx), "model-00001-of-00009.safetensors")
    ctx.protect(_partial(ctx))
    return convert(ctx)


def _partial_file(ctx):
    _partial(ctx).write_text("x")
    ctx.protect(_partial(ctx))
    return convert(ctx)


def _option(*args):
    def setup(ctx):
        return ["convert", ctx.src, ctx.out, "--no-progress", *args]

    return setup


# ---------------------------------------------------------------------------------------------- tiny / export / other
def _tiny(*args, out_setup=None):
    def setup(ctx):
        if out_setup is not None:
            out_setup(ctx)
        return ["tiny", ctx.out, *args]

    return setup


def _export(*args, out=None, prepare=None):
    def setup(ctx):
        if prepare is not None:
            prepare(ctx)
        if out is not None:
            ctx.out = out(ctx)
        return ["export", ctx.src, ctx.out, *args]

    return setup


def _own_index_names(target_of):
    def prepare(ctx):
        target = target_of(ctx)
        index = {"metadata": {}, "weight_map": {}}
        with safe_open(str(ctx.src / "model.safetensors"), framework="pt") as f:
            index["weight_map"] = {k: target for k in f.keys()}
        (ctx.src / INDEX).write_text(json.dumps(index))

    return prepare


def _own_outside_copy(ctx):
    return outside(ctx, "model.safetensors", (ctx.src / "model.safetensors").read_bytes())


def _own_shard_link_out(ctx):
    link_out(ctx, "model.safetensors")


def _own_index_no_map(ctx):
    (ctx.src / INDEX).write_text(json.dumps({"metadata": {}}))


def _own_garbage_shard(ctx):
    p = ctx.src / "model.safetensors"
    raw = bytearray(p.read_bytes())
    raw[8:16] = b"\x00\xff]]{{{{"
    p.write_bytes(bytes(raw))


def _own_nan(ctx):
    p = ctx.src / "model.safetensors"
    with safe_open(str(p), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = next(k for k in tensors if k.endswith("o_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(p), metadata={"format": "pt"})


def _plain(*args):
    def setup(ctx):
        return [a(ctx) if callable(a) else a for a in args]

    return setup


def _validate(*extra, prepare=None):
    """`validate` of the tiny model against its export (the cheapest run: torch + ort, one step)."""
    def setup(ctx):
        if prepare is not None:
            prepare(ctx)
        return ["validate", ctx.src, "--onnx", ctx.export, "--runtimes", "torch,ort", "--steps", "1",
                "--prompt-len", "2", "--batch", "1", "--threads", "1", *extra]

    return setup


def _garbage_model(ctx):
    (ctx.export / "model.onnx").write_bytes(b"not a protobuf at all")


def _unknown_op(ctx):
    import onnx

    model = onnx.load(str(ctx.export / "model.onnx"), load_external_data=False)
    model.graph.node[0].op_type = "NoSuchOp"
    (ctx.export / "model.onnx").write_bytes(model.SerializeToString())


def _truncated_data(ctx):
    data = sorted(ctx.export.glob("model.onnx.data*"))[0]
    data.write_bytes(data.read_bytes()[:100])


def _external_data_escape(ctx):
    import onnx

    outside(ctx, "passwd")
    model = onnx.load(str(ctx.export / "model.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "../outside/passwd"
                break
        else:
            continue
        break
    (ctx.export / "model.onnx").write_bytes(model.SerializeToString())


def _plot_link_to_nowhere(ctx):
    os.symlink(ctx.tmp / "missing-folder" / "plot.png", ctx.tmp / "plot.png")


def _report_link(ctx):
    os.symlink(outside(ctx, "validation-target.json", b'{"keep": "me"}'), ctx.export / "validation.json")


# ---------------------------------------------------------------------------------------------- tokenizer files
def _generate(*extra, folder=None):
    """`generate` of the tiny model (or `folder(ctx)`): reads its tokenizer, and its chat template with --chat."""
    def setup(ctx):
        return ["generate", folder(ctx) if folder else ctx.src, "hello", "--max-new-tokens", "1", *extra]

    return setup


def _damage(name: str, how: str, *, where=lambda ctx: ctx.src):
    """Damage file `name` of the folder `where(ctx)`: "garbage" (binary), "truncated" (cut inside a line),
    "huge" (a sparse file past the size any tokenizer has: read whole, a memory bomb), "not-a-tokenizer" (JSON of another shape)."""
    def prepare(ctx):
        path = where(ctx) / name
        if how == "garbage":
            path.write_bytes(bytes(range(256)) * 64)
        elif how == "truncated":
            raw = path.read_bytes()
            cut = len(raw) // 2
            while cut > 1 and raw[cut - 1:cut] in (b"\n", b" "):  # inside a line, not at its end
                cut -= 1
            path.write_bytes(raw[:cut])
        elif how == "huge":
            from k3export.tokenizer import MAX_TOKENIZER_BYTES

            path.unlink()
            with open(path, "wb") as fh:  # sparse: the disk holds nothing, a reader would get it all
                fh.truncate(MAX_TOKENIZER_BYTES + 1)
        elif how == "not-a-tokenizer":
            path.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": 5, "merges": "x"}}))
        else:
            raise ValueError(how)

    return prepare


def _then(prepare, command):
    def setup(ctx):
        prepare(ctx)
        return command(ctx)

    return setup


def _chat_template(text: str, *, config: bool = False):
    """The tiny model's chat template replaced by `text` (``chat_template.jinja``), or, with `config`, the
    released fixture's ``tokenizer_config.json`` given ``chat_template: text``."""
    def prepare(ctx):
        if config:
            cfg_path = ctx.src / "tokenizer_config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["chat_template"] = text
            cfg_path.write_text(json.dumps(cfg))
        else:
            (ctx.src / "chat_template.jinja").write_text(text)

    return prepare


# ---------------------------------------------------------------------------------------------- genai_config.json
def _genai_edit(edit):
    def prepare(ctx):
        path = ctx.export / "genai_config.json"
        cfg = json.loads(path.read_text())
        edit(ctx, cfg)
        path.write_text(json.dumps(cfg))

    return prepare


def _genai_decoder(value_of):
    return _genai_edit(lambda ctx, cfg: cfg["model"]["decoder"].__setitem__("filename", value_of(ctx)))


def _genai_outside_copy(ctx) -> str:
    outside(ctx, "model.onnx", (ctx.export / "model.onnx").read_bytes())
    return "../outside/model.onnx"


def _genai_linked(ctx) -> str:
    target = outside(ctx, "model.onnx", (ctx.export / "model.onnx").read_bytes())
    os.symlink(target, ctx.export / "linked.onnx")
    return "linked.onnx"


def _genai_context(n: int):
    def edit(ctx, cfg):
        cfg["model"]["context_length"] = n
        cfg["search"]["max_length"] = n

    return _genai_edit(edit)


def _generate_export(*extra, prompt: str = "hello"):
    def setup(ctx):
        return ["generate", ctx.export, prompt, "--runtime", "genai", *extra]

    return setup


# ---------------------------------------------------------------------------------------------- pipeline.json
def _validate_pipeline(*runtimes: str):
    def setup(ctx):
        return ["validate", ctx.src, "--pipeline", ctx.export, "--runtimes", ",".join(("torch",) + runtimes),
                "--steps", "1", "--prompt-len", "2", "--batch", "1", "--threads", "1", "--strict"]

    return setup


def _pipeline_json(edit):
    def prepare(ctx):
        path = ctx.export / "pipeline.json"
        data = json.loads(path.read_text())
        edit(ctx, data)
        path.write_text(json.dumps(data))

    return prepare


def _stage_outside(ctx, data):
    import shutil

    shutil.copytree(ctx.export / "stage-01", ctx.tmp / "outside-stage")
    ctx.protect(ctx.tmp / "outside-stage")
    data["stages"][1]["folder"] = "../outside-stage"


def _stage_link_out(ctx):
    import shutil

    shutil.move(ctx.export / "stage-01", ctx.tmp / "outside-stage")
    ctx.protect(ctx.tmp / "outside-stage")
    os.symlink(ctx.tmp / "outside-stage", ctx.export / "stage-01")


def _stage_folders_swapped_in_json(ctx, data):
    a, b = data["stages"]
    a["folder"], b["folder"] = b["folder"], a["folder"]


def _stage_folders_swapped_on_disk(ctx):
    os.rename(ctx.export / "stage-00", ctx.export / "stage-tmp")
    os.rename(ctx.export / "stage-01", ctx.export / "stage-00")
    os.rename(ctx.export / "stage-tmp", ctx.export / "stage-01")


def _stage_from_other_export(ctx):
    import shutil

    shutil.rmtree(ctx.export / "stage-01")
    shutil.copytree(ctx.fixture("pipelined_other") / "stage-01", ctx.export / "stage-01")


def _stage_graph_changed(ctx):
    import onnx

    path = ctx.export / "stage-01" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    model.graph.node[0].name = model.graph.node[0].name + "_edited"  # the same I/O and weights: only the graph
    path.write_bytes(model.SerializeToString())


def _stage_layers_gap(ctx, data):
    data["stages"][1]["layers"][0] += 1


# ---------------------------------------------------------------------------------------------- deploy-plan
def _stage_plan(stages) -> Callable[[Ctx], Path]:
    def write(ctx):
        path = ctx.tmp / "plan.json"
        if isinstance(stages, bytes):
            path.write_bytes(stages)
        else:
            path.write_text(json.dumps({"format": "k3export.stage_plan", "format_version": 1, "stages": stages}))
        ctx.protect(path)
        return path

    return write


def _deploy_plan(stages):
    def setup(ctx):
        return ["deploy-plan", ctx.src, "--devices", "2", "--device-memory", "10GB", "--reserve", "0",
                "--stage-plan", _stage_plan(stages)(ctx)]

    return setup


def _export_stage_plan(stages):
    def setup(ctx):
        return ["export", ctx.src, ctx.out, "--stage-plan", _stage_plan(stages)(ctx), "--no-progress"]

    return setup


# ---------------------------------------------------------------------------------------------- devices, outputs, ops
def _torch_has_cuda() -> str | None:
    import torch

    return "this torch is built with CUDA" if torch.version.cuda else None


def _ort_has_cuda() -> str | None:
    import onnxruntime

    return "onnxruntime has CUDA" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else None


def _gpu_visible() -> str | None:
    import torch

    return "a CUDA device is visible" if torch.cuda.is_available() else None


def _no_ray() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("ray") else "ray is not installed"


def _unknown_k3_op(ctx):
    import onnx

    model = onnx.load(str(ctx.export / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.domain == "k3")
    node.op_type = "kda_v9"
    (ctx.export / "model.onnx").write_bytes(model.SerializeToString())


def _tensorrt_builder() -> str | None:
    import importlib.util

    return next((m for m in ("tensorrt", "tensorrt_rtx") if importlib.util.find_spec(m)), None)


def _no_tensorrt() -> str | None:
    return None if _tensorrt_builder() else "neither tensorrt nor tensorrt_rtx is installed"


def _rtx_ignores_timing_cache() -> str | None:
    return _no_tensorrt() or ("TensorRT-RTX times no kernels: it never writes a timing cache"
                              if _tensorrt_builder() == "tensorrt_rtx" else None)


def _build(engine=lambda ctx: ctx.out, *extra, prepare=None):
    """`build` of the tiny export (fp32, fastest settings), the engine at `engine(ctx)`: a process of its own
    whose Triton compiles (the pre-imported one interprets), with the user's Triton cache."""
    def setup(ctx):
        if prepare is not None:
            prepare(ctx)
        ctx.env.update(TRITON_INTERPRET="0", TRITON_CACHE_DIR=os.environ.get(
            "TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache")))
        argv = ["build", ctx.export, engine(ctx), "--precision", "fp32", "--opt-level", "0", *extra]
        return argv + (["--target-cc", "8.6"] if _tensorrt_builder() == "tensorrt_rtx" else [])

    return setup


def _sidecar_is_a_folder(ctx):
    (ctx.out.parent / f"{ctx.out.name}.json").mkdir()


def _engine_info(sidecar: bytes):
    """`info` of an engine whose sidecar (``<engine>.json``, what `info` reads) is `sidecar`."""
    def setup(ctx):
        engines = ctx.tmp / "engines"
        engines.mkdir()
        (engines / "k3.engine").write_bytes(os.urandom(4096))
        (engines / "k3.engine.json").write_bytes(sidecar)
        ctx.protect(engines)
        return ["info", engines / "k3.engine"]

    return setup


def _ray_env(ctx):
    ctx.env["RAY_ADDRESS"] = "127.0.0.1:1"


GB = 1 << 30


# ---------------------------------------------------------------------------------------------- the newer surfaces
SYSTEM_TEXT = "You are a helpful assistant.\n"


def _system_prompt(ctx) -> Path:
    path = ctx.tmp / "sys.txt"
    if not path.exists():
        path.write_text(SYSTEM_TEXT)
        ctx.protect(path)
    return path


def _user_file(name: str, data: bytes = b"a user's notes\n"):
    def make(ctx) -> Path:
        path = ctx.tmp / name
        path.write_bytes(data)
        ctx.protect(path)
        return path

    return make


def _fifo(ctx) -> Path:
    path = ctx.tmp / "fifo"
    os.mkfifo(path)
    ctx.protect(path)
    return path


def _device(ctx) -> Path:
    """A character device node (/dev/full's numbers) in the case's folder: a refusal that regressed replaces this
    node, never the system's."""
    path = ctx.tmp / "full"
    os.mknod(path, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 7))
    ctx.protect(path)
    return path


def _not_root() -> str | None:
    return None if os.geteuid() == 0 else "making a device node needs root"


def _sparse(ctx, name: str, size: int | None = None) -> Path:
    """A sparse file of `size` bytes (default: one past the largest chat script or system prompt read), the disk
    holding nothing. Kept small enough for the harness to hash (it reads every file), and not protected."""
    from k3export.conversation import MAX_TEXT_BYTES

    size = MAX_TEXT_BYTES + 1 if size is None else size
    path = ctx.tmp / name
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def _link_to_user_file(ctx) -> Path:
    path = ctx.tmp / "sys-link.k3state"
    os.symlink(_user_file("notes.txt")(ctx), path)
    return path


def _cache(out, *extra):
    """`cache` of the tiny export's system prompt into `out(ctx)`."""
    def setup(ctx):
        ctx.env["K3EXPORT_ORT_OPS"] = "0"  # the function bodies: no native library built in the case's fresh home
        return ["cache", ctx.export, "--system-prompt", _system_prompt(ctx), "-o", out(ctx), *extra]

    return setup


def _unprotected_file(ctx) -> Path:
    path = ctx.tmp / "notes.txt"
    path.write_text("replace me\n")
    return path


def _older_state(ctx) -> Path:
    """A saved state k3export wrote (of another export, a format version ago: still ours to replace)."""
    path = ctx.tmp / "sys.k3state"
    path.write_bytes(_state_bytes([[5, 6, 7]], [[1, 1, 1]], version="0"))
    return path


def _state_bytes(tokens, mask, version: str | None = None, head: dict | None = None) -> bytes:
    """A state file's bytes, as `State.to_bytes` writes them (its payload digest right), holding `tokens` and
    `mask` and no state tensor; `head` replaces its header (then there is no data)."""
    import numpy as np

    from k3export.artifacts.saved_state import State

    state = State({}, np.asarray(tokens, np.int64), np.asarray(mask, np.int64), "0" * 64, "0" * 64, "float32")
    raw = state.to_bytes()
    if version is None and head is None:
        return raw
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if version is not None:
        header["__metadata__"]["format_version"] = version
    if head is not None:
        header = {"__metadata__": header["__metadata__"], **head}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + (b"" if head is not None else raw[8 + n:])


def _prefix_state(make):
    """`generate --prefix-state` of the tiny export with the state file `make(ctx)` writes."""
    def setup(ctx):
        return ["generate", ctx.export, "hello", "--max-new-tokens", "1", "--prefix-state", make(ctx)]

    return setup


def _state_file(tokens=((5, 6, 7),), mask=((1, 1, 1),), head=None):
    def make(ctx) -> Path:
        path = ctx.tmp / "bad.k3state"
        path.write_bytes(_state_bytes(tokens, mask, head=head))
        ctx.protect(path)
        return path

    return make


def _chat_script(text: str, *extra, prepare=None):
    """`chat --script turns.txt` of the tiny export (`text` its content)."""
    def setup(ctx):
        if prepare is not None:
            prepare(ctx)
        path = ctx.tmp / "turns.txt"
        path.write_text(text, encoding="utf-8")
        ctx.protect(path)
        return ["chat", ctx.export, "--script", path, "--max-new-tokens", "2", *extra]

    return setup


def _chat_script_file(make):
    def setup(ctx):
        return ["chat", ctx.export, "--script", make(ctx), "--max-new-tokens", "2"]

    return setup


def _switch(name: str, value: str):
    """`generate` of the tiny export with environment variable `name` set to `value`."""
    def setup(ctx):
        ctx.env[name] = value
        return ["generate", ctx.export, "hello", "--max-new-tokens", "1"]

    return setup


CASES: list[Case] = [
    # --- convert: damaged shards (released layout)
    Case("shard-truncated", _truncate, ("truncated", SHARD1)),
    Case("shard-header-not-json", _header_garbage, ("corrupted header", SHARD1)),
    Case("shard-header-length-past-end", _header_len_past_end, ("truncated", SHARD1)),
    Case("shard-header-length-2^62", _header_len_huge, ("header length", SHARD1)),
    Case("shard-header-nested-json", _header_nested, ("nested too deeply", SHARD1)),
    Case("shard-header-is-list", _header_list, ("not a JSON object", SHARD1)),
    Case("shard-offsets-past-end", _offsets_past_end, ("past", EMBED)),
    Case("shard-offsets-overlap", _offsets_overlap, ("overlaps", SHARD1)),
    Case("shard-unknown-dtype", _unknown_dtype, ("unknown dtype", EMBED)),
    Case("shard-negative-shape", _negative_shape, ("invalid shape", EMBED)),
    Case("shard-shape-bomb", _shape_bomb, (EMBED, SHARD1), as_extra=2 * GB),
    Case("shard-metadata-not-strings", _metadata_not_strings, ("__metadata__", SHARD1)),
    Case("shard-header-5000-digit-int", _header_huge_int, ("corrupted header", SHARD1)),
    # --- convert: the index
    Case("index-without-weight-map", _index_no_weight_map, ("weight_map", INDEX)),
    Case("index-weight-map-list", _index_weight_map_list, ("weight_map", INDEX)),
    Case("index-is-list", _index_is_list, ("weight_map", INDEX)),
    Case("index-nested-json", _index_nested, ("nested too deeply", INDEX)),
    Case("index-not-utf8", _index_not_utf8, ("UTF-8", INDEX)),
    Case("index-names-missing-shard", _index_missing_shard, ("missing", SHARD2)),
    Case("index-dotdot-escape", _index_dotdot, (f"../outside/{SHARD1}",)),
    Case("index-absolute-path", _index_absolute, ("absolute",)),
    Case("index-nested-dotdot", _index_nested_dotdot, (f"sub/../../outside/{SHARD1}",)),
    Case("index-subfolder-link-escape", _index_subdir_link, (f"weights/{SHARD1}", "symlink escapes")),
    # --- convert: links and special files
    Case("shard-symlink-escape", _shard_link_out, ("symlink escapes", SHARD2)),
    Case("index-symlink-escape", _index_link_out, ("symlink escapes", INDEX)),
    Case("config-symlink-escape", _config_link_out, ("symlink escapes", "config.json")),
    Case("tokenizer-symlink-to-private-key", _tokenizer_link_out, ("symlink escapes", "tiktoken.model")),
    Case("shard-fifo", _shard_fifo, ("not a regular file", SHARD3)),
    Case("shard-directory", _shard_dir, ("not a regular file", SHARD3)),
    Case("shard-dangling-symlink", _shard_dangling, ("dangling", SHARD3)),
    Case("shard-symlink-dev-zero", _shard_dev_zero, ("symlink escapes", SHARD3)),
    # --- convert: config.json
    Case("config-missing", _config_missing, ("config.json",)),
    Case("config-bad-json", _config_bad_json, ("config.json", "JSON")),
    Case("config-is-list", _config_list, ("config.json",)),
    Case("config-nested-json", _config_nested, ("config.json",)),
    Case("config-not-utf8", _config_not_utf8, ("config.json",)),
    Case("config-unknown-quant-method", _unknown_quant, ("gptq",)),
    Case("config-num-experts-1e10", _config_field(num_experts=10**10), ("num_experts",), as_extra=2 * GB),
    Case("config-vocab-1e12", _config_field(vocab_size=10**12), ("vocab_size",), as_extra=2 * GB),
    Case("config-hidden-size-missing", _config_field(hidden_size=DELETE), ("hidden_size",)),
    Case("config-num-experts-string", _config_field(num_experts="many"), ("num_experts",)),
    Case("config-rms-norm-eps-nan", _config_field(rms_norm_eps=float("nan")), ("rms_norm_eps",)),
    Case("config-layers-negative", _config_field(num_hidden_layers=-3), ("num_hidden_layers",)),
    # --- convert: tensors
    Case("tensor-missing", _missing_tensor, ("missing tensor", EMBED)),
    Case("tensor-wrong-shape", _wrong_shape, ("wrong shape", Q_PROJ)),
    Case("tensor-wrong-dtype", _wrong_dtype, ("wrong dtype", NORM)),
    Case("tensor-unexpected", _unexpected_tensor, ("unexpected tensor", "mystery")),
    Case("weight-nan", _poison(float("nan")), ("NaN/Inf", Q_PROJ)),
    Case("weight-inf", _poison(float("-inf")), ("NaN/Inf", Q_PROJ)),
    Case("weight-overflows-bf16", _poison(3.4e38, to=torch.float32), ("NaN/Inf", Q_PROJ)),
    Case("mxfp4-scale-nan", _nan_scale(keep=False), ("0xFF", SCALE)),
    Case("mxfp4-scale-nan-kept", _nan_scale(keep=True), ("0xFF", SCALE)),
    Case("weight-nan-allowed", _nan_allowed, code=0),
    Case("source-pickle-only", _pickle_only, ("pickle",)),
    Case("source-empty", _empty_source, ("config.json",)),
    Case("source-is-a-file", _source_is_file, ("a-file",)),
    Case("source-missing", _source_missing, ("no-such-folder",)),
    # --- convert: the output folder
    Case("out-foreign-files", _out_foreign(), ("not empty", "--overwrite")),
    Case("out-foreign-files-overwrite", _out_foreign(overwrite=True), ("not a folder k3export wrote",)),
    Case("out-lookalike-files-overwrite",
         _out_foreign("model-00001-of-00009.safetensors", "model-00001-of-00009.safetensors.tmp-1", "config.json",
                      INDEX, overwrite=True), ("not a folder k3export wrote",)),
    Case("out-is-a-file", _out_is_file, ("not a folder",)),
    Case("out-is-source", _out_is_src, ("is the source folder",)),
    Case("out-inside-source", _out_inside_src, ("inside the source folder",)),
    Case("out-contains-source", _out_contains_src, ("contains the source folder",)),
    Case("out-symlink-to-source", _out_link_to_src, ("is the source folder",)),
    Case("out-symlink-elsewhere", _out_link_elsewhere, ("symbolic link",)),
    Case("out-marked-export-overwrite", _out_marked("export"), ("not a checkpoint",)),
    Case("out-marked-partial-overwrite", _out_marked("checkpoint", "partial"), ("partial",)),
    Case("out-parent-is-a-file", _out_parent_file, ("parent",)),
    Case("out-parent-read-only", _out_parent_readonly, ("ro",)),
    Case("partial-is-symlink", _partial_link, ("not a partial",)),
    Case("partial-is-foreign-folder", _partial_foreign, ("not a partial",)),
    Case("partial-is-a-file", _partial_file, ("not a partial",)),
    Case("disk-full-early", convert, ("file too large",), fsize=40_000),
    Case("disk-full-late", convert, ("file too large",), fsize=120_000),
    # --- convert: option values
    Case("max-shard-size-1e400", _option("--max-shard-size", "1e400"), ("--max-shard-size",)),
    Case("max-shard-size-zero", _option("--max-shard-size", "0"), ("--max-shard-size",)),
    Case("max-shard-size-negative", _option("--max-shard-size", "-5GB"), ("--max-shard-size",)),
    Case("max-shard-size-nan", _option("--max-shard-size", "nan"), ("--max-shard-size",)),
    Case("max-shard-size-words", _option("--max-shard-size", "five gigs"), ("--max-shard-size",)),
    Case("workers-zero", _option("--workers", "0"), ("--workers",)),
    Case("workers-1e23", _option("--workers", "99999999999999999999999"), ("--workers",)),
    Case("dtype-int8", _option("--dtype", "int8"), ("int8",)),
    Case("unknown-option", _option("--frobnicate"), ("--frobnicate",)),
    # --- tiny
    Case("tiny-seed-1e23", _tiny("--seed", "99999999999999999999999"), ("--seed",), source="none"),
    Case("tiny-seed-negative", _tiny("--seed", "-1"), ("--seed",), source="none"),
    Case("tiny-into-foreign-folder", _tiny(out_setup=lambda ctx: foreign(ctx.out)), ("not empty",),
         source="none"),
    Case("tiny-overwrite-foreign-folder", _tiny("--overwrite", out_setup=lambda ctx: foreign(ctx.out)),
         ("not a folder k3export wrote",), source="none"),
    Case("tiny-into-a-file", _tiny(out_setup=lambda ctx: ctx.out.write_text("x")), ("not a folder",),
         source="none"),
    Case("tiny-overwrite-own-checkpoint", _tiny("--overwrite", out_setup=lambda ctx: marked(ctx.out, "checkpoint")),
         code=0, source="none"),
    Case("tiny-overwrite-own-export", _tiny("--overwrite", out_setup=lambda ctx: marked(ctx.out, "export")),
         ("not a checkpoint",), source="none"),
    # --- export (our layout)
    Case("export-model-onto-itself", _export("--overwrite", out=lambda ctx: ctx.src), ("is the source folder",),
         source="tiny"),
    Case("export-into-parent-of-model", _export("--overwrite", out=lambda ctx: ctx.src.parent),
         ("contains the source folder",), source="tiny"),
    Case("export-inside-model", _export(out=lambda ctx: ctx.src / "onnx"), ("inside the source folder",),
         source="tiny"),
    Case("export-overwrite-foreign", _export("--overwrite", prepare=lambda ctx: foreign(ctx.out)),
         ("not a folder k3export wrote",), source="tiny"),
    Case("export-overwrite-checkpoint", _export("--overwrite", prepare=lambda ctx: marked(ctx.out, "checkpoint")),
         ("not an export",), source="tiny"),
    Case("export-opset-1e20", _export("--opset", "99999999999999999999"), ("--opset",), source="tiny"),
    Case("export-own-index-dotdot", _export(prepare=_own_index_names(lambda ctx: (_own_outside_copy(ctx),
                                                                                 "../outside/model.safetensors")[1])),
         ("../outside/model.safetensors",), source="tiny"),
    Case("export-own-shard-symlink-escape", _export(prepare=_own_shard_link_out), ("symlink escapes",),
         source="tiny"),
    Case("export-own-config-symlink-escape", _export(prepare=lambda ctx: link_out(ctx, "config.json")),
         ("symlink escapes", "config.json"), source="tiny"),
    Case("export-own-index-without-weight-map", _export(prepare=_own_index_no_map), ("weight_map",),
         source="tiny"),
    Case("export-own-garbage-shard", _export(prepare=_own_garbage_shard), ("model.safetensors",), source="tiny"),
    Case("export-own-nan-weight", _export(prepare=_own_nan), ("NaN",), source="tiny"),
    Case("export-disk-full", _export(), ("file too large",), source="tiny", fsize=200_000),
    Case("tiny-disk-full", _tiny(), ("could not write",), source="none", fsize=200_000),  # > any code file, < weights
    # --- validate: broken exports (ONNX Runtime load errors and paths among them)
    Case("validate-garbage-model", _validate(prepare=_garbage_model), ("model.onnx",), source="export"),
    Case("validate-ort-load-error", _validate(prepare=_unknown_op), ("ONNX Runtime", "model.onnx", "NoSuchOp"),
         source="export"),
    Case("validate-truncated-external-data", _validate(prepare=_truncated_data), ("model.onnx.data",),
         source="export"),
    Case("validate-external-data-escape", _validate(prepare=_external_data_escape), ("../outside/passwd",),
         source="export"),
    Case("validate-report-symlink-not-followed", _validate(prepare=_report_link), code=0, source="export"),
    Case("validate-plot-dangling-symlink",
         lambda ctx: _validate("--plot", ctx.tmp / "plot.png", prepare=_plot_link_to_nowhere)(ctx),
         ("plot.png", "does not exist"), source="export"),
    # --- other commands' option ranges
    Case("info-batch-negative", _plain("info", "tiny", "--batch", "-3"), ("--batch",), source="none"),
    Case("info-context-1e400", _plain("info", "tiny", "--context", "1e400"), ("--context",), source="none"),
    Case("validate-device-tpu9", _plain("validate", lambda ctx: ctx.tmp, "--device", "tpu9"), ("--device",),
         source="none"),
    Case("validate-seed-1e23", _plain("validate", lambda ctx: ctx.tmp, "--seed", "99999999999999999999999"),
         ("--seed",), source="none"),
    Case("unknown-command", _plain("frobnicate"), ("frobnicate",), source="none"),
    # --- tokenizer files: tokenizer.json (generate and export read it), tiktoken.model (convert reads it)
    Case("tokenizer-json-garbage", _then(_damage("tokenizer.json", "garbage"), _generate()),
         ("tokenizer.json", "UTF-8"), source="tiny", surface="tokenizer"),
    Case("tokenizer-json-truncated", _then(_damage("tokenizer.json", "truncated"), _generate()),
         ("tokenizer.json", "not JSON"), source="tiny", surface="tokenizer"),
    Case("tokenizer-json-not-a-tokenizer", _then(_damage("tokenizer.json", "not-a-tokenizer"), _generate()),
         ("tokenizer.json",), source="tiny", surface="tokenizer"),
    Case("tokenizer-json-memory-bomb", _then(_damage("tokenizer.json", "huge"), _generate()),
         ("tokenizer.json", "larger than"), source="tiny", surface="tokenizer", as_extra=GB // 4),
    Case("export-tokenizer-json-truncated", _export(prepare=_damage("tokenizer.json", "truncated")),
         ("tokenizer.json", "not JSON"), source="tiny", surface="tokenizer"),
    Case("tiktoken-garbage", _then(_damage("tiktoken.model", "garbage"), convert),
         ("tiktoken.model", "UTF-8"), surface="tokenizer"),
    Case("tiktoken-truncated", _then(_damage("tiktoken.model", "truncated"), convert),
         ("tiktoken.model", "is not 'base64-token rank'"), surface="tokenizer"),
    Case("tiktoken-memory-bomb", _then(_damage("tiktoken.model", "huge"), convert),
         ("tiktoken.model", "larger than"), surface="tokenizer", as_extra=GB // 4),
    # --- chat templates
    Case("chat-template-not-jinja", _then(_chat_template("{% for m in messages %}{{ m.content }"), _generate("--chat")),
         ("chat_template.jinja", "line 1"), source="tiny", surface="chat"),
    Case("chat-template-includes-a-file", _then(_chat_template("{% include '/etc/passwd' %}"), _generate("--chat")),
         ("chat_template.jinja", "'include'"), source="tiny", surface="chat"),
    Case("chat-template-imports-a-file", _then(_chat_template("hi\n{% import '/etc/hosts' as h %}"), _generate()),
         ("chat_template.jinja", "line 2", "'import'"), source="tiny", surface="chat"),
    Case("chat-template-escapes-the-sandbox",
         _then(_chat_template("{{ cycler.__init__.__globals__.os.popen('id').read() }}"), _generate("--chat")),
         ("chat template", "unsafe"), source="tiny", surface="chat"),
    Case("convert-chat-template-extends-a-file", _then(_chat_template("{% extends '/etc/passwd' %}", config=True),
                                                       convert),
         ("tokenizer_config.json", "'extends'"), surface="chat"),
    # --- genai_config.json (generate --runtime genai reads it first)
    Case("genai-decoder-dotdot", _then(_genai_decoder(_genai_outside_copy), _generate_export("--max-new-tokens", "1")),
         ("model.decoder.filename", "../outside/model.onnx"), source="export", surface="genai"),
    Case("genai-decoder-absolute", _then(_genai_decoder(lambda ctx: "/etc/passwd"),
                                         _generate_export("--max-new-tokens", "1")),
         ("model.decoder.filename", "absolute"), source="export", surface="genai"),
    Case("genai-decoder-symlink-escape", _then(_genai_decoder(_genai_linked), _generate_export("--max-new-tokens", "1")),
         ("linked.onnx", "symlink escapes"), source="export", surface="genai"),
    Case("genai-decoder-missing", _then(_genai_decoder(lambda ctx: "model-v2.onnx"),
                                        _generate_export("--max-new-tokens", "1")),
         ("model.decoder.filename", "model-v2.onnx", "missing"), source="export", surface="genai"),
    Case("genai-tokenizer-dir-escape",
         _then(_genai_edit(lambda ctx, cfg: cfg["model"].__setitem__("tokenizer_dir", "../outside")),
               _generate_export("--max-new-tokens", "1")),
         ("model.tokenizer_dir", "../outside"), source="export", surface="genai"),
    # --- pipeline.json (validate --pipeline loads it with every stage)
    Case("pipeline-stage-dotdot", _then(_pipeline_json(_stage_outside), _validate_pipeline("pipeline")),
         ("stages[1].folder", "../outside-stage"), source="pipeline", surface="pipeline"),
    Case("pipeline-stage-symlink-escape", _then(_stage_link_out, _validate_pipeline("pipeline")),
         ("stages[1].folder", "stage-01"), source="pipeline", surface="pipeline"),
    Case("pipeline-stages-swapped-in-pipeline-json", _then(_pipeline_json(_stage_folders_swapped_in_json),
                                                           _validate_pipeline("pipeline")),
         ("stage.json", "stage 1 of 2", "as stage 0"), source="pipeline", surface="pipeline"),
    Case("pipeline-stage-folders-swapped", _then(_stage_folders_swapped_on_disk, _validate_pipeline("pipeline")),
         ("stage.json", "as stage 0"), source="pipeline", surface="pipeline"),
    Case("pipeline-stage-from-another-export", _then(_stage_from_other_export, _validate_pipeline("pipeline")),
         ("stage-01", "another export"), source="pipeline", surface="pipeline"),
    Case("pipeline-stage-graph-changed", _then(_stage_graph_changed, _validate_pipeline("pipeline")),
         ("stage-01/model.onnx", "changed since"), source="pipeline", surface="pipeline"),
    Case("pipeline-layers-gap", _then(_pipeline_json(_stage_layers_gap), _validate_pipeline("pipeline")),
         ("pipeline.json", "layer 3", "in no stage"), source="pipeline", surface="pipeline"),
    Case("pipeline-json-not-json", _then(lambda ctx: (ctx.export / "pipeline.json").write_text("{stages"),
                                         _validate_pipeline("pipeline")),
         ("pipeline.json",), source="pipeline", surface="pipeline"),
    Case("pipeline-ray-address-unreachable", _then(_ray_env, _validate_pipeline("ray")), ("127.0.0.1:1",),
         source="pipeline", surface="pipeline", timeout=60, skip=_no_ray),
    # --- generate: token budgets
    Case("generate-max-new-tokens-1e12", _generate_export("--max-new-tokens", str(10**12)), ("--max-new-tokens",),
         source="export", surface="generate"),
    Case("generate-prompt-longer-than-genai-context",
         _then(_genai_context(8), _generate_export("--max-new-tokens", "1", prompt="hello world " * 20)),
         ("context",), source="export", surface="generate"),
    Case("generate-max-new-tokens-past-genai-context",
         _then(_genai_context(64), _generate_export("--max-new-tokens", "1000")),
         ("context",), source="export", surface="generate"),
    # --- deploy-plan --stage-plan (and export --stage-plan, which reads the same file)
    Case("stage-plan-layers-twice", _deploy_plan([[0, 4], [3, 6]]), ("plan.json", "layer 3", "again in stage 1"),
         source="tiny", surface="deploy-plan"),
    Case("stage-plan-gap", _deploy_plan([[0, 2], [3, 6]]), ("plan.json", "layer 2", "in no stage"),
         source="tiny", surface="deploy-plan"),
    Case("stage-plan-last-layers-missing", _deploy_plan([[0, 3], [3, 5]]), ("plan.json", "layer 5", "in no stage"),
         source="tiny", surface="deploy-plan"),
    Case("stage-plan-past-the-model", _deploy_plan([[0, 3], [3, 9]]), ("plan.json", "goes past"),
         source="tiny", surface="deploy-plan"),
    Case("stage-plan-empty-stage", _deploy_plan([[0, 3], [3, 3], [3, 6]]), ("plan.json", "holds no layer"),
         source="tiny", surface="deploy-plan"),
    Case("stage-plan-not-json", _deploy_plan(b"[[0, 3], [3"), ("plan.json",), source="tiny", surface="deploy-plan"),
    Case("export-stage-plan-layers-twice", _export_stage_plan([[0, 4], [3, 6]]), ("plan.json", "again in stage 1"),
         source="tiny", surface="deploy-plan"),
    # --- devices, output paths, graph ops, cluster addresses
    Case("validate-device-cuda-without-cuda", _validate("--device", "cuda"), ("--device", "without CUDA"),
         source="export", skip=_torch_has_cuda),
    Case("validate-ort-cuda-without-cuda-strict", _validate("--runtimes", "torch,ort-cuda", "--strict"),
         ("CUDAExecutionProvider",), source="export", skip=_ort_has_cuda),
    Case("validate-trt-without-gpu-strict", _validate("--runtimes", "torch,trt", "--strict"), ("CUDA device",),
         source="export", skip=_gpu_visible),
    Case("generate-ort-cuda-without-cuda", _plain("generate", lambda ctx: ctx.export, "hello", "--runtime", "ort-cuda",
                                                  "--max-new-tokens", "1"),
         ("CUDAExecutionProvider",), source="export", surface="generate", skip=_ort_has_cuda),
    Case("generate-device-cuda-without-cuda", _generate("--device", "cuda"), ("--device", "without CUDA"),
         source="tiny", surface="generate", skip=_torch_has_cuda),
    Case("validate-plot-unwritable", _validate("--plot", "/proc/k3export-plot.png"),
         ("/proc/k3export-plot.png", "cannot write"), source="export"),
    Case("validate-report-unwritable", _validate("--report", "/proc/k3export-report.json"),
         ("/proc/k3export-report.json", "cannot write"), source="export"),
    Case("validate-unknown-k3-op", _validate(prepare=_unknown_k3_op), ("model.onnx", "kda_v9"), source="export"),
    Case("engine-sidecar-not-utf8", _engine_info(b"\xff\x00 not a sidecar"), ("k3.engine.json", "UTF-8"),
         source="none", surface="engine-sidecar"),
    Case("engine-sidecar-another-format", _engine_info(json.dumps({"format": "someone.else",
                                                                   "format_version": 1}).encode()),
         ("k3.engine.json", "'format'", "someone.else"), source="none", surface="engine-sidecar"),
    Case("engine-sidecar-is-list", _engine_info(b"[1, 2]"), ("k3.engine.json", "JSON object"), source="none",
         surface="engine-sidecar"),
    Case("engine-sidecar-version-99", _engine_info(json.dumps({"format": "k3export.engine_sidecar",
                                                               "format_version": 99}).encode()),
         ("k3.engine.json", "format_version", "99"), source="none", surface="engine-sidecar"),
    Case("build-engine-path-unwritable", _build(lambda ctx: "/proc/k3export.engine"), ("/proc/k3export.engine",),
         source="export", surface="build", mode="exec", skip=_no_tensorrt),
    Case("build-sidecar-unwritable", _build(prepare=_sidecar_is_a_folder), ("out.json",), source="export",
         surface="build", mode="exec", skip=_no_tensorrt),
    Case("build-timing-cache-unwritable", _build(lambda ctx: ctx.out, "--timing-cache", "/proc/k3export.cache"),
         ("/proc/k3export.cache",), source="export", surface="build", mode="exec", skip=_rtx_ignores_timing_cache),
    Case("convert-ray-address-unreachable", lambda ctx: convert(ctx, "--ray", "--ray-address", "127.0.0.1:1"),
         ("--ray-address", "127.0.0.1:1"), timeout=60, skip=_no_ray),
    # --- the newer surfaces: cache -o never replaces what it did not write
    Case("cache-output-is-a-user-file", _cache(_user_file("notes.txt")), ("notes.txt", "--overwrite"),
         source="export", surface="cache"),
    Case("cache-output-is-the-system-prompt", _cache(_system_prompt), ("sys.txt", "reads"), source="export",
         surface="cache"),
    Case("cache-output-is-the-exports-model", _cache(lambda ctx: ctx.export / "model.onnx", "--overwrite"),
         ("model.onnx", "reads"), source="export", surface="cache"),
    Case("cache-output-is-a-fifo", _cache(_fifo), ("fifo", "FIFO"), source="export", surface="cache"),
    Case("cache-output-is-a-device", _cache(_device, "--overwrite"), ("full", "device"), source="export",
         surface="cache", skip=_not_root),
    Case("cache-output-is-a-folder", _cache(lambda ctx: ctx.tmp / "work"), ("work", "folder"), source="export",
         surface="cache"),
    Case("cache-output-is-a-link", _cache(_link_to_user_file), ("sys-link.k3state", "symbolic link"),
         source="export", surface="cache"),
    Case("cache-replaces-an-older-state", _cache(_older_state), code=0, source="export", surface="cache"),
    Case("cache-overwrite-replaces-a-user-file", _cache(_unprotected_file, "--overwrite"),
         code=0, source="export", surface="cache"),
    Case("cache-system-prompt-sparse-past-the-limit", lambda ctx: [
        "cache", ctx.export, "--system-prompt", _sparse(ctx, "big.txt"), "-o", ctx.tmp / "s.k3state"],
         ("big.txt", "larger than"), source="export", surface="cache", as_extra=GB // 4),
    # --- saved states (generate --prefix-state)
    Case("state-shape-2^62", _prefix_state(_state_file(head={
        "k3state.tokens": {"dtype": "I64", "shape": [2**62, 4], "data_offsets": [0, 2**65]}})),
         ("bad.k3state", "k3state.tokens", "4611686018427387904"), source="export", surface="state"),
    Case("state-token-id-negative", _prefix_state(_state_file(tokens=((5, -7, 6),))),
         ("bad.k3state", "k3state.tokens", "-7"), source="export", surface="state"),
    Case("state-token-id-past-vocab", _prefix_state(_state_file(tokens=((5, 10**9, 6),))),
         ("bad.k3state", "k3state.tokens", "1000000000"), source="export", surface="state"),
    Case("state-mask-marks-the-prefix-as-padding", _prefix_state(_state_file(mask=((0, 0, 1),))),
         ("bad.k3state", "k3state.attention_mask"), source="export", surface="state"),
    Case("state-mask-value-2", _prefix_state(_state_file(mask=((1, 2, 1),))),
         ("bad.k3state", "k3state.attention_mask"), source="export", surface="state"),
    Case("state-is-a-fifo", _prefix_state(_fifo), ("fifo", "not a regular file"), source="export", surface="state"),
    Case("state-sparse-zeros", _prefix_state(lambda ctx: _sparse(ctx, "big.k3state")), ("big.k3state",),
         source="export", surface="state", as_extra=GB // 4),
    # --- chat scripts
    Case("chat-script-superscript-turn", _chat_script("Hi\nedit \u00b2 hello\n"), ("turns.txt:2", "counted from 1"),
         source="export", surface="chat-script"),
    Case("chat-script-edit-0", _chat_script("Hi\nAnd you?\n/edit 0 hello\n"), ("turns.txt:3", "counted from 1"),
         source="export", surface="chat-script"),
    Case("chat-script-edit-past-the-last-turn", _chat_script("Hi\nAnd you?\n/edit 3 hello\n"),
         ("turns.txt:3", "no user turn 3"), source="export", surface="chat-script"),
    Case("chat-script-leading-regenerate", _chat_script("regenerate\nHi\n"), ("turns.txt:1", "nothing to regenerate"),
         source="export", surface="chat-script"),
    Case("chat-script-unknown-command", _chat_script("Hi\n/frobnicate now\n"), ("turns.txt:2", "/frobnicate"),
         source="export", surface="chat-script"),
    Case("chat-script-10MB-line-past-the-context", _chat_script("hello world " * (10 * (1 << 20) // 12) + "\n",
                                                                 prepare=_genai_context(256)),
         ("turns.txt:1", "context of 256"), source="export", surface="chat-script", timeout=60),
    Case("chat-script-sparse-past-the-limit", _chat_script_file(lambda ctx: _sparse(ctx, "turns.txt")),
         ("turns.txt", "larger than"), source="export", surface="chat-script", as_extra=GB // 4),
    Case("chat-script-not-utf8", _chat_script_file(_user_file("turns.txt", b"Hi\n\xff\xfe\n")),
         ("turns.txt", "UTF-8"), source="export", surface="chat-script"),
    Case("chat-script-is-a-fifo", _chat_script_file(_fifo), ("fifo", "not a regular file"), source="export",
         surface="chat-script"),
    # --- environment switches
    Case("switch-K3EXPORT_ORT_OPS-maybe", _switch("K3EXPORT_ORT_OPS", "maybe"), ("K3EXPORT_ORT_OPS", "'maybe'"),
         source="export", surface="switches"),
    Case("switch-K3EXPORT_OV_EXT-2", _switch("K3EXPORT_OV_EXT", "2"), ("K3EXPORT_OV_EXT",), source="export",
         surface="switches"),
    Case("switch-K3EXPORT_HUGE_PAGES-enable", _switch("K3EXPORT_HUGE_PAGES", "enable"), ("K3EXPORT_HUGE_PAGES",),
         source="export", surface="switches"),
    Case("generate-draft-not-a-model", _plain("generate", lambda ctx: ctx.export, "hello", "--draft",
                                              "no-such-folder"), ("--draft", "no-such-folder"), source="export",
         surface="generate"),
]
