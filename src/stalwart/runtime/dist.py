"""Where this process stands in the job, and the few collectives stalwart itself needs.

The same script runs as a single process, under `stalwart run` and under plain `torchrun`: everything is read
from torchrun's environment variables. stalwart's own coordination (checkpoint commit, resume agreement) uses a
separate gloo group so it works next to NCCL training and never interleaves with the user's collectives.
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from stalwart.errors import ConfigError
from stalwart.runtime.env import AGENT_STORE_ENV as AGENT_STORE_ENV
from stalwart.runtime.env import RESTART_COUNT_ENV as RESTART_COUNT_ENV
from stalwart.runtime.store import tcp_store


@dataclass(frozen=True, slots=True)
class Placement:
    """This process's coordinates, as torchrun's environment variables give them."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int
    local_world_size: int = 1
    """LOCAL_WORLD_SIZE as torchrun and `stalwart run` set it; 1 when launched otherwise (or malformed)."""

    @classmethod
    def from_env(cls) -> Placement:
        try:
            rank = int(os.environ.get("RANK", "0"))
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            restart_count = int(os.environ.get(RESTART_COUNT_ENV, "0"))
        except ValueError as exc:
            raise ConfigError(f"malformed launcher environment variable: {exc}") from exc
        if not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
        text = os.environ.get("LOCAL_WORLD_SIZE", "1")
        local_world_size = int(text) if text.isdigit() and int(text) > 0 else 1
        return cls(rank, world_size, local_rank, restart_count, local_world_size)


class IntMessage:
    """What ranks agree on through `Comm.gather`: a dataclass whose fields are ints, sent as int64s.

    Named fields instead of positions in a list of integers (`gathered[0][3]`); subclasses are
    `@dataclass(frozen=True, slots=True)`.
    """

    __slots__ = ()
    FIXED = True
    """Whether every message of the class has the same length (a broadcast then needs no length first)."""

    def to_ints(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in dataclasses.fields(self)]  # type: ignore[arg-type]

    @classmethod
    def from_ints(cls: type[M], ints: list[int]) -> M:
        return cls(*ints)


M = TypeVar("M", bound=IntMessage)


@dataclass(frozen=True, slots=True)
class StepList(IntMessage):
    """Rank 0's answer of a list of steps, for `Comm.broadcast`: whether it could make the list (`ok`), then the
    steps (the checkpoint directory's committed steps, the batches rollbacks skipped). Any length."""

    ok: int
    steps: tuple[int, ...] = ()
    FIXED = False

    def to_ints(self) -> list[int]:
        return [self.ok, *self.steps]

    @classmethod
    def from_ints(cls, ints: list[int]) -> StepList:
        return cls(ints[0], tuple(ints[1:]))


@dataclass(frozen=True, slots=True)
class Flag(IntMessage):
    """One yes/no (or small count) per rank: a vote, a verdict, whether a rank sees something."""

    value: int


HELD_COLLECTIVES = 8
"""How many of Comm's latest collectives keep their (small) tensors referenced from Python; `close` lets go of them
only once the group is destroyed. Why: a gloo worker thread drops a work's tensors just after `wait()` has returned, and
when Python has already let go of such a tensor that last drop frees its Python object, which takes the GIL. On
torch 2.4.1, destroying the group (`~ProcessGroupGloo`) joins the worker threads while holding the GIL: the two
wait for each other forever (py-spy, 2026-11-29: a Job whose start failed at the foreign-directory check, hung
in `Comm.close` one run in ten beside a busy core, its worker in `~AsyncBroadcastWork` -> `gil_scoped_acquire`).
A tensor still referenced from Python is only released by the worker, which needs no GIL."""
HELD_MAX_BYTES = 1 << 16
"""Tensors larger than this (a replica's image) are not held: their collectives are followed by small ones before
any close, and holding them would keep copies of a snapshot alive."""


OWN_GROUP_NAMES_FROM = 1 << 40
"""stalwart's own groups are named from here up (`own_group`); torch names a script's groups 0, 1, 2, ..."""


