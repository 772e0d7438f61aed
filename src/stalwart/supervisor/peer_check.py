"""Pre-flight across nodes: the bandwidth of each node's link to the next one, measured when the job first forms.

Why: a node with a degraded NIC, a flapping cable or a misconfigured port slows every collective of the whole job
(each all-reduce waits for its slowest link), and nothing fails: the job just runs slower. The node-local
pre-flight (supervisor/preflight_gate.py) cannot see it, since it needs a peer.

How: when the nodes first form a job (every agent at its first start, before any worker runs), each agent opens a
TCP listener on its own address, publishes it in the rendezvous store, and sends PAYLOAD_MB to the next node in a
ring while receiving from the previous one. The receiver times its link from the first byte to the last. Every
agent publishes what it measured and reads all of them, so every node reaches the same verdict: a link below a
quarter of the upper quartile of all links (or below `--preflight-min-link-gbps`) is slow; a node whose incoming
and outgoing links are both slow (three or more nodes) is named as the likely cause. The upper quartile, not the
median: one bad node slows two links of the ring, which at three nodes are most of them. The verdict is reported
(`peer_bandwidth` and `peer_link_slow` events, one line), not acted on: excluding a node that may be fine would
cost more than it saves.
A node that joins later (a replacement) skips the check, as does every node when a peer does not answer in time.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

PAYLOAD_MB = 16
RELATIVE_SLOW = 0.25
TIMEOUT_S = 30.0
KEY = "stalwart/peer_check"
CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class PeerCheck:
    """What the agent needs for the check: its own address, the payload, an absolute floor (GB/s) if any."""

    address: str
    payload_mb: int = PAYLOAD_MB
    min_gbps: float | None = None


@dataclass(slots=True)
class Verdict:
    inbound_gbps: dict[int, float]
    """Node rank -> GB/s of the link from the previous node into it."""
    slow_links: list[tuple[int, int]] = field(default_factory=list)
    """(from node, to node) of each slow link."""
    suspects: list[int] = field(default_factory=list)
    """Nodes whose two links are both slow."""
    reference_gbps: float = 0.0
    """The upper quartile of the links: what a healthy link does here."""


def judge(inbound: dict[int, float], min_gbps: float | None) -> Verdict:
    """The same verdict on every node, from every node's inbound measurement."""
    nodes = len(inbound)
    values = sorted(inbound.values())
    reference = statistics.quantiles(values, n=4, method="inclusive")[2] if nodes > 1 else values[0]
    floor = max(RELATIVE_SLOW * reference, min_gbps or 0.0)
    slow = {i for i, bw in inbound.items() if bw < floor}
    links = [((i - 1) % nodes, i) for i in sorted(slow)]
    suspects = [i for i in range(nodes) if nodes >= 3 and i in slow and (i + 1) % nodes in slow]
    return Verdict(inbound, links, suspects, reference)


def measure(
    store: Any, node: int, nodes: int, address: str, payload_mb: int = PAYLOAD_MB, timeout_s: float = TIMEOUT_S
) -> dict[int, float] | None:
    """This node's part of the ring; every node's inbound GB/s, or None when a peer did not answer in time."""
    payload = bytes(CHUNK)
    total = payload_mb * CHUNK
    server = socket.create_server((address, 0))
    server.settimeout(timeout_s)
    got: dict[str, float] = {}

    def receive() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout_s)
                received, first = 0, 0.0
                while received < total:
                    chunk = conn.recv(CHUNK)
                    if not chunk:
                        return
                    if not received:
                        first = time.perf_counter()
                    received += len(chunk)
                got["gbps"] = total / max(time.perf_counter() - first, 1e-9) / 1e9
                conn.sendall(b"k")

    receiver = threading.Thread(target=receive, name="stalwart-peer-check", daemon=True)
    receiver.start()
    try:
        store.set(f"{KEY}/addr/{node}", f"{address}:{server.getsockname()[1]}")
        nxt = (node + 1) % nodes
        store.wait([f"{KEY}/addr/{nxt}"], timedelta(seconds=timeout_s))
        host, port = store.get(f"{KEY}/addr/{nxt}").decode().rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=timeout_s) as out:
            for _ in range(payload_mb):
                out.sendall(payload)
            out.recv(1)  # the receiver has it all
        receiver.join(timeout_s)
        if "gbps" not in got:
            return None
        store.set(f"{KEY}/in/{node}", repr(got["gbps"]))
        keys = [f"{KEY}/in/{i}" for i in range(nodes)]
        store.wait(keys, timedelta(seconds=timeout_s))
        return {i: float(store.get(k).decode()) for i, k in enumerate(keys)}
    except Exception:
        return None
    finally:
        server.close()


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to host:port (where the rendezvous store is)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port or 1))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
