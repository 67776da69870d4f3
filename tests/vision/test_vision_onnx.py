"""vision.onnx and embedding.onnx (`k3export.converters.onnx.vision`) against the PyTorch tower + projector (itself
held to a float64 reference in test_vision_tower.py) and against that float64 reference directly: ONNX Runtime and
the ONNX reference evaluator, one image, packs of images of different sizes with a video chunk (the graph has no grid
baked in: every grid here is new to it), query blocks smaller than an image; the embedding graph's splice against a
splice written by hand; exports from a checkpoint folder, graph-only at full size, and the refusals."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from k3export.converters.onnx.vision import (EMBED_TOKENS, EMBEDDING_FILE, IMAGE_FEATURES, IMAGE_GRID_THW,
                                             INPUTS_EMBEDS, NUM_IMAGE_TOKENS, NUM_PATCHES, PIXEL_VALUES, VISION_FILE,
                                             build_vision_proto, export_vision)
from k3export.errors import K3ExportError
from k3export.modeling import tiny_model, tiny_vision_model
from k3export.modeling.configuration_k3 import K3VLConfig
from k3export.modeling.contract import vision_feeds
from k3export.modeling.modeling_k3_vision import K3VisionInputError, expected_vision_tensors
from k3export.validate.compare import DEFAULT_TOLERANCES, compare

#: (frames, rows, columns): the stored 6x6 position grid as is, smaller, wider, taller, one merge block, and a
#: 2-frame video chunk (the tiny tower's init_pos_emb_time) inside the pack
PACK = [(1, 2, 4), (1, 4, 10), (2, 4, 2), (1, 6, 6), (1, 8, 2), (1, 2, 2)]
#: what the measured fp32 error stays under (ORT and the reference evaluator vs PyTorch: ~2e-6 on O(1) outputs)
FP32_MAX_ABS = 2e-5


@pytest.fixture(scope="module")
def model():
    return tiny_vision_model(seed=1)


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    return export_vision(model, tmp_path_factory.mktemp("vision") / "export")


@pytest.fixture(scope="module")
def session(exported):
    return ort.InferenceSession(str(exported.out_dir / VISION_FILE), providers=["CPUExecutionProvider"])


def _pixels(model, grids, seed=0) -> torch.Tensor:
    cfg = model.config.vision_config
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), cfg.in_channels, cfg.patch_size, cfg.patch_size,
                       generator=gen)


def _torch_features(model, pixels, grids) -> np.ndarray:
    with torch.no_grad():
        return model.get_image_features(pixels, torch.tensor(grids)).numpy()


def _check(got: np.ndarray, want: np.ndarray, dtype: str = "float32", max_abs: float = FP32_MAX_ABS) -> float:
    """The validation tolerance of `dtype` (what ``k3export validate`` applies), and the measured bound; returns
    the max abs error."""
    m = compare(got, want, "hidden", DEFAULT_TOLERANCES[dtype])
    assert m.passed, m.reason
    err = float(np.abs(got.astype(np.float64) - want).max())
    assert err < max_abs, f"max abs error {err:.2e}"
    assert np.abs(want).max() > 0.5  # O(1) outputs: the tolerance means something
    return err


@pytest.mark.parametrize("grids", [[(1, 6, 6)], [(1, 10, 4)], [(2, 6, 4)]], ids=["stored-grid", "resized", "video"])
def test_one_image_matches_pytorch(model, session, grids):
    px = _pixels(model, grids)
    (got,) = session.run(None, vision_feeds(model.config.vision_config, px, grids))
    want = _torch_features(model, px, grids)
    assert got.shape == want.shape == (sum(h * w // 4 for _, h, w in grids), model.config.text_config.hidden_size)
    _check(got, want)


def test_pack_of_different_sizes_matches_pytorch_and_float64(model, session):
    from test_vision_tower import reference_image

    px = _pixels(model, PACK, seed=3)
    (got,) = session.run(None, vision_feeds(model.config.vision_config, px, PACK))
    _check(got, _torch_features(model, px, PACK))
    weights = {k: v.detach() for k, v in model.named_parameters() if k.startswith(("vision_tower.", "mm_projector."))}
    counts = np.cumsum([0] + [t * h * w for t, h, w in PACK])
    want = torch.cat([reference_image(weights, model.config.vision_config, px[a:b], g)
                      for a, b, g in zip(counts[:-1], counts[1:], PACK)]).numpy()
    _check(got, want)


def test_reference_evaluator_agrees(model, exported):
    """The standard's own semantics: the graph means what the PyTorch tower computes (Loop, Gather, ...)."""
    ref = ReferenceEvaluator(onnx.load(str(exported.out_dir / VISION_FILE)))
    px = _pixels(model, PACK, seed=4)
    (got,) = ref.run(None, vision_feeds(model.config.vision_config, px, PACK))
    _check(got, _torch_features(model, px, PACK))