def own_group(timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group over every rank, for stalwart's own collectives, named apart from the script's groups.

    Why: torch names a group by a per-process count of the groups made since the default one, and its store keys
    by that name. A survivor that re-formed in its loop has made none of the groups a replacement's set-up makes
    before its Job (torchtitan's mesh makes one per disabled dimension): named by that count, the two would wait
    for each other under different names, forever. Named instead as the first name from OWN_GROUP_NAMES_FROM that
    no live group of this process holds (the same on every rank: each makes and destroys stalwart's groups in the
    same order), with the script's count left as it was. torch 2.13.0 names groups so (`_world.group_count`,
    `_world.pg_names`), as torch 2.x's source did before it; a torch without those two: torch's own naming."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "group_count") or not hasattr(world, "pg_names"):
        return dist.new_group(backend="gloo", timeout=timeout)
    taken = set(world.pg_names.values())
    name = OWN_GROUP_NAMES_FROM
    while str(name) in taken:
        name += 1
    count = world.group_count
    world.group_count = name
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    finally:
        world.group_count = count


class Comm:
    """Barrier, gather and broadcast of small integers over stalwart's own gloo group."""

    def __init__(self, placement: Placement, timeout: timedelta) -> None:
        self.rank = placement.rank
        self.world_size = placement.world_size
        self._group: dist.ProcessGroup | None = None
        self._held: deque[tuple[torch.Tensor, ...]] = deque(maxlen=HELD_COLLECTIVES)
        if self.world_size > 1:
            # A second group costs one store round-trip at start; it keeps checkpoint traffic off NCCL.
            self._group = own_group(timeout)

    def close(self) -> None:
        """Destroy stalwart's group; a gloo group left alive at interpreter exit can abort the process."""
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)  # the tensors of its last works still held (HELD_COLLECTIVES)
        self._group = None
        self._held.clear()

    def _hold(self, *tensors: torch.Tensor) -> None:
        """Keep a collective's small tensors referenced until HELD_COLLECTIVES more calls of this (see there)."""
        self._held.append(tuple(t for t in tensors if t.numel() * t.element_size() <= HELD_MAX_BYTES))

    def forget(self) -> None:
        """Drop the group without destroying it: after a peer's failure it is aborted with every other group."""
        self._group = None

    def barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def gather(self, message: M) -> list[M]:
        """Every rank's `message` (a dataclass of int fields, see IntMessage), indexed by rank."""
        return [type(message).from_ints(v) for v in self.all_gather_ints(message.to_ints())]

    def broadcast(self, message: M) -> M:
        """Rank 0's `message` on every rank (the others' is ignored but for its length, which a FIXED message
        shares with rank 0's: one broadcast; else its length goes first)."""
        ints = message.to_ints()
        if not type(message).FIXED:
            return type(message).from_ints(self.broadcast_ints(ints))
        if self._group is not None:
            t = torch.tensor(ints, dtype=torch.int64)
            self._hold(t)
            dist.broadcast(t, src=0, group=self._group)
            ints = [int(v) for v in t.tolist()]
        return type(message).from_ints(ints)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of int64 values, indexed by rank (lists must have equal length)."""
        if self._group is None:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._hold(mine, *out)
        dist.all_gather(out, mine, group=self._group)
        return [t.tolist() for t in out]

    def all_gather_ints_later(self, values: list[int]) -> Callable[[], list[list[int]]]:
        """Start `all_gather_ints(values)` and return a function that waits for its result: a rank that calls it
        a while later (the next window of steps) does not wait for the slowest rank now."""
        if self._group is None:
            return lambda: [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._hold(mine, *out)
        work = dist.all_gather(out, mine, group=self._group, async_op=True)

        def result() -> list[list[int]]:
            assert work is not None
            work.wait()
            return [t.tolist() for t in out]

        return result

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's list of int64 values (any length), on every rank."""
        if self._group is None:
            return list(values)
        n = self.broadcast_int(len(values))
        t = torch.tensor(values if self.rank == 0 else [0] * n, dtype=torch.int64)
        self._hold(t)
        dist.broadcast(t, src=0, group=self._group)
        return [int(v) for v in t.tolist()]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Rank `src`'s contents of `tensor` (same shape and dtype everywhere), in place on every rank."""
        if self._group is not None:
            self._hold(tensor)
            dist.broadcast(tensor, src=src, group=self._group)

    def exchange(self, payload: bytes, send_to: int, recv_from: int) -> bytes:
        """Send `payload` to rank `send_to` while receiving the payload rank `recv_from` sends to this rank (both
        sides call it; lengths may differ). Point to point: only the two peers wait on each other."""
        if self._group is None:
            return payload
        length = torch.tensor([len(payload)], dtype=torch.int64)
        theirs = torch.empty(1, dtype=torch.int64)
        self._hold(length, theirs)
        _wait_all([dist.isend(length, send_to, group=self._group), dist.irecv(theirs, recv_from, group=self._group)])
        out = torch.empty(int(theirs.item()), dtype=torch.uint8)
        mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        self._hold(mine, out)
        pending = []
        if len(payload):
            pending.append(dist.isend(mine, send_to, group=self._group))
        if out.numel():
            pending.append(dist.irecv(out, recv_from, group=self._group))
        _wait_all(pending)
        return out.numpy().tobytes()

    def send_bytes(self, payload: bytes, dst: int) -> None:
        """Send `payload` to rank `dst`, which calls `recv_bytes` (blocking, point to point)."""
        if self._group is None:
            return
        length = torch.tensor([len(payload)], dtype=torch.int64)
        self._hold(length)
        dist.send(length, dst, group=self._group)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self._hold(data)
            dist.send(data, dst, group=self._group)

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to rank `dst`, which receives it into a tensor of the same size and dtype (`recv_tensor`)."""
        if self._group is not None:
            self._hold(tensor)
            dist.send(tensor, dst, group=self._group)

    def recv_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Into `tensor`, what rank `src` sends with `send_tensor`."""
        if self._group is not None:
            self._hold(tensor)
            dist.recv(tensor, src, group=self._group)

    def recv_bytes(self, src: int) -> bytes:
        """What rank `src` sends with `send_bytes`."""
        if self._group is None:
            return b""
        length = torch.empty(1, dtype=torch.int64)
        self._hold(length)
        dist.recv(length, src, group=self._group)
        out = torch.empty(int(length.item()), dtype=torch.uint8)
        self._hold(out)
        if out.numel():
            dist.recv(out, src, group=self._group)
        return out.numpy().tobytes()

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value, on every rank."""
        if self._group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._hold(t)
        dist.broadcast(t, src=0, group=self._group)
        return int(t.item())


def _wait_all(works: list[Any]) -> None:
    for work in works:
        if work is not None:
            work.wait()


def init_process_group(
    placement: Placement,
    timeout: timedelta,
    *,
    reformable: bool = False,
    placeholder: bool = False,
    store: dist.Store | None = None,
) -> bool:
    """Join the default process group when launched with several ranks; returns whether this call did it.

    The backend is NCCL when CUDA is available and gloo otherwise; a group the user created first is kept.
    `reformable`: the group is stalwart's re-formable one (runtime/group.py) over those backends. `placeholder`
    (with `reformable`): a group that joins nobody yet, its collectives local (recovery/shrink.py). `store`: the
    group's rendezvous store instead of one on MASTER_ADDR:MASTER_PORT (the script's own, recovery/script_group.py).
    """
    if placement.world_size == 1 or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(placement.local_rank % torch.cuda.device_count())
        backend = "cuda:nccl,cpu:gloo"
    else:
        backend = "gloo"
    if reformable:
        from stalwart.runtime import group

        group.register()
        backend = group.BACKEND
        shared = torch.cuda.is_available() and placement.local_world_size > torch.cuda.device_count()
        group.ReformableGroup.cuda_backend = "gloo" if shared else "nccl"  # NCCL refuses two ranks on one GPU
        if placeholder:
            group.make_placeholder_next()
            dist.init_process_group(
                backend=backend,
                store=dist.HashStore(),
                rank=placement.rank,
                world_size=placement.world_size,
                timeout=timeout,
            )
            return True
    if store is None:
        store = _bootstrap_store(placement, timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        prefixed = dist.PrefixStore("default_pg", store)  # as env:// does
        dist.init_process_group(
            backend=backend, store=prefixed, rank=placement.rank, world_size=placement.world_size, timeout=timeout
        )
    return True


def _bootstrap_store(placement: Placement, timeout: timedelta) -> dist.Store | None:
    """Rank 0's TCPStore for the process group, listening on MASTER_ADDR's address only (torch's env:// one
    listens on every interface). None where torch's own env:// rendezvous applies: no MASTER_ADDR/MASTER_PORT,
    or torchrun's shared agent store (the workers are its clients and listen on nothing)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit() or os.environ.get(AGENT_STORE_ENV, "").lower() in ("1", "true"):
        return None
    return tcp_store(addr, int(port), is_server=placement.rank == 0, timeout=timeout, world_size=placement.world_size)


