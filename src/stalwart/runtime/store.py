"""TCPStores that listen on one address, never on every interface.

torch's TCPStore server binds the wildcard address whatever host name it is given, so an unauthenticated
key-value store (the rendezvous state, the process group's bootstrap) was reachable from any network the
machine is on. A store created here listens on a socket bound to the address it was given: loopback for a
one-node run, the rendezvous endpoint's or MASTER_ADDR's address on several nodes (docs/architecture.md).

A client created here also waits for its server's port to accept before torch's client connects. torch's client
retries a refused connection after a randomized, growing back-off (0.25-0.73 s on the 2-core VM when the server
came up 20-200 ms after the client, docs/benchmarks.md), and a re-formed group meets exactly that: a survivor
reaches the new round's store while the rank that hosts it is still being started.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist


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

    Raises OSError when `is_server` and the address cannot be bound (taken, or not this host's).
    """
    if not is_server:
        wait_listening(host, port, timeout.total_seconds())
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, multi_tenant=True)
    sock = bound_listener(host, port)
    try:
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=wait_for_workers,
            multi_tenant=True,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store


PROBE_INTERVAL_S = 0.001
"""Between two probes of a port that refused: a refused connect is one cheap system call, so poll often."""


def wait_listening(host: str, port: int, timeout_s: float) -> bool:
    """Wait until something accepts TCP connections at `host`:`port`; whether it did within `timeout_s`.

    Only a refused or reset connection is retried; any other error (a name that does not resolve, no route)
    returns False at once, as does the deadline, and the caller's own connect then reports it in its words.
    The probe's connection is closed without a byte sent, which a TCPStore server takes as a client leaving.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((host, port), timeout=left):
                return True
        except (ConnectionRefusedError, ConnectionResetError):
            time.sleep(PROBE_INTERVAL_S)
        except OSError:
            return False
