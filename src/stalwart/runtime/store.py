"""TCPStores that listen on one address, never on every interface.

torch's TCPStore server binds the wildcard address whatever host name it is given, so an unauthenticated
key-value store (the rendezvous state, the process group's bootstrap) was reachable from any network the
machine is on. A store created here listens on a socket bound to the address it was given: loopback for a
one-node run, the rendezvous endpoint's or MASTER_ADDR's address on several nodes (docs/architecture.md).

A client created here also waits for its server's port to accept before torch's client connects. torch's client
retries a refused connection after a randomized, growing back-off (up to most of a second, docs/benchmarks.md),
and a re-formed group meets exactly that: a survivor
reaches the new round's store while the rank that hosts it is still being started.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist

from stalwart.runtime.torch_compat import LIBUV_TAKES_LISTEN_FD

_TCPStore = dist.TCPStore
"""torch's class, as it was at import: under `stalwart run` the script's `dist.TCPStore` may be another
(recovery/script_group.py), which stalwart's own stores never go through."""


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`'s address (port 0: one the OS picks). OSError if it cannot bind."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def tcp_store(
    host: str,
    port: int,
    *,
    is_server: bool,
    timeout: timedelta,
    world_size: int | None = None,
    wait_for_workers: bool = True,
) -> dist.TCPStore:
    """torch's multi-tenant TCPStore; as the server, listening on `host`'s address only.

    Raises OSError when `is_server` and the address cannot be bound (taken, or not this host's); as a client,
    torch.distributed.DistStoreError when no server listened there within `timeout`.
    """
    if not is_server:
        started = time.monotonic()
        found = probe(host, port, timeout.total_seconds())
        if found == "timeout":  # torch's own error for a store it cannot reach: callers treat it as theirs
            raise dist.DistStoreError(
                f"no store server listening at {host}:{port} within {timeout.total_seconds():g} s"
            )
        left = timeout.total_seconds() - (time.monotonic() - started) if found == "unreachable" else None
        # torch's own connect gets what is left of the wait (all of it once the port listens); the store keeps the
        # whole timeout for what follows.
        wait = timeout if left is None else timedelta(seconds=max(left, PROBE_CONNECT_S))
        store = _TCPStore(host, port, world_size, is_master=False, timeout=wait, multi_tenant=True)
        store.set_timeout(timeout)
        return store
    sock = bound_listener(host, port)
    try:
        return serve_on(sock, host, world_size, timeout=timeout, wait_for_workers=wait_for_workers)
    except BaseException:
        sock.close()
        raise


def serve_on(
    sock: socket.socket, host: str, world_size: int | None, *, timeout: timedelta, wait_for_workers: bool = True
) -> dist.TCPStore:
    """torch's multi-tenant TCPStore server on `sock`, a socket already listening; the store owns it after."""
    global _libuv_takes_fd
    serve: dict[str, object] = dict(
        is_master=True,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        multi_tenant=True,
        master_listen_fd=sock.fileno(),
    )
    if not _libuv_takes_fd:
        serve["use_libuv"] = False
    try:
        store = _TCPStore(host, sock.getsockname()[1], world_size, **serve)  # type: ignore[arg-type]
    except NotImplementedError:
        if not _libuv_takes_fd:
            raise
        _libuv_takes_fd = False  # torch 2.4's default (libuv) server cannot take a listening socket
        serve["use_libuv"] = False
        store = _TCPStore(host, sock.getsockname()[1], world_size, **serve)  # type: ignore[arg-type]
    sock.detach()  # the store's server owns the descriptor now
    return store


_libuv_takes_fd = LIBUV_TAKES_LISTEN_FD
"""Whether torch's default store server accepts a listening socket: as LIBUV_TAKES_LISTEN_FD says at first (not on
torch 2.4), then False once one refused with NotImplementedError (found out once per process)."""


PROBE_FIRST_S = 0.001
"""The first pause after a refused probe; it doubles up to PROBE_MAX_S for the first PROBE_FAST_S, then up to
PROBE_SLOW_MAX_S. A refused connect is one cheap system call, and a re-forming group's store usually comes up
within tens of milliseconds: poll often at first, then less, so that a server that takes minutes (a rank 0
still starting on another node) is not flooded by every other rank."""
PROBE_MAX_S = 0.02
PROBE_FAST_S = 1.0
PROBE_SLOW_MAX_S = 0.25
PROBE_CONNECT_S = 1.0
"""A probe's own connect timeout, per address: an address that drops packets must not hold up the others."""


def probe(host: str, port: int, timeout_s: float) -> str:
    """Wait until something accepts TCP connections at `host`:`port`, for at most `timeout_s`. The verdict:
    "listening"; "unreachable" (no address refused: no route, a name that does not resolve), at once, so that
    the caller's own connect reports it in its words; or "timeout" (still refused at the deadline).

    The name is resolved once; every address it has is tried in turn, and the probes go on while one of them
    refuses (or resets) the connection. The probe's connection is closed without a byte sent, which a TCPStore
    server takes as a client leaving.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return "unreachable"
    pause = PROBE_FIRST_S
    while True:
        refused = False
        for family, kind, proto, _, address in addresses:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(min(left, PROBE_CONNECT_S))
                try:
                    sock.connect(address)
                    return "listening"
                except (ConnectionRefusedError, ConnectionResetError):
                    refused = True
                except OSError:
                    pass
        if not refused:
            return "unreachable"
        now = time.monotonic()
        if now >= deadline:
            return "timeout"
        time.sleep(min(pause, deadline - now))
        cap = PROBE_MAX_S if now - started < PROBE_FAST_S else PROBE_SLOW_MAX_S
        pause = min(pause * 2, cap)
