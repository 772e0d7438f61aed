"""Checkpoints: snapshot in the training loop, persist in the background, commit by rank 0, verified loading.

A save has two halves. The snapshot (here, on the training thread) agrees with the other ranks that a save
starts, flattens the state into a skeleton and tensors, and copies this rank's tensors into its staging memory;
that copy is the whole stall. The persist (save/persister.py, another process) hashes and writes the rank's data
and meta files and, on rank 0, waits for every rank's meta file and writes the manifest last (save/committer.py):
that write is the commit. A crash at any instant before it leaves the previous checkpoint the newest loadable one.

Replicated objects (`replicated=`, e.g. a DDP model and its optimizer) are written once: each of their tensors
is owned by one rank, chosen by a pure function of the tensor sizes, so the ranks write disjoint parts in
parallel. Sharded tensors (DTensor: FSDP2, tensor parallelism) are written shard by shard by one rank holding
each shard (format/sharded.py). Everything else is per-rank state, written by its rank.

At most one save per rank is in flight. The rule for a save requested while one is still persisting
(`when_busy`): "skip" (the default) skips it on every rank, agreed through one small collective, with a
`checkpoint_skipped` event, and training goes on; "wait" waits for it on every rank, with a `checkpoint_waited`
event, and agrees again (the wait outside the agreement, so that the caller can watch each at its own pace). The
final save of a run (`wait=True`) always waits, then waits for its own commit.

Every decision that must be the same on all ranks is taken once and shared: rank 0 lists the checkpoints, the ranks
vote on each candidate, rank 0 reports the commit. At start every rank must see a file rank 0 wrote, or it stops.

Loading walks the committed steps newest first, here and in the mirrors; every rank verifies what it reads (meta
file and every tensor against the manifest's xxh3) and the newest step valid on every rank is loaded. Newer ones
that failed an integrity check are moved to `step_XXXXXXXX.invalid-<ns>` for inspection, never deleted. If
checkpoints exist but none verifies, loading stops with NoValidCheckpointError rather than silently starting again
from step 0.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.format.serialize import TensorItem, assign_owners, dtype_name, fingerprint, flatten
from stalwart.checkpoint.load.newest import load_newest, set_aside_after
from stalwart.checkpoint.load.rank_state import Restored
from stalwart.checkpoint.save.background import Background
from stalwart.checkpoint.save.overlap import UpdateFence
from stalwart.checkpoint.save.request import DEFAULT_FAILOVER_S, PersistReply, PersistRequest
from stalwart.checkpoint.save.staging import Staging, placed_in_staging
from stalwart.checkpoint.storage import Storage, describe_error, open_storage
from stalwart.errors import ConfigError, PeerError, UnsavableStateError
from stalwart.runtime.dist import Comm, Flag, IntMessage, Placement
from stalwart.telemetry.events import EventLog

_OK, _UNSAVABLE = 1, -1  # a rank's vote on a save
SHARED_DIR_TIMEOUT_S = 10.0
DEFAULT_PERSIST_TIMEOUT_S = 600.0
STANDALONE_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True, slots=True)
class SaveVote(IntMessage):
    """What each rank says before a save; every rank then decides the same."""

    vote: int
    """_OK, or _UNSAVABLE when this rank's state cannot be checkpointed."""
    in_flight: int
    """The step this rank's persister is still writing, or -1."""
    fingerprint: int
    """Of the replicated tensors' names, dtypes and shapes: must be equal everywhere."""
    base: int
    """Rank 0's choice: the full checkpoint a delta refers to, or -1 for a full one."""


