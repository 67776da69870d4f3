import json

import numpy as np
import pytest

from k3export.errors import K3ExportError
from k3export.validate import load_prompts, make_scenarios
from k3export.validate.scenarios import chunk_lengths


def test_scenarios_are_seeded_and_shaped():
    a = make_scenarios(512, prompt_len=16, steps=32, batch=2, seed=3)
    b = make_scenarios(512, prompt_len=16, steps=32, batch=2, seed=3)
    assert [s.name for s in a] == ["decode", "chunked_prefill", "batch"]
    for x, y in zip(a, b):
        assert np.array_equal(x.prompts, y.prompts) and x.chunks == y.chunks
    dec, chunked, batch = a
    assert dec.prompts.shape == (1, 16) and dec.steps == 32
    assert np.array_equal(chunked.prompts, dec.prompts) and sum(chunked.chunks) == 16 and 1 in chunked.chunks
    assert batch.prompts.shape == (2, 16) and not np.array_equal(batch.prompts[0], batch.prompts[1])
    assert not np.array_equal(make_scenarios(512, seed=4)[0].prompts, dec.prompts)
    assert [s.name for s in make_scenarios(512, batch=1)] == ["decode", "chunked_prefill"]


@pytest.mark.parametrize("n", [2, 3, 7, 16, 100])
def test_chunk_lengths_cover_the_prompt(n):
    c = chunk_lengths(n, seed=0)
    assert sum(c) == n and all(x > 0 for x in c) and len(c) >= 2


def test_prompts_file(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps([[5, 6, 7, 8, 9], [10, 11, 12]]))
    rows = load_prompts(p, 512)
    sc = make_scenarios(512, prompts=rows, batch=2, steps=2)
    assert sc[0].prompts.tolist() == [[5, 6, 7, 8, 9]]
    assert sc[-1].name == "batch" and sc[-1].prompts.tolist() == [[5, 6, 7], [10, 11, 12]]
    p.write_text(json.dumps([[1, 600]]))
    with pytest.raises(K3ExportError, match="outside"):
        load_prompts(p, 512)
    p.write_text(json.dumps({"a": 1}))
    with pytest.raises(K3ExportError, match="list of non-empty lists"):
        load_prompts(p, 512)