def test_query_blocks_smaller_than_an_image(model):
    """Images cut into several query blocks, the last one ragged (3 rows of a 4-, 8- and 40-patch image)."""
    proto, b = build_vision_proto(model.config.vision_config, "fp32", query_block=3)
    state = model.state_dict()
    proto.graph.initializer.extend(numpy_helper.from_array(state[s.name].numpy(), s.name) for s in b.weights.values())
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    px = _pixels(model, PACK, seed=5)
    (got,) = sess.run(None, vision_feeds(model.config.vision_config, px, PACK))
    _check(got, _torch_features(model, px, PACK))


def test_fp16_graph_within_fp16_tolerance(model, tmp_path):
    result = export_vision(model, tmp_path / "fp16", dtype="fp16")
    sess = ort.InferenceSession(str(result.out_dir / VISION_FILE), providers=["CPUExecutionProvider"])
    px = _pixels(model, PACK, seed=6)
    feeds = vision_feeds(model.config.vision_config, px, PACK)
    (got,) = sess.run(None, {**feeds, PIXEL_VALUES: feeds[PIXEL_VALUES].astype(np.float16)})
    assert got.dtype == np.float16
    _check(got.astype(np.float32), _torch_features(model, px, PACK), "float16", max_abs=2e-2)


def test_embedding_splice_equals_a_splice_by_hand(model, exported):
    pad = model.config.media_placeholder_token_id
    d = model.config.text_config.hidden_size
    table = model.get_input_embeddings().weight.detach().numpy()
    sess = ort.InferenceSession(str(exported.out_dir / EMBEDDING_FILE), providers=["CPUExecutionProvider"])
    ids = np.array([[5, pad, pad, 7, pad, 9], [pad, 1, pad, pad, 11, 12]], np.int64)
    feats = np.random.default_rng(0).standard_normal((int((ids == pad).sum()), d)).astype(np.float32)

    def by_hand(ids: np.ndarray, feats: np.ndarray) -> np.ndarray:
        out, k = table[ids].copy(), 0
        for b in range(ids.shape[0]):
            for t in range(ids.shape[1]):
                if ids[b, t] == pad and k < len(feats):  # the k-th placeholder, batch row-major
                    out[b, t], k = feats[k], k + 1
        return out

    (got,) = sess.run(None, {"input_ids": ids, IMAGE_FEATURES: feats})
    assert got.shape == (2, 6, d) and np.array_equal(got, by_hand(ids, feats))
    assert not np.array_equal(got, table[ids])
    with torch.no_grad():  # the PyTorch model's own splice agrees
        assert np.array_equal(got, model.splice_image_features(torch.from_numpy(ids), torch.from_numpy(feats)).numpy())
    # a decode step: no image tokens; a placeholder id generated then keeps its own embedding
    none = np.zeros((0, d), np.float32)
    for step in ([[42], [3]], [[pad], [7]]):
        step = np.array(step, np.int64)
        (got,) = sess.run(None, {"input_ids": step, IMAGE_FEATURES: none})
        assert np.array_equal(got, table[step])
    (got,) = sess.run(None, {"input_ids": ids, IMAGE_FEATURES: feats[:2]})  # fewer features than placeholders
    assert np.array_equal(got, by_hand(ids, feats[:2]))
    ref = ReferenceEvaluator(onnx.load(str(exported.out_dir / EMBEDDING_FILE)))
    assert np.array_equal(ref.run(None, {"input_ids": ids, IMAGE_FEATURES: feats})[0], by_hand(ids, feats))


def test_export_folder(exported, model):
    files = sorted(p.name for p in exported.out_dir.iterdir() if not p.name.startswith("."))
    assert files == ["embedding.onnx", "embedding.onnx.data.00000", "vision.onnx", "vision.onnx.data.00000"]
    assert not [p for p in exported.out_dir.parent.iterdir() if "partial" in p.name]
    graph = onnx.load(str(exported.out_dir / VISION_FILE), load_external_data=False).graph
    assert [i.name for i in graph.input] == [PIXEL_VALUES, IMAGE_GRID_THW]
    assert [d.dim_param for d in graph.input[0].type.tensor_type.shape.dim][:1] == [NUM_PATCHES]
    assert [o.name for o in graph.output] == [IMAGE_FEATURES]
    assert graph.output[0].type.tensor_type.shape.dim[0].dim_param == NUM_IMAGE_TOKENS
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer
               if t.name in expected_vision_tensors(model.config))
    emb = onnx.load(str(exported.out_dir / EMBEDDING_FILE), load_external_data=False).graph
    assert [o.name for o in emb.output] == [INPUTS_EMBEDS] and EMBED_TOKENS in {t.name for t in emb.initializer}


