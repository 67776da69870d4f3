"""The Python API refuses what the CLI refuses, with the same line: `K3ForCausalLM.from_pretrained` on every layout
(ours, which transformers reads after k3export's checks; released K3 and Kimi-Linear, which k3export's loader
reads) against ``k3export export`` / ``convert`` on the same damaged folder, run as a real process.

A damaged shard or an index leaving the folder: the API raises k3export's `CheckpointError` whose text is the CLI's
``error:`` line. NaN weights: the CLI refuses them, the API loads them with a warning that starts with the CLI's
line (file and tensor), up to what each then does about it.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import SHARD, check_refusal, copy_tree, snapshot  # noqa: E402

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory) -> Path:
    from k3export.converters.checkpoints.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("kimi-linear") / "kl", layout="kimi_linear", num_shards=2)


def _shards(folder: Path) -> list[Path]:
    if (folder / INDEX).is_file():
        names = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return [folder / "model.safetensors"]


def _truncate(folder: Path) -> None:
    p = _shards(folder)[0]
    p.write_bytes(p.read_bytes()[:-100])


def _header_past_end(folder: Path) -> None:
    p = _shards(folder)[0]
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])


def _index_dotdot(folder: Path) -> None:
    """The first shard moved next to the folder and the index pointed at it (``../NAME``)."""
    first = _shards(folder)[0]
    with safe_open(str(first), framework="pt") as f:
        names = list(f.keys())
    moved = folder.parent / f"outside_{first.name}"
    first.rename(moved)
    index = json.loads((folder / INDEX).read_text()) if (folder / INDEX).is_file() else {"weight_map": {}}
    index["weight_map"].update({n: f"../{moved.name}" for n in names})
    (folder / INDEX).write_text(json.dumps(index))


def _shard_link_out(folder: Path) -> None:
    first = _shards(folder)[0]
    moved = folder.parent / f"linked_{first.name}"
    first.rename(moved)
    os.symlink(moved, first)


def _edit_header(edit) -> callable:
    """Rewrite the first shard's JSON header by `edit(header) -> header` (data kept as is)."""
    def damage(folder: Path) -> None:
        p = _shards(folder)[0]
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        body = json.dumps(edit(json.loads(raw[8:8 + n]))).encode()
        p.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    return damage


def _first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


def _header_garbage(folder: Path) -> None:
    p = _shards(folder)[0]
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    p.write_bytes(raw[:8] + b"\xff{not json" + b" " * (n - 10) + raw[8 + n:])


def _header_len_huge(folder: Path) -> None:
    p = _shards(folder)[0]
    p.write_bytes(struct.pack("<Q", 1 << 62) + p.read_bytes()[8:])


def _offsets_past_end(header: dict) -> dict:
    offsets = _first_tensor(header)["data_offsets"]
    offsets[0] += 1 << 40
    offsets[1] += 1 << 40
    return header


def _index_of(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text()) if (folder / INDEX).is_file() else {
        "weight_map": {n: "model.safetensors" for n in _names(folder / "model.safetensors")}}


def _names(shard: Path) -> list[str]:
    with safe_open(str(shard), framework="pt") as f:
        return list(f.keys())


def _index_target(target: str):
    """The index maps the first shard's tensors to `target`."""
    def damage(folder: Path) -> None:
        index = _index_of(folder)
        index["weight_map"].update({n: target for n in _names(_shards(folder)[0])})
        (folder / INDEX).write_text(json.dumps(index))
    return damage


def _index_without_weight_map(folder: Path) -> None:
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": 1}}))


def _shard_dangling(folder: Path) -> None:
    p = _shards(folder)[0]
    p.unlink()
    os.symlink(folder / "no-such-file.safetensors", p)


def _shard_fifo(folder: Path) -> None:
    p = _shards(folder)[0]
    p.unlink()
    os.mkfifo(p)


def _config_not_json(folder: Path) -> None:
    (folder / "config.json").write_text('{"model_type": ')