class GatherBatch:
    """Several small all-gathers started at the same step, carried by one collective (`flush`).

    Why: detectors that compare ranks (straggler times, the agents' risk flags) each exchange a few ints every 10
    steps; each collective costs tens of microseconds of dispatch on the training thread whatever its size, so
    one per window does for all. `gather(values)` has the signature of `Comm.all_gather_ints_later`: it records
    the values and returns the function that waits for every rank's values of that call; it may be called only
    after `flush()` (the detectors read a window's result one window later). Every rank makes the same calls in
    the same order, as with any collective."""

    def __init__(self, gather_later: Callable[[list[int]], Callable[[], list[list[int]]]]) -> None:
        self._gather_later = gather_later
        self._parts: list[int] = []
        self._slots: list[list[Callable[[], list[list[int]]]]] = []  # each filled by flush() with the wait

    def gather(self, values: list[int]) -> Callable[[], list[list[int]]]:
        start, end = len(self._parts), len(self._parts) + len(values)
        self._parts.extend(values)
        slot: list[Callable[[], list[list[int]]]] = []
        self._slots.append(slot)

        def result() -> list[list[int]]:
            if not slot:
                raise RuntimeError("GatherBatch: a result was read before flush()")
            return [row[start:end] for row in slot[0]()]

        return result

    def flush(self) -> None:
        """Start the one collective for every `gather` since the last flush (none: nothing)."""
        if not self._parts:
            return
        wait = self._gather_later(self._parts)
        done: list[list[list[int]]] = []

        def once() -> list[list[int]]:
            if not done:
                done.append(wait())
            return done[0]

        for slot in self._slots:
            slot.append(once)
        self._parts, self._slots = [], []
