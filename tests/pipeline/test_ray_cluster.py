"""A Ray cluster address is checked in bounded time before ``ray.init`` retries it for minutes (`ray_cluster`)."""

from __future__ import annotations

import socket
import time

import pytest

from k3export.errors import K3ExportError
from k3export.pipeline.ray_cluster import RAY_CONNECT_TIMEOUT_S, check_ray_address


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("form", ["{host}:{port}", "ray://{host}:{port}"])
def test_nothing_listening_is_refused_at_once_naming_the_address(form):
    address = form.format(host="127.0.0.1", port=_closed_port())
    t0 = time.monotonic()
    with pytest.raises(K3ExportError) as err:
        check_ray_address(address)
    assert time.monotonic() - t0 < RAY_CONNECT_TIMEOUT_S
    line = str(err.value)
    assert address in line and "--ray-address" in line and "\n" not in line


def test_a_listener_passes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_ray_address(f"127.0.0.1:{s.getsockname()[1]}")


def test_an_address_that_drops_packets_is_refused_within_the_timeout():
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never routed, so the connection neither succeeds nor is refused
    t0 = time.monotonic()
    with pytest.raises(K3ExportError, match="192.0.2.1:6379"):
        check_ray_address("192.0.2.1:6379", timeout_s=0.5)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("address, word", [("not-an-address", "HOST:PORT"), ("127.0.0.1:99999", "out of range")])
def test_malformed_addresses_are_refused(address, word):
    with pytest.raises(K3ExportError, match=word):
        check_ray_address(address)


def test_ray_address_from_the_environment_is_named_as_such(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")
    with pytest.raises(K3ExportError, match="RAY_ADDRESS"):
        check_ray_address(None)
    for resolved_by_ray in ("auto", "local", ""):
        monkeypatch.setenv("RAY_ADDRESS", resolved_by_ray)
        check_ray_address(None)