def _config_link_out(folder: Path) -> None:
    moved = folder.parent / "outside_config.json"
    (folder / "config.json").rename(moved)
    os.symlink(moved, folder / "config.json")


DAMAGE = {"truncated": (_truncate, "truncated"), "header-length-past-end": (_header_past_end, "truncated"),
          "index-dotdot": (_index_dotdot, "../outside_"), "shard-symlink-escape": (_shard_link_out, "symlink escapes"),
          "header-not-json": (_header_garbage, "header"), "header-length-2^62": (_header_len_huge, "header length"),
          "header-is-list": (_edit_header(lambda h: [h]), "not a JSON object"),
          "offsets-past-end": (_edit_header(_offsets_past_end), "past"),
          # one entry gone, the others' offsets leave a hole (safetensors' own reader: "invalid offset")
          "entry-removed": (_edit_header(lambda h: (h.pop(sorted(k for k in h if k != "__metadata__")[3]), h)[1]),
                            "belong to no tensor"),
          "unknown-dtype": (_edit_header(lambda h: (_first_tensor(h).__setitem__("dtype", "Q7"), h)[1]),
                            "unknown dtype"),
          "negative-shape": (_edit_header(lambda h: (_first_tensor(h).__setitem__("shape", [-4, 2]), h)[1]),
                             "invalid shape"),
          "index-absolute-path": (_index_target("/etc/model.safetensors"), "absolute"),
          "index-names-missing-shard": (_index_target("model-09999.safetensors"), "model-09999.safetensors"),
          "index-without-weight-map": (_index_without_weight_map, "weight_map"),
          "shard-dangling-symlink": (_shard_dangling, "dangling"),
          "shard-fifo": (_shard_fifo, "not a regular file")}
#: config.json damage: k3export's shared check (the ``checks`` entry point, which from_pretrained runs first on a
#: local folder of any layout) gives the CLI's line
CONFIG_DAMAGE = {"config-not-json": (_config_not_json, "not valid JSON"),
                 "config-symlink-escape": (_config_link_out, "symlink escapes")}


def _layout(name: str, request) -> Path:
    return request.getfixturevalue({"ours": "tiny", "released": "released", "kimi_linear": "kimi_linear"}[name])


def _cli_line(cli, folder: Path, tmp_path: Path, layout: str) -> str:
    """The CLI's one line for `folder`: ``export`` (reads any layout without building a model) for ours,
    ``convert`` for the others."""
    out = tmp_path / "work" / "out"
    out.parent.mkdir(exist_ok=True)
    argv = (["export", folder, out, "--no-progress"] if layout == "ours" else
            ["convert", folder, out, "--max-shard-size", str(SHARD), "--no-progress"])
    run = cli(argv, tmp_path, timeout=120)
    line = check_refusal(run)
    assert not out.exists()
    return line.removeprefix("error: ")


def _damaged(entry, layout: str, tmp_path: Path, request) -> tuple[Path, str]:
    """A copy of `layout`'s checkpoint with one table entry's (edit, word) edit made; (the copy, the word)."""
    edit, word = entry
    folder = copy_tree(_layout(layout, request), tmp_path / "model")
    edit(folder)
    return folder, word


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("layout", ["ours", "released", "kimi_linear"])
def test_from_pretrained_refuses_what_the_cli_refuses(layout, damage, cli, tmp_path, request):
    from k3export import K3ForCausalLM
    from k3export.errors import CheckpointError

    folder, word = _damaged(DAMAGE[damage], layout, tmp_path, request)
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError) as err:
        K3ForCausalLM.from_pretrained(folder)
    message = " ".join(str(err.value).split())
    assert word in message, message
    assert snapshot(tmp_path) == before  # the API read only
    assert _cli_line(cli, folder, tmp_path, layout) == message


