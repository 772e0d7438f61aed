"""Torch elastic's rendezvous and launcher: the part of runtime/torch_compat.py that the agent's rendezvous
(supervisor/rendezvous.py) and the launcher use.

The rules of runtime/torch_compat.py hold here: each entry says what it relies on, why no public way serves, and
the torch releases on which tests/test_torch_compat.py passed ("checked on"); that test holds every other module to
importing these from here.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def matches_machine_hostname(host: str) -> bool:
    """Whether `host` names this machine (torch's own guess whether an agent hosts the rendezvous store): torch
    elastic's private `rendezvous.utils._matches_machine_hostname`, kept so that stalwart's rendezvous decides as
    torch's. Checked on torch 2.4.1 and 2.13.0."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def static_master(params: Any) -> tuple[str | None, int | None]:
    """MASTER_ADDR and MASTER_PORT of a static rendezvous (torch's RendezvousParameters), as torchrun reads them
    from its flags: the private `torch.distributed.launcher.api._get_addr_and_port`. Checked on torch 2.4.1 and
    2.13.0."""
    from torch.distributed.launcher.api import _get_addr_and_port

    return _get_addr_and_port(params)


def set_last_call(handler: Any, wait: timedelta) -> bool:
    """Make the next rounds of `handler` (torch's DynamicRendezvousHandler) wait `wait` for more nodes once the
    minimum is there: its `last_call_timeout`, fixed when made, is the private `_settings.timeout._last_call`.
    False (left as it is) on a torch without it. Checked on torch 2.4.1 and 2.13.0."""
    timeout = getattr(getattr(handler, "_settings", None), "timeout", None)
    if timeout is None or not hasattr(timeout, "_last_call"):
        return False
    timeout._last_call = wait
    return True


def set_state_cache(handler: Any, seconds: float) -> bool:
    """How long `handler` (torch's DynamicRendezvousHandler) trusts the rendezvous state it read last before it
    reads it again (torch's 1 s): its state holder's private `_cache_duration`. An agent's look for waiting nodes
    (`num_nodes_waiting`) and its polls in a rendezvous read through it. False (left as it is) on a torch without
    it. Checked on torch 2.4.1 and 2.13.0."""
    holder = getattr(handler, "_state_holder", None)
    if holder is None or not hasattr(holder, "_cache_duration"):
        return False
    holder._cache_duration = seconds
    return True


def rendezvous_gives_local_addr() -> bool:
    """Whether torch's rendezvous gives the workers rank 0's `--local-addr` as MASTER_ADDR (`RendezvousStoreInfo.build`
    takes `local_addr`). torch 2.4's names the host by `socket.getfqdn()` whatever --local-addr says, and
    supervisor/rendezvous.py publishes the address itself. By feature. Checked on torch 2.4.1 (it does not) and
    2.13.0 (it does)."""
    import inspect

    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    return "local_addr" in inspect.signature(RendezvousStoreInfo.build).parameters


def node_key(node: Any) -> str:
    """A rendezvous node's name as torch writes it (`_NodeDesc`: its address, its agent's pid, a local id)."""
    return f"{node.addr}_{node.pid}_{node.local_id}"


def this_node(handler: Any) -> Any | None:
    """`handler`'s own node (torch's DynamicRendezvousHandler's private `_this_node`); None on a torch without it.
    Checked on torch 2.4.1 and 2.13.0."""
    return getattr(handler, "_this_node", None)


def blocking_nodes(handler: Any) -> list[Any]:
    """The nodes a waiting agent waits for to leave: participants of a completed round that this node has left
    (the round opens again once none is left). From the state the handler read last (its private state holder's
    `state`: `complete`, `participants`). Empty on a torch without them. Checked on torch 2.4.1 and 2.13.0."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    me = this_node(handler)
    if state is None or me is None or not getattr(state, "complete", False) or me in state.participants:
        return []
    return [node for node in state.participants if node != me]


def waits_as_spare(handler: Any) -> bool:
    """Whether this node waits on the redundancy list of a completed round it is not a participant of: a spare node,
    beyond the round's maximum node count, admitted when a participant leaves. From the state the handler read last
    (`complete`, `participants`, `redundancy_list`). False on a torch without them. Checked on torch 2.4.1 and
    2.13.0."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    me = this_node(handler)
    if state is None or me is None or not getattr(state, "complete", False) or me in state.participants:
        return False
    return me in getattr(state, "redundancy_list", ())


def mark_gone(handler: Any, node: Any) -> bool:
    """Take `node` out of the rendezvous as torch's own sanitizer does a node whose keep-alive lapsed: its last
    keep-alive set to 1970, the state marked for writing at the handler's next sync (which removes it from the
    participants and opens the round again once none is left). False on a torch without that state. Checked on
    torch 2.4.1 and 2.13.0."""
    from datetime import datetime

    holder = getattr(handler, "_state_holder", None)
    beats = getattr(getattr(holder, "state", None), "last_heartbeats", None)
    if holder is None or beats is None or node not in beats or not hasattr(holder, "mark_dirty"):
        return False
    beats[node] = datetime(1970, 1, 1, tzinfo=beats[node].tzinfo)  # torch 2.4's are naive (UTC), later aware
    holder.mark_dirty()
    return True


LAST_RANKS_ATTR = "stalwart_last_ranks"
"""The attribute of torch's shared rendezvous state (pickled with it, so every agent reads it) that holds, by node
name, the group rank each node had in the completed round it left (`keep_ranks`)."""


def stable_ranks(order: list[str], last: dict[str, int]) -> dict[str, int]:
    """Group ranks for the nodes of a completed round, `order` as torch would number them: each node keeps the rank
    it had in the round before (`last`) where that rank is still below the round's size and not kept by another;
    the other nodes take the free ranks in torch's order."""
    size, ranks = len(order), dict[str, int]()
    for name in order:
        rank = last.get(name)
        if rank is not None and 0 <= rank < size and rank not in ranks.values():
            ranks[name] = rank
    free = iter(r for r in range(size) if r not in ranks.values())
    for name in order:
        if name not in ranks:
            ranks[name] = next(free)
    return ranks


def keep_ranks(handler: Any) -> bool:
    """Make `handler` (torch's DynamicRendezvousHandler) keep the nodes' group ranks across rounds.

    torch numbers the nodes of each completed round in the order of their names (address, then the agent's pid), so
    a node that joins in place of a lost one can take a survivor's rank: a lost host whose address sorted below the
    survivor's, or on one address a replacement agent whose pid sorts lower (pids wrap; at 32768 on the test VM).
    A renumbered survivor finds no snapshot of its new rank in its node's memory, and the job went back to its
    newest checkpoint (a fresh clone's test did, 2026-11-30). Here each node that leaves a completed round notes its
    rank in the shared state, and the node that completes the next round gives each one that rank again where it
    can (`stable_ranks`); new nodes take the lost ones'. Agents that all run this agree; a torch agent beside them
    that completes a round numbers it as torch does. Wraps the private executor's `_remove_from_participants` and
    `_mark_rendezvous_complete` (per handler); False (left as it is) on a torch without them. Checked on torch
    2.4.1 and 2.13.0."""
    executor = getattr(handler, "_op_executor", None)
    leave = getattr(executor, "_remove_from_participants", None)
    complete = getattr(executor, "_mark_rendezvous_complete", None)
    if executor is None or leave is None or complete is None or not hasattr(executor, "_node"):
        return False

    def remove_from_participants() -> None:
        state = executor._state
        if state.complete and executor._node in state.participants:
            last = dict(getattr(state, LAST_RANKS_ATTR, {}))
            last[node_key(executor._node)] = state.participants[executor._node]
            setattr(state, LAST_RANKS_ATTR, last)
        leave()

    def mark_rendezvous_complete() -> None:
        complete()
        state = executor._state
        order = sorted(state.participants, key=lambda node: state.participants[node])
        ranks = stable_ranks([node_key(node) for node in order], getattr(state, LAST_RANKS_ATTR, {}))
        for node in order:
            state.participants[node] = ranks[node_key(node)]
        setattr(state, LAST_RANKS_ATTR, {})

    executor._remove_from_participants = remove_from_participants
    executor._mark_rendezvous_complete = mark_rendezvous_complete
    return True
