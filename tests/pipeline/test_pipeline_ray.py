"""The Ray runner on a local cluster (ray.init(num_cpus=2)): 2 and 3 stage actors give the greedy tokens of the
single graph and of the PyTorch model, at batch 1 and at batch 2 with left padding; state stays on the actors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3export.pipeline.runner import PipelineRunner
from k3export.runtime import OrtRunner, greedy_decode, left_pad

STEPS = 5
PROMPTS = {1: [[5, 6, 7, 8, 9, 10]], 2: [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]]}


@pytest.fixture(scope="module", params=[2, 3], ids=["2-actors", "3-actors"])
def ray_runner(request, ray_cluster, tiny_exports):
    from k3export.pipeline.ray_runner import RayPipelineRunner

    runner = RayPipelineRunner(tiny_exports[request.param])
    yield runner
    runner.close()


def _torch_tokens(model, ids, mask) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=STEPS + 1,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


@pytest.mark.parametrize("batch", [1, 2])
def test_ray_greedy_tokens_equal_single_graph_and_torch(ray_runner, tiny, tiny_exports, batch):
    ids, mask = left_pad(PROMPTS[batch])
    ray_tokens = greedy_decode(ray_runner, ids, STEPS, mask).tokens
    single = greedy_decode(OrtRunner(tiny_exports[1]), ids, STEPS, mask).tokens
    np.testing.assert_array_equal(ray_tokens, single)
    np.testing.assert_array_equal(ray_tokens, _torch_tokens(tiny, ids, mask))


def test_actors_are_placed_one_per_stage(ray_runner):
    info = ray_runner.placement_info
    assert [tuple(i["layers"]) for i in info] == [(r.start, r.stop) for r in ray_runner.pipeline.ranges]
    assert len({i["pid"] for i in info}) == len(info)  # one process per stage
    assert "Ray actors" in ray_runner.describe()


def test_state_stays_on_its_actor_and_round_trips(ray_runner, tiny_exports):
    from k3export.pipeline.ray_runner import RemoteState, RemoteTensor

    ids, mask = left_pad(PROMPTS[2])
    local = PipelineRunner(tiny_exports[len(ray_runner.actors)])
    out = ray_runner.forward(ids, ray_runner.initial_state(2), mask)
    ref = local.forward(ids, local.initial_state(2), mask)
    assert isinstance(out.state, RemoteState) and sorted(out.state) == sorted(ref.state)
    for name, value in ref.state.items():
        remote = out.state[name]
        assert isinstance(remote, RemoteTensor) and remote.shape == value.shape  # known without a round trip
        np.testing.assert_allclose(np.asarray(remote), value, atol=1e-5)  # micro-batches: another GEMM blocking
    # fed back: nothing shipped; a plain dict (here: the in-process runner's state) is shipped to the actors
    nxt = np.array([[3], [4]])
    mask2 = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    a = ray_runner.forward(nxt, out.state, mask2)
    b = ray_runner.forward(nxt, ref.state, mask2)
    c = local.forward(nxt, ref.state, mask2)
    np.testing.assert_allclose(a.logits, c.logits, atol=1e-4)
    np.testing.assert_allclose(b.logits, c.logits, atol=1e-5)


def test_actors_keep_the_last_logits_when_asked(ray_runner, tiny_exports):
    ids, mask = left_pad(PROMPTS[2])
    full = OrtRunner(tiny_exports[1]).forward(ids, ray_runner.initial_state(2), mask).logits
    ray_runner.logits_to_keep = 1
    try:
        kept = ray_runner.forward(ids, ray_runner.initial_state(2), mask).logits
    finally:
        ray_runner.logits_to_keep = 0
    assert kept.shape == (2, 1, full.shape[-1])
    np.testing.assert_allclose(kept, full[:, -1:], atol=1e-5)


def test_micro_batches_do_not_change_tokens(ray_runner):
    ids, mask = left_pad(PROMPTS[2])
    base = greedy_decode(ray_runner, ids, 2, mask).tokens
    ray_runner.micro_batches = 1
    try:
        np.testing.assert_array_equal(greedy_decode(ray_runner, ids, 2, mask).tokens, base)
    finally:
        ray_runner.micro_batches = None


def test_validate_compares_pipeline_and_ray_with_torch(ray_runner, tiny, tiny_exports):
    """The existing scenarios (decode, chunked prefill, left-padded batch) over both pipeline runners."""
    if len(ray_runner.actors) != 3:
        pytest.skip("once is enough: with 3 actors")
    from k3export.runtime import Target, TorchRunner
    from k3export.validate.api import make_runner, runners
    from k3export.validate.compare import Tolerances
    from k3export.validate.core import validate
    from k3export.validate.scenarios import make_scenarios

    assert {"pipeline", "ray"} <= set(runners())
    pipe = make_runner("pipeline", Target(onnx_dir=tiny_exports[len(ray_runner.actors)]))
    reference = TorchRunner(tiny)
    result = validate(reference, [pipe, ray_runner], make_scenarios(tiny.config.vocab_size, prompt_len=8, steps=4),
                      Tolerances.parse(None, reference.manifest.dtype))
    assert {r.runtime for r in result.runs} == {"pipeline", "ray"}
    assert result.passed, result.runs


def test_saved_forked_and_earlier_states_resume_on_the_actors(ray_runner, tiny_exports, tmp_path):
    """A state is kept on the actors while this process holds it: a prefix resumed after later calls, a fork and a
    saved file each give what the in-process runner gives from scratch; a state dropped here is released there."""
    import gc

    from k3export.artifacts import State

    local = PipelineRunner(tiny_exports[len(ray_runner.actors)])
    prefix = ray_runner.prefill(np.array([PROMPTS[1][0]]))
    later = ray_runner.prefill(np.array([[11, 12]]), prefix)
    ray_runner.prefill(np.array([[13]]), later)  # more calls: the prefix's version must still be held
    path = prefix.save(tmp_path / "p.k3state")
    for what, start in (("resumed", prefix), ("forked", ray_runner.fork(prefix)),
                        ("loaded", State.load(path, ray_runner))):
        got = ray_runner.prefill(np.array([[7, 8]]), start)
        want = local.prefill(np.array([PROMPTS[1][0] + [7, 8]]))
        np.testing.assert_allclose(got.logits, want.logits[:, -2:], atol=1e-4, err_msg=what)
        for name in want.state:
            np.testing.assert_allclose(np.asarray(got.state[name]), want.state[name], atol=1e-4, err_msg=what)
    with pytest.raises(Exception, match="field 'export_sha256'"):
        State.load(path, OrtRunner(tiny_exports[1]))  # a pipeline's state is not its single graph's
    held = ray_runner._get(ray_runner.actors[0].__ray_call__.remote(lambda a: sorted(a.states)))
    del prefix, later, got, start
    gc.collect()
    import time

    time.sleep(0.5)
    after = ray_runner._get(ray_runner.actors[0].__ray_call__.remote(lambda a: sorted(a.states)))
    assert len(after) < len(held), (held, after)


def test_state_scenarios_pass_on_the_actors(ray_runner, tiny):
    from k3export.runtime import TorchRunner
    from k3export.validate import validate
    from k3export.validate.state_scenarios import state_scenarios

    result = validate(TorchRunner(tiny), [ray_runner], state_scenarios(tiny.config.vocab_size, prompt_len=8))
    assert result.passed, result.localisation
    assert {r.scenario for r in result.runs} == {"prefix_reuse", "multi_turn", "fork", "rollback"}