@pytest.mark.parametrize("damage", list(CONFIG_DAMAGE))
@pytest.mark.parametrize("layout", ["ours", "released", "kimi_linear"])
def test_the_shared_check_refuses_a_bad_config_with_the_cli_line(layout, damage, cli, tmp_path, request):
    from k3export.converters.checkpoints.loader import check_folder
    from k3export.errors import CheckpointError

    folder, word = _damaged(CONFIG_DAMAGE[damage], layout, tmp_path, request)
    with pytest.raises(CheckpointError) as err:
        check_folder(folder)
    message = " ".join(str(err.value).split())
    assert word in message and "config.json" in message, message
    assert _cli_line(cli, folder, tmp_path, layout) == message


def _config_params():
    """(layout, damage): each through from_pretrained, which must give the CLI's line."""
    return [pytest.param(layout, damage, id=f"{layout}-{damage}")
            for layout in ("ours", "released") for damage in CONFIG_DAMAGE]


@pytest.mark.parametrize("layout, damage", _config_params())
def test_from_pretrained_refuses_a_bad_config_with_the_cli_line(layout, damage, tmp_path, request):
    from k3export import K3ForCausalLM
    from k3export.converters.checkpoints.loader import check_folder
    from k3export.errors import CheckpointError

    folder, _ = _damaged(CONFIG_DAMAGE[damage], layout, tmp_path, request)
    with pytest.raises(CheckpointError) as cli_check:  # the line `convert` / `export` print (the test above)
        check_folder(folder)
    with pytest.raises(CheckpointError) as err:
        K3ForCausalLM.from_pretrained(folder)
    assert str(err.value) == str(cli_check.value)


def _poison(folder: Path) -> tuple[str, str]:
    """A NaN in the first ``o_proj.weight`` of `folder`; (its shard's name, the stored tensor name)."""
    for shard in _shards(folder):
        with safe_open(str(shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        name = next((k for k in tensors if k.endswith("o_proj.weight")), None)
        if name is not None:
            tensors[name][0, 1] = float("nan")
            save_file(tensors, str(shard), metadata={"format": "pt"})
            return shard.name, name
    raise AssertionError("no o_proj.weight")


@pytest.mark.parametrize("layout", ["ours", "released", "kimi_linear"])
def test_from_pretrained_warns_on_nan_weights_naming_the_tensor(layout, cli, tmp_path, request):
    from k3export import K3ForCausalLM
    from k3export.converters.checkpoints.safetensors_io import NonFiniteWeightsWarning

    folder = copy_tree(_layout(layout, request), tmp_path / "model")
    shard, name = _poison(folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = K3ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    ours = [str(w.message) for w in caught if issubclass(w.category, NonFiniteWeightsWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    # the parameter really holds the NaN (loaded as is, not silently repaired)
    param = dict(model.named_parameters())[name.removeprefix("language_model.")]
    assert torch.isnan(param[0, 1]) and int(torch.isnan(param).sum()) == 1
    line = _cli_line(cli, folder, tmp_path, layout)
    note = line.split(" (refused")[0]
    assert note == f"{shard}: tensor {name!r} has 1 NaN/Inf values", line
    assert ours[0].startswith(note + " (loaded as is"), ours[0]


@pytest.mark.parametrize("where", ["graph", "function body"])
def test_load_export_refuses_an_unknown_k3_op_naming_it(where, exported, tmp_path):
    """An op of the k3 domain that no runtime of ours implements is refused when the export is loaded, not by a
    runtime later; the known ops (`LIBRARY_SPECS`: the plugin ops and the fused ops) all load."""
    import onnx

    from k3export.artifacts import ArtifactError, load_export
    from k3export.ops.spec import LIBRARY_SPECS

    folder = copy_tree(exported, tmp_path / "onnx")
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    assert {n.op_type for n in model.graph.node if n.domain == "k3"} <= set(LIBRARY_SPECS)
    load_export(folder)
    if where == "graph":
        node = next(n for n in model.graph.node if n.domain == "k3")
    else:  # a function body calling a k3 op of another name
        node = onnx.helper.make_node("situ_glu_v2", ["x"], ["y"], domain="k3")
        model.functions[0].node.append(node)
    node.op_type = "situ_glu_v2"
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ArtifactError, match="'situ_glu_v2', which no k3export runtime implements") as err:
        load_export(folder)
    assert "model.onnx" in str(err.value)