class Checkpointer:
    """Saves and loads this rank's part of the job's checkpoints under one root (a path or an fsspec URL)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        comm: Comm,
        events: EventLog,
        *,
        keep_last: int,
        token: str,
        replicated: frozenset[str] = frozenset(),
        full_every: int = 1,
        when_busy: str = "skip",
        persist_timeout_s: float = DEFAULT_PERSIST_TIMEOUT_S,
        storage_options: dict[str, Any] | None = None,
        save_faults: Callable[[int], dict[str, Any] | None] | None = None,
        mirrors: list[dict[str, Any]] | None = None,
        failover_s: float = DEFAULT_FAILOVER_S,
        durable_in: str = "one",
    ) -> None:
        self.url = os.fspath(root)
        self.storage: Storage = open_storage(self.url, storage_options)
        self._options = storage_options
        self._comm, self._events, self._keep_last, self._token = comm, events, keep_last, token
        self.replicated = replicated
        """Names of tracked objects written once for all ranks (set by the Job before the first save)."""
        self._full_every = full_every
        self._when_busy = when_busy
        self._persist_timeout_s = persist_timeout_s
        self._mirrors = mirrors or []  # {"url", "options"}: rank 0's persister copies each commit there (mirroring.py)
        self._failover_s = failover_s  # and a save is written there when this store does not answer (failover.py)
        self._durable_in = durable_in  # "all": a save counts as committed once every location has it
        self._save_faults = save_faults or (lambda step: None)
        """The faults a save of a step is to meet (job/hooks.StepHooks.save_faults), carried to the persister,
        where checkpoint/save/save_hooks.py turns them into its hooks."""
        self._attempt = 0
        self.overlap: UpdateFence | None = None
        """Set (by the Job) to copy the tensors only an optimizer step writes while the next step runs: the GPU
        path's overlapped snapshot (checkpoint/save/overlap.py). None: every copy ends before save() returns."""
        self.last_stall_s: float | None = None
        """The training stall of the newest snapshot this process took (checkpoint_every="auto" plans with it)."""
        self._own_comm = False  # standalone(): the one-rank group is ours to close
        self._staging = Staging()
        self._preparing: threading.Thread | None = None  # prepare(): staging allocated off the training thread
        self._bg = Background(events, in_process=self.storage.process_local)
        self._last_full: int | None = None  # rank 0: newest committed full checkpoint (a delta's base)
        self._since_full = 0
        self._prepare_root()
        self._bg.start()

    @classmethod
    def standalone(
        cls, root: str | os.PathLike[str], *, events: EventLog | None = None, **options: Any
    ) -> Checkpointer:
        """A Checkpointer for one process outside a Job (a benchmark, an evaluation script, a conversion tool):
        it owns a one-rank group, which needs no process group or port, and closes it in `close()`. `options`
        are the constructor's keywords (keep_last, full_every, when_busy, ...)."""
        options.setdefault("token", "standalone")
        comm = Comm(Placement(rank=0, world_size=1, local_rank=0, restart_count=0), STANDALONE_TIMEOUT)
        try:
            ck = cls(root, comm, events or EventLog(None), **options)
        except BaseException:
            comm.close()
            raise
        ck._own_comm = True
        return ck

    @property
    def root(self) -> str:
        return self.storage.display()

    def _prepare_root(self) -> None:
        """Rank 0 alone checks and creates the root (a rank looking while rank 0 creates it would take the
        half-written marker for a foreign file), then every rank must read a probe file rank 0 wrote."""
        problem: ConfigError | None = None
        probe = f".probe-{self._token}"
        if self._comm.rank == 0:
            try:
                layout.prepare_root(self.storage, create=True)
                self.storage.write_bytes(probe, self._token.encode())
            except ConfigError as exc:
                problem = exc
            except Exception as exc:  # OSError locally; botocore/aiohttp errors from an object store
                problem = ConfigError(f"checkpoint directory {self.root} is not writable: {describe_error(exc)}")
        if not self._comm.broadcast(Flag(0 if problem else 1)).value:
            raise problem or PeerError("rank 0 rejected the checkpoint directory; see its error")
        sees = 1 if self._comm.rank == 0 else int(self._wait_for_probe(probe))
        votes = [v.value for v in self._comm.gather(Flag(sees))]
        if self._comm.rank == 0:
            with contextlib.suppress(Exception):
                self.storage.remove(probe)
        if all(votes):
            return
        if not sees:
            raise ConfigError(
                f"rank {self._comm.rank} cannot see the checkpoint directory {self.root} that rank 0 writes to; "
                "put checkpoint_dir on storage every rank shares (a shared filesystem or an object store)"
            )
        raise PeerError("another rank cannot see the checkpoint directory; see its error")

    def _wait_for_probe(self, probe: str) -> bool:
        """True once the probe holds our token; polls because a network filesystem may show a new file late."""
        deadline = time.monotonic() + SHARED_DIR_TIMEOUT_S
        while True:
            with contextlib.suppress(Exception):
                if self.storage.read(probe) == self._token.encode():
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    # -- saving ------------------------------------------------------------------------------------------------

    def persist_in_flight(self) -> bool:
        return self._bg.in_flight is not None

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        wait: bool = False,
        on_store_wait: Callable[[bool], None] | None = None,
        store_paced: bool = False,
    ) -> bool:
        """Snapshot `step` and hand it to the persister. Collective: every rank calls it for the same step.

        Returns whether a snapshot was taken (False: skipped because the previous save is still persisting).
        With `wait`, first waits for any save in flight, then for this one, and returns whether it committed.
        A state that can never be saved (unloadable types) raises UnsavableStateError on every rank.
        With `when_busy="wait"`, a save that finds a rank's previous one persisting waits for it on every rank
        and agrees again; `on_store_wait(True)` before that wait and `(False)` after it let the caller tell the
        hang detector that this wait runs at the store's pace, while the agreement does not (unless it waits for
        another rank's store: `store_paced`, internal).
        """
        started = time.monotonic()
        if wait:
            self._finish_in_flight()
            started = time.monotonic()
        vote, unsavable, fp = _OK, None, 0
        skeleton: dict[str, Any] = {}
        items: list[TensorItem] = []
        try:
            skeleton, items = flatten(state, self._comm.rank, self.replicated)
            fp = fingerprint([(i.id, dtype_name(i.tensor.dtype), tuple(i.tensor.shape)) for i in items if _shared(i)])
        except UnsavableStateError as exc:
            vote, unsavable = _UNSAVABLE, exc
        busy, finished = self._bg.settled()
        if busy is None:
            self._note(finished)  # a persist that ended since the last poll(): a base only from a noted commit
        base = self._next_base() if self._comm.rank == 0 else -1
        every = self._comm.gather(SaveVote(vote, -1 if busy is None else busy, fp, base))
        if store_paced and on_store_wait is not None:
            on_store_wait(False)  # the agreement after a wait for another rank's store is done
        if any(v.vote == _UNSAVABLE for v in every):
            raise unsavable or PeerError("another rank's state cannot be checkpointed; see its error")
        if len({v.fingerprint for v in every}) > 1:
            raise UnsavableStateError(
                "the replicated objects differ in structure between ranks (tensor names, shapes or dtypes); "
                "list in replicated= only objects that are identical on every rank"
            )
        in_flight = [v.in_flight for v in every if v.in_flight >= 0]
        if in_flight and self._when_busy == "wait":
            # Every rank waits for its own and agrees again (the second agreement finds none in flight, and rank
            # 0's base is chosen after the commit). Agreeing first keeps the wait out of the agreement: a rank
            # slow at its store would otherwise hold the others in the gather, where a hang is watched for.
            # The next agreement waits for the slowest rank's store: at the store's pace too (rank 0's persist,
            # which commits, ends last; a failover to a mirror takes failover_s).
            others = any(v.in_flight >= 0 for r, v in enumerate(every) if r != self._comm.rank)
            if on_store_wait is not None:
                on_store_wait(True)
            self._finish_in_flight()
            if on_store_wait is not None and not others:
                on_store_wait(False)
            return self.save(step, state, on_store_wait=on_store_wait, store_paced=others)
        if in_flight:
            self._events.emit(
                "checkpoint_skipped", step=step, reason=f"the save of step {in_flight[0]} is still persisting"
            )
            return False
        chosen_base = None if every[0].base < 0 else every[0].base
        mine = self._owned(items)
        offsets, total = placed_in_staging([i.nbytes for i in mine])
        cuda = next((i.tensor.device for i in mine if i.tensor.is_cuda), None)
        self._settle_prepare()
        self._staging.ensure(total, pin=cuda is not None, device=cuda)
        fence = self.overlap if cuda is not None else None
        running = self._staging.copy_in([i.tensor for i in mine], offsets, fence.stable() if fence else None)
        if running is not None and fence is not None and cuda is not None:
            fence.defer(running, cuda)  # the next optimizer step waits for the copy, on the GPU
        stall = time.monotonic() - started
        self.last_stall_s = stall
        self._attempt += 1
        token = f"{self._token}-{self._attempt}"
        self._events.emit("checkpoint_snapshot", step=step, stall_s=stall, bytes=total)
        if self._comm.rank == 0:
            self._since_full = 0 if chosen_base is None else self._since_full + 1
        request = PersistRequest(
            step=step,
            token=token,
            rank=self._comm.rank,
            world_size=self._comm.world_size,
            coordinator=self._comm.rank == 0,
            keep_last=self._keep_last,
            url=self.url,
            options=self._options,
            staging=self._staging.spec(),
            base=chosen_base,
            snapshot_mono=started,
            deadline_s=self._persist_timeout_s,
            faults=self._save_faults(step),
            wait=wait,
            mirrors=self._mirrors,
            failover_s=self._failover_s,
            durable_in=self._durable_in,
        )
        placed = [(i.id, o, i.nbytes, i.tensor.dtype, i.tensor.shape) for i, o in zip(mine, offsets, strict=True)]

        def build() -> PersistRequest:
            """The rest of the request, built on the sender thread after the stall: the skeleton's leaves are
            immutable values and its containers are new, so the training loop cannot change it meanwhile.
            Staging is handed over only once the copies left running on the GPU are done."""
            if running is not None:
                running.synchronize()
            buf = io.BytesIO()
            torch.save(skeleton, buf)
            request.skeleton = base64.b64encode(buf.getvalue()).decode("ascii")
            request.tensors = [
                {"id": tid, "offset": o, "nbytes": n, "dtype": dtype_name(dt), "shape": list(shape)}
                for tid, o, n, dt, shape in placed
            ]
            return request

        self._bg.submit(step, build)
        return self.wait_durable() if wait else True

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate the staging memory a save of a state like `state` needs, on a background thread, so that the
        first save after a start does not stall for it (faulting the pages in, registering them with CUDA: seconds
        for a GPU state of a few GB; `python -m stalwart.bench.first_save`, docs/benchmarks.md). Local to this rank
        (no collective). Any problem is left to the save itself to meet and report."""
        if self._preparing is not None or self._staging.size > 0:
            return
        try:
            _, items = flatten(state, self._comm.rank, self.replicated)
        except UnsavableStateError:
            return
        mine = self._owned(items)
        _, total = placed_in_staging([i.nbytes for i in mine])
        device = next((i.tensor.device for i in mine if i.tensor.is_cuda), None)

        def allocate() -> None:
            try:
                self._staging.ensure(total, pin=device is not None, device=device)
            except Exception:  # the save allocates again and reports what fails on the training thread
                with contextlib.suppress(Exception):
                    self._staging.close()

        self._preparing = threading.Thread(target=allocate, daemon=True, name="staging-prepare")
        self._preparing.start()

    def _settle_prepare(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def _owned(self, items: list[TensorItem]) -> list[TensorItem]:
        owners = assign_owners([(i.id, i.nbytes) for i in items if _shared(i)], self._comm.world_size)

        def writes(item: TensorItem) -> bool:
            if item.mine is not None:  # a DTensor shard: its owner was chosen when it was flattened
                return item.mine
            return not _shared(item) or owners[item.id] == self._comm.rank

        return [i for i in items if writes(i)]

    def _next_base(self) -> int:
        """Rank 0's choice for the next save: -1 for a full checkpoint, else the full one a delta refers to."""
        if self._full_every <= 1 or self._last_full is None or self._since_full >= self._full_every - 1:
            return -1
        return self._last_full

    def _finish_in_flight(self) -> None:
        if self._bg.in_flight is not None:
            waited = time.monotonic()
            self._note(self._bg.wait())
            self._events.emit("checkpoint_waited", seconds=time.monotonic() - waited)

    def _note(self, reply: PersistReply | None) -> None:
        if reply is not None and reply.committed and reply.full:
            self._last_full = reply.step
        elif reply is not None and self._mirrors:  # elsewhere or nowhere: the next is full, and may fail over
            self._last_full = None

    def wait_durable(self) -> bool:
        """Wait for the save in flight; whether it committed. Collective: every rank calls it."""
        reply = self._bg.wait()
        self._note(reply)
        committed = bool(reply is not None and reply.ok and reply.committed)  # rank 0's reply says
        return self._comm.broadcast(Flag(int(committed))).value == 1

    def poll(self) -> None:
        """Note a finished persist (rank 0 learns which full checkpoint a delta may refer to)."""
        if self._bg.in_flight is None:
            self._note(self._bg.wait(0))

    def close(self) -> None:
        """Stop the persister (an unfinished persist is abandoned, never half-committed) and free staging."""
        self._bg.close()
        self._settle_prepare()
        self._staging.close()
        if self._own_comm:
            self._comm.close()

    def abandon(self) -> None:
        """Kill the persister without waiting: the group failed, so a save in flight can never commit."""
        self._bg.abandon()
        self._settle_prepare()
        self._staging.close()

    # -- loading -----------------------------------------------------------------------------------------------

    def newest_committed(self, at_most: int | None = None) -> int:
        """The newest committed step (not after `at_most`), or -1 (none, or the directory cannot be listed now).
        Rank 0 only."""
        try:
            steps = layout.committed_steps(self.storage)
        except Exception:
            return -1
        steps = [s for s in steps if at_most is None or s <= at_most]
        return steps[0] if steps else -1

    def set_aside_after(self, step: int, reason: str) -> list[int]:
        """Move committed checkpoints of steps after `step` out of the step namespace, here and in every mirror (a
        later start lists them all; checkpoint/load/newest.py): after a rollback they hold a history the job
        abandoned. Nothing is deleted. Rank 0 only; the caller has waited for the save in flight."""
        moved = set_aside_after(self._locations(), self._events, step, reason)
        if moved:
            self._last_full = None  # a delta's base may be among them: the next save is a full one
        return moved

    def _locations(self) -> list[Storage]:
        """The checkpoint directory, then each mirror."""
        return [self.storage, *(open_storage(m["url"], m.get("options")) for m in self._mirrors)]

    def load_latest(self, *, allow_world_size_change: bool = False, at_most: int | None = None) -> Restored | None:
        """Load the newest checkpoint (not after step `at_most`) that verifies on every rank, here or in a mirror;
        None when there is no such checkpoint at all (checkpoint/load/newest.py)."""
        restored = load_newest(
            self._locations(),  # failover (issue 46)
            self._comm,
            self._events,
            allow_world_size_change=allow_world_size_change,
            at_most=at_most,
        )
        if restored is not None and self._comm.rank == 0:
            self._last_full = None  # the persister starts afresh: the next save is a full one
        return restored


def _shared(item: TensorItem) -> bool:
    return item.id.startswith("R/")
