"""Where a checkpoint becomes visible: rank 0's persister writes the manifest last, then applies retention.

Every rank's persister writes its data file and then its meta file. Rank 0's persister (the coordinator) waits
for every rank's meta file, or for a rank's `.failed` marker, until the persist deadline (in its own location, and
once a rank may have moved on, in the others: failover.py); it then writes
`manifest.json`, listing each rank's meta file with its xxh3 and every tensor. That write is the commit: a
crash at any instant before it leaves the previous checkpoint the newest loadable one (load/verify.py reads a
checkpoint back only through its manifest). Retention runs after the commit, on its own thread, because
unlinking an old 100 MB file takes longer than writing the manifest and nobody needs to wait for it.
Imports no torch.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.save import failover
from stalwart.checkpoint.save.request import PersistRequest
from stalwart.checkpoint.save.retry import GaveUp, Quit, Retrier, Unanswered
from stalwart.checkpoint.save.save_hooks import SaveHooks
from stalwart.checkpoint.storage import Storage, describe_error
from stalwart.telemetry.events import EventLog

POLL_LOCAL_S = 0.01
POLL_REMOTE_S = 0.2
RETENTION_JOIN_S = 30.0
SILENT_FAILOVERS = 3
"""Where the job has mirrors, how many `failover_s` rank 0's location may stay silent during a commit, with no shard
landing in another location meanwhile, before the save is given up: the ranks still writing move to a mirror after
one (failover.py), and while their shards land there the wait goes on; once none lands, every shard is in the
silent location."""

T = TypeVar("T")

Rewrite = Callable[[int], bytes]
"""Writes rank 0's shard again in the location of that index; returns its new meta file's bytes."""


class Committer:
    """Rank 0's half of a save: gather the ranks' meta files, write the manifest, prune old checkpoints."""

    def __init__(self, events: EventLog, retrier: Retrier, quitting: threading.Event) -> None:
        self._events = events
        self._retrier = retrier
        self._quitting = quitting
        self._retention: queue.Queue[tuple[Storage, int, layout.Manifest] | None] = queue.Queue()
        self._retainer: threading.Thread | None = None
        self._prune_lock = threading.Lock()

    def commit(
        self,
        storages: dict[int, Storage],
        own: int,
        req: PersistRequest,
        own_meta: bytes,
        hooks: SaveHooks,
        rewrite: Rewrite,
    ) -> tuple[int, layout.Manifest]:
        """Write the manifest of `req.step` once every rank's meta file is in one location (rank 0's own, `own`,
        or another: `rewrite` then writes rank 0's shard there too; failover.py); returns the location's index and
        the manifest. Raises GaveUp otherwise."""
        step, token, world = req.step, req.token, req.world_size
        step_dir = layout.step_dir_name(step)
        own, metas = self._wait_for_metas(storages, own, req, own_meta, rewrite)
        storage = storages[own]
        ranks, tensors, written = [], {}, 0
        for rank in range(world):
            raw = metas[rank]
            parsed = json.loads(raw)
            ranks.append(layout.RankEntry(layout.meta_name(rank, token), len(raw), layout.xxh3(raw)))
            for tid, entry in parsed["tensors"].items():
                tensors[tid] = layout.TensorEntry.from_json(entry)
            written += int(parsed["written_bytes"])
        manifest = layout.Manifest(
            step=step,
            world_size=world,
            token=token,
            ranks=ranks,
            tensors=tensors,
            created=time.time(),
            base=req.base,
            written_bytes=written,
        )
        hooks.before_commit()
        text = manifest.to_json().encode()
        write = lambda: storage.write_bytes(f"{step_dir}/{layout.MANIFEST}", text)  # noqa: E731
        self._run_in_place(storages, own, req, "manifest", write)
        self._events.emit(
            "checkpoint_committed",
            step=step,
            bytes=manifest.state_bytes,
            written_bytes=written,
            kind="full" if manifest.base is None else "delta",
            base=manifest.base,
            seconds=time.monotonic() - req.snapshot_mono,
            path=storage.display(step_dir),
        )
        return own, manifest

    def _wait_for_metas(
        self, storages: dict[int, Storage], own: int, req: PersistRequest, own_meta: bytes, rewrite: Rewrite
    ) -> tuple[int, dict[int, bytes]]:
        step, token, world = req.step, req.token, req.world_size
        step_dir = layout.step_dir_name(step)
        wanted = {layout.meta_name(r, token): r for r in range(1, world)}  # rank 0's own meta is in memory
        failed = {layout.failed_name(r, token): r for r in range(world)}
        deadline = req.snapshot_mono + req.deadline_s  # the save's, as every write of it
        elsewhere_from = req.snapshot_mono + req.failover_s  # before then, no rank has moved on (failover.py)
        poll = POLL_LOCAL_S if storages[own].local_path() is not None else POLL_REMOTE_S
        answered = time.monotonic()  # when rank 0's location last listed the step, or a shard landed elsewhere
        elsewhere = 0  # the names seen in the other locations so far
        while True:
            if self._quitting.is_set():
                raise Quit
            listing = _listing(storages[own], step_dir)
            now = time.monotonic()
            if listing is not None:
                answered = now
            listings = {own: listing or set()}
            if not set(wanted) <= listings[own] and time.monotonic() >= elsewhere_from:  # the others, if need be
                listings |= {i: _listing(s, step_dir) or set() for i, s in storages.items() if i != own}
            seen = sum(len(names) for i, names in listings.items() if i != own)
            if seen > elsewhere:  # ranks still moving their shards to a mirror: not the end of this save
                elsewhere, answered = seen, now
            if listing is None and len(storages) > 1 and now - answered > SILENT_FAILOVERS * req.failover_s:
                # The location stopped answering after every rank wrote there (else they would be elsewhere by
                # now): this save cannot commit, and waiting for the deadline would hold the saves behind it.
                raise GaveUp(f"{storages[own].display()} stopped answering during the commit")
            gave_up = sorted(failed[n] for names in listings.values() for n in names & set(failed))
            if gave_up:
                raise GaveUp(f"rank {gave_up[0]} could not write its shard")
            place = failover.one_place(listings, set(wanted), own)
            if place is not None:
                break
            split = failover.split(listings, set(wanted))
            if split is not None:
                raise GaveUp(f"the ranks' shards are in different locations ({split})")
            if time.monotonic() > deadline:
                names = set().union(*listings.values())
                missing = sorted(r for n, r in wanted.items() if n not in names)
                raise GaveUp(f"ranks {missing} did not finish their shards within {req.deadline_s} s")
            time.sleep(poll)
        if place != own:  # the others' shards are elsewhere: rank 0's joins them there
            own_meta = rewrite(place)
        metas: dict[int, bytes] = {0: own_meta}
        for name, rank in wanted.items():
            rel = f"{step_dir}/{name}"
            read = storages[place].read
            read_meta = lambda rel=rel, read=read: read(rel)  # noqa: E731
            metas[rank] = self._run_in_place(storages, place, req, "meta read", read_meta)
        return place, metas

    def _run_in_place(
        self, storages: dict[int, Storage], index: int, req: PersistRequest, what: str, op: Callable[[], T]
    ) -> T:
        """`op` on the commit's location (`index`), retried. Where a location after it exists, only for
        `failover_s`: a location that stopped answering mid-commit gives the save up then (GaveUp: the previous
        checkpoint stays the newest) and the next save fails over, instead of retrying to the save's deadline while
        the saves behind it wait. The last location has the rest of the deadline, as its writes do (failover.py)."""
        until = time.monotonic() + req.failover_s if index < max(storages) else None
        try:
            return self._retrier.run(req, what, op, until)
        except Unanswered as exc:
            raise GaveUp(f"{exc}; the next save goes to a mirror") from exc

    # -- retention ---------------------------------------------------------------------------------------------

    def prune_later(self, storage: Storage, keep_last: int, manifest: layout.Manifest) -> None:
        """Retention on the retention thread, so neither the trainer nor the next persist waits for it."""
        self._retention.put((storage, keep_last, manifest))
        if self._retainer is None:
            self._retainer = threading.Thread(target=self._retain_loop, daemon=True, name="retention")
            self._retainer.start()

    def _retain_loop(self) -> None:
        while (item := self._retention.get()) is not None:
            self.prune(*item)

    def prune(self, storage: Storage, keep_last: int, manifest: layout.Manifest) -> None:
        """Retention after a commit. A step a save is still writing has no manifest and is newer than every
        committed one, so retention never takes it for an interrupted save; a copy of an older step into this
        location (mirroring.py) holds the location's lock until its manifest lands (failover.location_lock)."""
        try:
            # A waited-on save prunes on the persist thread: never two at once; nor during a copy there (mirroring).
            with self._prune_lock, failover.location_lock(storage.display()):
                removed = layout.prune(storage, keep_last, manifest)
        except Exception as exc:  # the commit stands; old checkpoints go after a later save
            self._events.emit("checkpoint_prune_failed", step=manifest.step, error=describe_error(exc))
            return
        if removed:
            self._events.emit("checkpoint_pruned", step=manifest.step, removed=removed)

    def finish(self) -> None:
        """Let queued retention finish (bounded), at exit."""
        if self._retainer is not None:
            self._retention.put(None)
            self._retainer.join(RETENTION_JOIN_S)


def _listing(storage: Storage, step_dir: str) -> set[str] | None:
    """The names in a step directory; None while the store cannot be listed (an outage)."""
    try:
        return set(storage.listdir(step_dir))
    except Exception:
        return None
