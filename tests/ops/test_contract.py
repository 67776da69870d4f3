"""One direction of imports, one contract: ops never loads modeling or converters; the naive references are a leaf;
compiling a plugin kernel loads neither modeling nor transformers; the kernels plug into the modeling file's hooks
by name and decline (the PyTorch fallback runs) whenever the backend switch says torch."""

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import k3export.ops
from k3export.modeling import modeling_k3 as mk
from k3export.ops import KERNELS, use_backend
from k3export.ops.naive import kda_naive, moe_route_naive, situ_glu_naive

from k3ops_ref import kda_inputs, max_abs

OPS_DIR = Path(k3export.ops.__file__).parent
FORBIDDEN = ("k3export.modeling", "k3export.converters", "transformers")


def _loaded_after(code: str, env: dict[str, str]) -> list[str]:
    probe = code + "\nimport json, sys; print('@@' + json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.rsplit("@@", 1)[1])


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}


def test_import_ops_loads_no_modeling_converters_or_transformers():
    loaded = _loaded_after("import k3export.ops.registry, k3export.ops.aot, k3export.plugins", dict(os.environ))
    assert "k3export.ops.kda" in loaded
    assert [m for m in loaded if m.startswith(FORBIDDEN)] == []


def test_naive_references_are_a_leaf_and_the_spec_needs_no_torch():
    assert _imports(OPS_DIR / "naive.py") == {"__future__", "torch"}
    assert _imports(OPS_DIR / "spec.py") <= {"__future__", "math", "dataclasses", "typing", "k3export.dtypes",
                                              "k3export.errors"}


@pytest.mark.slow
def test_compiling_a_plugin_kernel_loads_no_modeling_or_transformers():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile in-process, as on a build box
    code = ("from k3export.ops.aot import compile_kernel\n"
            "k = compile_kernel('situ_glu', 'bf16', {'beta1': 4.0, 'beta2': 25.0})\n"
            "assert k.entry == 'situ_glu_kernel'")
    assert [m for m in _loaded_after(code, env) if m.startswith(FORBIDDEN)] == []


@pytest.fixture
def plugged():
    """The kernels registered into the modeling file's hooks (as the layer above both does), then the hooks as they
    were: `k3export.kernels.plug_in` may have registered them for the whole session, which later tests rely on."""
    before = {name: mk._KERNELS.get(name) for name in KERNELS}
    for name, kernel in KERNELS.items():
        mk.register_kernel(name, kernel)
    yield
    for name, kernel in before.items():
        mk.register_kernel(name, kernel)


def test_kernels_plug_into_the_modeling_hooks(triton_interpreter, plugged, monkeypatch):
    calls = []
    triton_kda = sys.modules["k3export.ops.kda"].kda_triton
    monkeypatch.setattr(sys.modules["k3export.ops.kda"], "kda_triton", lambda *a: calls.append(a) or triton_kda(*a))
    inp = kda_inputs(1, 6, 2, 16, 16, seed=4)
    o_ref, s_ref = kda_naive(**{n: t.double() for n, t in inp.items()}, scale=0.25)
    for backend, n_calls in (("torch", 0), ("triton", 1)):
        with use_backend(backend):
            o, s = mk.kda(*inp.values(), 0.25, 64)
        assert len(calls) == n_calls, backend  # torch: the hook declined and the modeling code ran
        assert max_abs(o, o_ref) < 1e-5 and max_abs(s, s_ref) < 1e-5, backend
    with use_backend("triton"):  # a float64 reference is outside the kernels' contract: the fallback runs
        o64, _ = mk.kda(*(t.double() for t in inp.values()), 0.25, 64)
    assert len(calls) == 1 and o64.dtype == torch.float64 and max_abs(o64, o_ref) < 1e-12

    gate, up = torch.randn(3, 40) * 4, torch.randn(3, 40) * 30
    logits, bias = torch.randn(5, 24), torch.randn(24) * 0.1
    for backend in ("torch", "triton"):
        with use_backend(backend):
            assert max_abs(mk.situ_glu(gate, up, 4.0, 25.0), situ_glu_naive(gate, up, 4.0, 25.0)) < 1e-4
            w, idx = mk.moe_route(logits, bias, 4, True, 2.5)
        w_ref, i_ref = moe_route_naive(logits, bias, 4, True, 2.5)
        assert torch.equal(idx, i_ref) and max_abs(w, w_ref) < 1e-6


def test_tiny_model_with_kernels_matches_the_pytorch_model(triton_interpreter, tiny_k3, plugged):
    """The whole tiny K3, prefill then decode, with the Triton kernels plugged in vs the PyTorch fallbacks."""
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(0))
    # a copy: the kernels restack the experts in place (`ops.expert_stacks`) into the Triton layout, and later tests
    # compare the session's model bit for bit with a fresh load of it
    model = copy.deepcopy(tiny_k3)

    def run(backend):
        cache = mk.K3Cache(model.config)
        with use_backend(backend), torch.no_grad():
            return torch.cat([model(ids[:, :5], cache=cache).logits, model(ids[:, 5:], cache=cache).logits], 1)

    torch.testing.assert_close(run("triton"), run("torch"), atol=1e-4, rtol=0)
