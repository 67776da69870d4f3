"""Fixtures of the `k3export.hub` tests: a loopback stand-in of the Hub HTTP API (tests/hub_server.py) and real
ONNX exports of a tiny model to publish.

huggingface_hub reads HF_ENDPOINT once, at import time; the `hub` fixture therefore patches the derived module
constants (endpoint, URL template, trusted hosts), turns Xet off (the stand-in speaks the LFS protocol), and points
the cache and token file at temporary paths. Nothing but 127.0.0.1 is contacted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from hub_folders import OTHER_TOKEN, TOKEN, make_onnx_export  # noqa: E402
from hub_server import HubStandIn  # noqa: E402


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    with HubStandIn({TOKEN: "alice", OTHER_TOKEN: "bob"}) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            server.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_URL_HOSTS", frozenset(constants.HF_URL_HOSTS | {"127.0.0.1"}))
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"))
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent-harnesses.json"))
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
        yield server
        assert server.state.unknown == [], f"client called endpoints the stand-in lacks: {server.state.unknown}"


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory) -> Path:
    """A real ONNX export (fp32, with weights) of a tiny K3. Shared: copy it (`make_onnx_export`) to change it."""
    from k3export.converters.onnx import export_onnx
    from k3export.modeling import tiny_model

    out = tmp_path_factory.mktemp("hub-export") / "k3-tiny-onnx"
    export_onnx(tiny_model(seed=0), out)
    return out


@pytest.fixture(scope="session")
def graph_only_export(tmp_path_factory) -> Path:
    """A graph-only export (``weights=False``: the data shards are declared, not written) of a tiny K3 config."""
    from k3export.converters.onnx import export_onnx
    from k3export.modeling import tiny_model

    out = tmp_path_factory.mktemp("hub-graph-only") / "k3-tiny-graph"
    export_onnx(tiny_model(seed=0).config, out, weights=False)
    return out


@pytest.fixture
def onnx_export(tiny_export, tmp_path) -> Path:
    """A fresh copy of `tiny_export` with a validation.json of exactly its files and a log file beside them."""
    return make_onnx_export(tiny_export, tmp_path / "onnx")
