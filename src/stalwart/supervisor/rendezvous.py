"""The agent's rendezvous: torch elastic's c10d rendezvous, with its store bound to one address.

torch's `c10d` backend creates a TCPStore that listens on every interface. This one is the same handler
(`DynamicRendezvousHandler` over `C10dRendezvousBackend`, so several agents and torchrun interoperate), but the
agent that hosts the store listens only on the endpoint's address: 127.0.0.1 for a one-node run, the address of
`--rdzv-endpoint` on several nodes. Other backends (etcd, static, file stores) are torch's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from stalwart.runtime.store import tcp_store
from stalwart.runtime.torch_compat import matches_machine_hostname, rendezvous_gives_local_addr, set_last_call

DEFAULT_PORT = 29400  # torch's c10d rendezvous default


KEEP_ALIVE = {"keep_alive_interval": 2, "keep_alive_max_attempt": 3}
"""The c10d rendezvous's keep-alive under elastic membership (--nnodes MIN:MAX), unless --rdzv-conf sets it: a
lost node leaves the rendezvous after 6 s of silence instead of torch's 15 (5 s x 3), so the job goes on without
it that much sooner; each agent writes one small key to the store every 2 s."""


def rendezvous_handler(params: Any, replace_wait_s: float | None = None) -> Any:
    """The RendezvousHandler for `params` (torch's RendezvousParameters). `replace_wait_s`: after the first round,
    how long a round below the maximum node count waits for more nodes once the minimum is there (torch's
    `last_call_timeout`, which the first round keeps, for nodes that start late)."""
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
    if replace_wait_s is not None:
        handler.next_rendezvous = functools.partial(  # type: ignore[method-assign]
            _then_wait_for_replacements, handler.next_rendezvous, handler, timedelta(seconds=replace_wait_s)
        )
    if params.max_nodes == 1:
        handler.next_rendezvous = functools.partial(_without_start_skew, handler.next_rendezvous)  # type: ignore[method-assign]
    if not rendezvous_gives_local_addr():
        handler.next_rendezvous = functools.partial(  # type: ignore[method-assign]
            _master_at_local_addr, handler.next_rendezvous, params.local_addr
        )
    return handler


def _then_wait_for_replacements(next_rendezvous: Callable[[], Any], handler: Any, wait: timedelta) -> Any:
    """`next_rendezvous()`, after which later rounds wait `wait` for more nodes (kept as it is on a torch that has
    no such setting: runtime/torch_compat.set_last_call)."""
    info = next_rendezvous()
    set_last_call(handler, wait)
    return info


MASTER_ADDR_KEY = "stalwart/master_addr"
"""Where rank 0's agent publishes the workers' MASTER_ADDR in a round's store (a torch whose rendezvous does not:
runtime/torch_compat.rendezvous_gives_local_addr)."""


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


def _without_start_skew(next_rendezvous: Callable[[], Any]) -> Any:
    """`next_rendezvous()` without the random 0-0.3 s sleep torch takes while the round is still 0 (at the start
    and at the first restart), meant to spread several nodes' first joins over time. With one node there is
    nothing to spread, and the sleep was the larger part of a restart's rendezvous (docs/benchmarks.md). Delays
    of a set length (polling for other nodes) are kept."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is None:  # another torch: as it is
        return next_rendezvous()

    def fixed_delays_only(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):
            delay(seconds)

    dynamic_rendezvous._delay = fixed_delays_only
    try:
        return next_rendezvous()
    finally:
        dynamic_rendezvous._delay = delay
