"""TCPStores bound to one address (runtime/store.py): a client that comes before its server waits for the port
to listen instead of sleeping out torch's connect back-off; the probe leaves the server working."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from stalwart.runtime.store import bound_listener, probe, serve_on, tcp_store

LOOPBACK = "127.0.0.1"


def _reserved_port() -> socket.socket:
    """A socket bound to a free loopback port and not listening: connections to it are refused."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    return sock


def test_the_wait_ends_when_the_port_listens_and_gives_up_at_its_deadline() -> None:
    closed = _reserved_port()
    listener = bound_listener(LOOPBACK, 0)
    try:
        assert probe(LOOPBACK, closed.getsockname()[1], 0.05) == "timeout"
        assert probe(LOOPBACK, listener.getsockname()[1], 5.0) == "listening"
        # Not refused but unreachable: no retries until the deadline, the caller's connect reports it.
        assert probe("name.invalid", 1, 30.0) == "unreachable"
        assert probe(LOOPBACK, closed.getsockname()[1], 0.05) == "timeout"
    finally:
        closed.close()
        listener.close()


def test_a_client_made_before_its_server_connects_once_the_server_listens() -> None:
    reserved = _reserved_port()
    port = reserved.getsockname()[1]
    got: dict[str, object] = {}
    probing = threading.Event()

    def client() -> None:
        probing.set()
        try:
            store = tcp_store(LOOPBACK, port, is_server=False, timeout=timedelta(seconds=60), world_size=2)
            store.set("from-client", "1")
            got["value"] = store.get("from-server")
        except Exception as exc:  # reported by the assertion below
            got["error"] = exc

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    probing.wait(10)
    assert probe(LOOPBACK, port, 0.05) == "timeout", "the port accepted before the server existed"
    reserved.listen(socket.SOMAXCONN)
    server = serve_on(reserved, LOOPBACK, 2, timeout=timedelta(seconds=60), wait_for_workers=False)
    server.set("from-server", "2")
    thread.join(60)
    assert not thread.is_alive(), "the client never connected"
    assert "error" not in got, got.get("error")
    assert got["value"] == b"2"
    assert server.get("from-client") == b"1"


def test_a_client_whose_server_never_listens_fails_at_its_timeout_with_torchs_store_error() -> None:
    closed = _reserved_port()
    try:
        with pytest.raises(dist.DistStoreError, match="no store server listening"):
            tcp_store(LOOPBACK, closed.getsockname()[1], is_server=False, timeout=timedelta(seconds=0.2))
    finally:
        closed.close()