def test_checkpoint_folder_export_matches_its_model(tmp_path):
    from k3export.converters.checkpoints.synthetic_vision import write_vision_checkpoint
    from k3export.modeling.modeling_k3_vision import K3ForConditionalGeneration

    ckpt = write_vision_checkpoint(tmp_path / "ckpt", dtype=torch.float32)
    result = export_vision(ckpt, tmp_path / "export")
    loaded = K3ForConditionalGeneration.from_pretrained(ckpt)
    sess = ort.InferenceSession(str(result.out_dir / VISION_FILE), providers=["CPUExecutionProvider"])
    grids = [(1, 4, 6), (2, 2, 2)]
    px = _pixels(loaded, grids, seed=7)
    (got,) = sess.run(None, vision_feeds(loaded.config.vision_config, px, grids))
    _check(got, _torch_features(loaded, px, grids))
    emb = ort.InferenceSession(str(result.out_dir / EMBEDDING_FILE), providers=["CPUExecutionProvider"])
    ids = np.array([[1, 2, 3, 4]], np.int64)
    (embeds,) = emb.run(None, {"input_ids": ids, IMAGE_FEATURES: np.zeros((0, got.shape[1]), np.float32)})
    assert np.array_equal(embeds, loaded.get_input_embeddings().weight.detach().numpy()[ids])


def test_full_size_graphs_without_weights(tmp_path):
    config = K3VLConfig()  # the released sizes: 27 layers, 1024 wide, into the 7168-wide text model
    result = export_vision(config, tmp_path / "k3", weights=False, dtype="bf16")
    assert not result.weights_materialized
    assert sorted(p.name for p in result.out_dir.iterdir() if not p.name.startswith(".")) == [EMBEDDING_FILE,
                                                                                               VISION_FILE]
    params = sum(int(np.prod(s)) for s in expected_vision_tensors(config).values())
    assert result.vision.weight_bytes == 2 * params
    assert result.embedding.weight_bytes == 2 * config.text_config.vocab_size * config.text_config.hidden_size
    graph = onnx.load(str(result.out_dir / VISION_FILE), load_external_data=False).graph
    loops = [n for n in graph.node if n.op_type == "Loop"]
    assert len(loops) == config.vision_config.vt_num_hidden_layers  # one per-image attention loop per layer
    out = graph.output[0].type.tensor_type
    assert out.elem_type == onnx.TensorProto.BFLOAT16 and out.shape.dim[1].dim_value == 7168


def test_refusals_write_nothing(model, tmp_path):
    bad = tiny_vision_model(seed=1)
    with torch.no_grad():
        bad.vision_tower.encoder.blocks[1].wo.weight[0, 0] = float("nan")
    out = tmp_path / "out"
    for what, phrase in ((bad, "holds NaN or Inf"), (tiny_model(), "has no vision tower"),
                         (K3VLConfig.tiny(), "has no weights")):
        with pytest.raises(K3ExportError, match=phrase) as info:
            export_vision(what, out)
        assert "\n" not in str(info.value)
        assert os.listdir(tmp_path) == []  # neither the folder nor a partial sibling
    out.mkdir()
    (out / "mine.txt").write_text("x")
    with pytest.raises(K3ExportError, match="not empty"):
        export_vision(model, out)
    assert os.listdir(out) == ["mine.txt"]


@pytest.mark.parametrize("pixels, grid, phrase", [
    ((8, 3, 4, 4), [[1, 2, 2]], "covers 4 patches but pixel_values has 8"),
    ((4, 3, 14, 14), [[1, 2, 2]], r"pixel_values must be \[patches, 3, 4, 4\]"),
    ((12, 48), [[3, 2, 2]], "init_pos_emb_time = 2"),
    ((4, 48), np.zeros((0, 3)), "at least one image"),
])
def test_bad_feeds_are_refused_in_one_line(model, pixels, grid, phrase):
    with pytest.raises(K3VisionInputError, match=phrase) as info:
        vision_feeds(model.config.vision_config, np.zeros(pixels, np.float32), grid)
    assert "\n" not in str(info.value)
