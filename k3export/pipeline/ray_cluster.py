# Copyright 2026 the k3export authors. Apache-2.0.
"""Joining a Ray cluster in bounded time: a cluster address is checked before ``ray.init`` sees it.

``ray.init(address="HOST:PORT")`` with no cluster there retries its GCS connection for minutes, printing Ray's own
time-out warnings. `check_ray_address` first opens a TCP connection to the address (``HOST:PORT``, or the client
server of ``ray://HOST:PORT``) and refuses, within `RAY_CONNECT_TIMEOUT_S` seconds and in one line naming the
address, one where nothing listens. ``auto``, ``local`` and no address at all are Ray's to resolve (it fails at
once without a running cluster). Used by ``convert --ray`` and by the Ray pipeline runner.
"""

from __future__ import annotations

import os
import socket

from k3export.errors import K3ExportError

RAY_CONNECT_TIMEOUT_S = 10.0  # the longest a wrong --ray-address / RAY_ADDRESS takes to be refused


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of an address naming one (``HOST:PORT``, ``ray://HOST:PORT``, ``[v6]:PORT``), else None."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def check_ray_address(address: str | None, timeout_s: float = RAY_CONNECT_TIMEOUT_S,
                      option: str = "--ray-address") -> None:
    """Refuse, within `timeout_s`, a cluster address where nothing accepts a connection (see the module
    docstring). `address` None means ``RAY_ADDRESS`` (as Ray reads it); `option` is how the refusal names it."""
    if address is None:
        address, option = os.environ.get("RAY_ADDRESS") or None, "RAY_ADDRESS"
    if not address or address in ("auto", "local"):
        return
    target = _host_port(address)
    if target is None:
        raise K3ExportError(f"{option} {address!r}: not a Ray cluster address (auto, HOST:PORT or ray://HOST:PORT)")
    if not 0 < target[1] < 65536:
        raise K3ExportError(f"{option} {address}: port {target[1]} is out of range (1 to 65535)")
    try:
        with socket.create_connection(target, timeout=timeout_s):
            pass
    except socket.timeout:
        why = f"no answer within {timeout_s:.0f} s"
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
    else:
        return
    raise K3ExportError(f"{option} {address}: no Ray cluster answers there ({why}; checked within {timeout_s:.0f} s)"
                        "; start one (ray start --head) or give the address of a running one")


__all__ = ["RAY_CONNECT_TIMEOUT_S", "check_ray_address"]
