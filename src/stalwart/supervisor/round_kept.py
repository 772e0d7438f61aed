"""Which workers survived a failure, across nodes: what survivors that train on shrunk must know (recovery/shrink.py).

Each agent knows only its own node's kept workers. In a re-formed round of several nodes each agent publishes its
node's kept global ranks in the round's store (torch elastic's prefix of the rendezvous store, new each round) and
reads every node's; node 0 adds a token naming the round. The survivors then meet, form their own group and learn
that the replacements are ready under that token in the rendezvous store, which every node reaches
(SHRUNK_STORE_ENV). On one node the agent knows every worker and files on the node serve.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

from stalwart.runtime.env import KEPT_RANKS_ENV, SHRUNK_STORE_ENV

KEY = "stalwart/round_kept"
SHARE_TIMEOUT_S = 10.0
"""How long an agent waits for the other nodes' kept ranks. Every agent publishes them as it starts the round's
workers, right after the rendezvous they all left together; one that did not in this time (it failed meanwhile)
leaves the survivors waiting for the replacement, as before this module."""


def share(store: Any, node: int, nodes: int, kept: list[int]) -> tuple[list[int], str] | None:
    """Every node's kept global ranks (ascending) and the round's token; None when some node did not say in time
    or the store failed (the survivors then wait for their replacements)."""
    token_key = f"{KEY}/token"
    keys = [f"{KEY}/kept/{i}" for i in range(nodes)]
    try:
        store.set(keys[node], ",".join(str(r) for r in kept))
        if node == 0:
            store.set(token_key, secrets.token_hex(8))
        store.wait([*keys, token_key], timedelta(seconds=SHARE_TIMEOUT_S))
        texts = [store.get(k).decode() for k in keys]
        token = store.get(token_key).decode()
    except Exception:  # a timeout, or a store that went away with the round
        return None
    ranks = sorted(int(r) for text in texts for r in text.split(",") if r)
    return ranks, token


def worker_env(survivors: list[int], world_size: int, store_address: str | None, token: str | None) -> dict[str, str]:
    """The environment every worker of the round gets: the survivors' global ranks when some ranks were kept and
    some are new (KEPT_RANKS_ENV), and on several nodes the store they meet in (SHRUNK_STORE_ENV)."""
    if not survivors or len(survivors) >= world_size:
        return {}
    env = {KEPT_RANKS_ENV: ",".join(str(r) for r in survivors)}
    if store_address is not None and token is not None:
        env[SHRUNK_STORE_ENV] = f"{store_address}/{token}"
    return env
