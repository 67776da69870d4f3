"""Shared fixtures. Tests run on CPU; Triton kernels run under TRITON_INTERPRET=1 (set before triton loads)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# before any test can import tensorrt_rtx: the flavour module loads the RTX parser's library first (docs/tensorrt.md)
import k3export.plugins.flavour  # noqa: E402,F401

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_k3():
    """A tiny random K3 (every feature on), fp32, eval mode. Do not mutate: copy it first."""
    from k3export.modeling import tiny_model

    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def released_random(tmp_path_factory):
    """A tiny released-layout checkpoint (``moonshotai/Kimi-K3``'s layout: MXFP4 experts of random valid values,
    vision tensors, tokenizer) in 3 shards. Shared: copy it before changing it."""
    from k3export.converters.checkpoints.synthetic import released_tiny_config, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("released_random") / "ckpt", released_tiny_config(),
                            layout="kimi_k3", expert_mode="random")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every Ray test (``ray.init(num_cpus=2)``, started once: Ray starts slowly)."""
    ray = pytest.importorskip("ray", reason="the Ray runner needs k3export[ray]")
    if not ray.is_initialized():
        os.environ.setdefault("RAY_DISABLE_DOCKER_CPU_WARNING", "1")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
