"""A node lost whole, known at once: the agents of a job on several nodes knock on each other's door.

Why: when a node's agent dies (its process killed, its container gone, its host rebooted), torch's rendezvous keeps
the node in the last round until its keep-alive lapses (15 s by torch's settings, 6 s under `--nnodes MIN:MAX`
here), and every other node waits that long before the job goes on. Each agent of a job on several nodes listens
on a port of its own (its lifeline, on the address that reaches the rendezvous store) and publishes it in the
rendezvous store. An agent waiting in a rendezvous for nodes of the last round to leave knocks on theirs: a
refused connection means the host answered and nothing listens there, so that node's agent is gone, and the node
is taken out of the round as torch's own sanitizer would (runtime/torch_compat_rendezvous.mark_gone). A host that
does not answer at all, or a knock that times out, proves nothing: the keep-alive decides, as before.
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any

from stalwart.runtime.store import bound_listener
from stalwart.runtime.torch_compat_rendezvous import blocking_nodes, mark_gone, node_key, this_node
from stalwart.supervisor.peer_check import route_address

KEY = "stalwart/lifeline"
KNOCK_TIMEOUT_S = 0.5
"""How long a knock waits for the connection: a refusal comes back in a round trip; anything slower proves nothing."""
KNOCK_EVERY_S = 1.0
"""How often one agent knocks on the same node while it waits."""


class Lifeline:
    """This agent's listening port, published under its rendezvous node's name; and its knocks on others'."""

    def __init__(self, store: Any, handler: Any, store_host: str) -> None:
        self._store = store
        self._handler = handler
        self._knocked: dict[str, float] = {}
        self._told: set[str] = set()  # nodes already reported gone (a lost write of the state is marked again)
        self._sock: socket.socket | None = None
        me = this_node(handler)
        if me is None:
            return
        with contextlib.suppress(OSError):  # no lifeline: the others wait for this node's keep-alive, as before
            sock = bound_listener(route_address(store_host, 0), 0)
            host, port = sock.getsockname()[:2]
            store.set(f"{KEY}/{node_key(me)}", f"{host}\n{port}")
            self._sock = sock  # open for the agent's life: the kernel answers the knocks

    def knock(self) -> list[str]:
        """Knock on every node the waiting round is held by (at most once a second each); those whose agent is
        gone are taken out of the round. The names of those found gone for the first time."""
        gone = []
        now = time.monotonic()
        for node in blocking_nodes(self._handler):
            name = node_key(node)
            if now - self._knocked.get(name, -KNOCK_EVERY_S) < KNOCK_EVERY_S:
                continue
            self._knocked[name] = now
            if _refused(self._store, name) and mark_gone(self._handler, node) and name not in self._told:
                self._told.add(name)
                gone.append(name)
        return gone


def _refused(store: Any, name: str) -> bool:
    """Whether the node's lifeline refuses a connection (its agent is gone). Unknown (no lifeline published, a
    timeout, an unreachable host) is False."""
    key = f"{KEY}/{name}"
    try:
        if not store.check([key]):
            return False
        host, port = store.get(key).decode().split("\n")
        with socket.create_connection((host, int(port)), timeout=KNOCK_TIMEOUT_S):
            return False
    except ConnectionRefusedError:
        return True
    except Exception:
        return False
