"""The agent's rendezvous: torch elastic's c10d rendezvous, with its store bound to one address.

torch's `c10d` backend creates a TCPStore that listens on every interface. This one is the same handler
(`DynamicRendezvousHandler` over `C10dRendezvousBackend`, so several agents and torchrun interoperate), but the
agent that hosts the store listens only on the endpoint's address: 127.0.0.1 for a one-node run, the address of
`--rdzv-endpoint` on several nodes. Other backends (etcd, static, file stores) are torch's own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from stalwart.runtime.store import tcp_store
from stalwart.runtime.torch_compat_rendezvous import (
    keep_ranks,
    matches_machine_hostname,
    rendezvous_gives_local_addr,
    set_last_call,
    set_state_cache,
)
from stalwart.supervisor.lifeline import Lifeline
from stalwart.supervisor.spare_host import SpareHost

DEFAULT_PORT = 29400  # torch's c10d rendezvous default


KEEP_ALIVE = {"keep_alive_interval": 2, "keep_alive_max_attempt": 3}
"""The c10d rendezvous's keep-alive under elastic membership (--nnodes MIN:MAX), unless --rdzv-conf sets it: a
lost node leaves the rendezvous after 6 s of silence instead of torch's 15 (5 s x 3), so the job goes on without
it that much sooner; each agent writes one small key to the store every 2 s."""


def rendezvous_handler(
    params: Any,
    replace_wait_s: float | None = None,
    on_gone: Callable[[str], object] | None = None,
    spare_host: SpareHost | None = None,
) -> Any:
    """The RendezvousHandler for `params` (torch's RendezvousParameters). `replace_wait_s`: after the first round,
    how long a round below the maximum node count waits for more nodes once the minimum is there (torch's
    `last_call_timeout`, which the first round keeps, for nodes that start late). On several nodes the agents
    knock on each other's lifeline while they wait (supervisor/lifeline.py); `on_gone` is told each node found
    gone; `spare_host` is given the store and the handler, and warms its spares at each poll while this node waits
    as a spare (supervisor/spare_host.py)."""
    from torch.distributed.elastic.rendezvous import registry

    if params.backend != "c10d" or params.get("store_type", "tcp").strip().lower() != "tcp":
        return registry.get_rendezvous_handler(params)
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    configured = params.get_as_bool("is_host")
    is_host = configured if configured is not None else matches_machine_hostname(host)
    read_timeout = int(params.get_as_int("read_timeout", 60))
    if read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    timeout = timedelta(seconds=read_timeout)
    # As torch does: an agent that guessed it hosts the store but finds the port taken joins as a client (two
    # agents of one job on the same machine, e.g. the tests' "nodes").
    for is_server in dict.fromkeys([is_host, False]):
        try:
            store = tcp_store(host, port, is_server=is_server, timeout=timeout, wait_for_workers=False)
            break
        except (ValueError, RuntimeError, TimeoutError, OSError) as exc:
            if not is_server or configured is not None:
                raise RendezvousConnectionError(f"cannot reach the rendezvous store at {host}:{port}: {exc}") from exc
    backend = C10dRendezvousBackend(store, params.run_id)
    _cheap_event_names()
    handler = create_handler(store, backend, params)
    if params.max_nodes > 1:  # also how soon an agent sees a node waiting (on one node none ever does)
        set_state_cache(handler, sync_poll_s(params.max_nodes))
        keep_ranks(handler)  # a survivor keeps its rank, and its node's snapshots of that rank, in the next round
    if replace_wait_s is not None:
        handler.next_rendezvous = functools.partial(  # type: ignore[method-assign]
            _then_wait_for_replacements, handler.next_rendezvous, handler, timedelta(seconds=replace_wait_s)
        )
    knock: Callable[[], bool] | None = None
    if params.max_nodes > 1:
        lifeline = Lifeline(store, handler, host)
        if spare_host is not None:
            spare_host.store, spare_host.handler = store, handler

        def knock() -> bool:
            gone = lifeline.knock()
            for name in gone:
                if on_gone is not None:
                    on_gone(name)
            if spare_host is not None:
                spare_host.while_waiting()
            return bool(gone)

    handler.next_rendezvous = functools.partial(  # type: ignore[method-assign]
        _quicker_delays, handler.next_rendezvous, params.max_nodes, knock
    )
    if not rendezvous_gives_local_addr():
        handler.next_rendezvous = functools.partial(  # type: ignore[method-assign]
            _master_at_local_addr, handler.next_rendezvous, params.local_addr
        )
    return handler


def _then_wait_for_replacements(next_rendezvous: Callable[[], Any], handler: Any, wait: timedelta) -> Any:
    """`next_rendezvous()`, after which later rounds wait `wait` for more nodes (kept as it is on a torch that has
    no such setting: runtime/torch_compat_rendezvous.set_last_call)."""
    info = next_rendezvous()
    set_last_call(handler, wait)
    return info


MASTER_ADDR_KEY = "stalwart/master_addr"
"""Where rank 0's agent publishes the workers' MASTER_ADDR in a round's store (a torch whose rendezvous does not:
runtime/torch_compat_rendezvous.rendezvous_gives_local_addr)."""


def _master_at_local_addr(next_rendezvous: Callable[[], Any], local_addr: str | None) -> Any:
    """`next_rendezvous()` whose MASTER_ADDR is rank 0's --local-addr, as later torch gives it. On torch 2.4 two
    hosts that share a host name (network namespaces on one machine) or whose name resolves to loopback had
    their workers connect to the wrong host. Rank 0 publishes the address in the round's own store; the port
    stays torch's (a free one on rank 0's host)."""
    info = next_rendezvous()
    if info.rank == 0:
        info.store.set(MASTER_ADDR_KEY, local_addr or info.bootstrap_store_info.master_addr)
    info.bootstrap_store_info.master_addr = info.store.get(MASTER_ADDR_KEY).decode()
    return info


def _cheap_event_names() -> None:
    """Name torch's rendezvous events from the caller's frame instead of `inspect.stack()`.

    torch's dynamic rendezvous names each event it records after the method that records it, found with
    `inspect.stack()` twice per event: every frame's source file and module looked up, each lookup a scan of
    `sys.modules`. In the agent (torch and stalwart imported: thousands of modules) a restart's 8 events took
    most of its rendezvous (the profile is in docs/benchmarks.md). `sys._getframe` gives the same name (the
    function two frames up) without the lookups. Only torch's own function is replaced; another torch is left as
    it is."""
    import inspect
    import sys

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    current = getattr(dynamic_rendezvous, "get_method_name", None)
    if current is None or getattr(current, "__module__", "") != dynamic_rendezvous.__name__:
        return  # already replaced, or a torch without it
    if list(inspect.signature(current).parameters) != ["depth"]:
        return

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # fewer frames than that, as torch's answers
            return "no_method_name"

    get_method_name.__wrapped__ = current  # type: ignore[attr-defined]  # torch's, as functools.wraps keeps it
    dynamic_rendezvous.get_method_name = get_method_name


SYNC_POLL_PER_NODE_S = 0.05
"""How often, per node of the job, an agent reads the round's state while it waits for other nodes (see
`_quicker_delays`): every 0.1 s on two nodes, every 1 s (torch's) from 20 nodes on."""


def sync_poll_s(max_nodes: int) -> float:
    """Seconds between two reads of the round's state by one agent of a job of `max_nodes` nodes."""
    return min(1.0, SYNC_POLL_PER_NODE_S * max_nodes)


def _quicker_delays(next_rendezvous: Callable[[], Any], max_nodes: int, knock: Callable[[], bool] | None = None) -> Any:
    """`next_rendezvous()` with shorter sleeps.

    While it waits for other nodes (joining the round, leaving the last one) torch's rendezvous sleeps 1 s between
    two reads of the round's state (and trusts a state it read for 1 s: `rendezvous_handler` shortens that alike).
    On two nodes those waits were most of a re-formed round: 1.10-1.30 s from a worker's death to the survivors'
    activation (tests/test_multinode.py, 2026-11-30). Each agent polls every SYNC_POLL_PER_NODE_S per node of the
    job instead, at most torch's 1 s, so the store answers about 20 polls a second whatever the node count.

    On one node the random 0-0.3 s sleep torch takes while the round is still 0 (at the start and at the first
    restart) goes too: it spreads several nodes' first joins over time, with one node there is nothing to
    spread, and it was the larger part of a restart's rendezvous (docs/benchmarks.md).

    `knock`: called at each poll (supervisor/lifeline.py: a node whose agent is gone leaves the round at once); when
    it took a node out, the poll is not slept: the state is written at once (the sanitizer's removal a poll
    later)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is None:  # another torch: as it is
        return next_rendezvous()
    poll = sync_poll_s(max_nodes)

    def quicker(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):  # the start skew
            if max_nodes > 1:
                delay(seconds)
        elif seconds == 1:  # torch's one fixed delay is the poll's
            if knock is not None:
                started = time.monotonic()
                if not knock():
                    delay(max(0.0, poll - (time.monotonic() - started)))
            else:
                delay(poll)
        else:
            delay(seconds)

    dynamic_rendezvous._delay = quicker
    try:
        return next_rendezvous()
    finally:
        dynamic_rendezvous._delay = delay
