"""The persist half of a save: from the staging area to durable storage, off the training thread.

Each rank has one persister. By default it is a child process that takes no GIL time from training: hashing,
compressing and writing run in another process at a lower CPU priority. It is forked by this process's forker
(forked.py, `serve`): under `stalwart run` one the worker host forked before the script started, else one started
as an interpreter at the first persister; where none can fork it is started as
`python -m stalwart.checkpoint.save.persister` (`main`), which imports no torch, so it starts in a fraction of a
second. For a store only this process can see (`memory://`) it runs as a thread of the training process instead.

A request names a step, the staging memory (a memfd of the training process, opened through /proc) and the
tensors in it. The persister hashes every tensor (xxh3), writes the rank's data file and then its meta file,
retrying with backoff while the store fails (retry.py) until the persist deadline. Rank 0's persister also
commits the checkpoint (commit.py): it writes the manifest last and applies retention. Training never waits for
any of this except for the final checkpoint of a run.

Protocol: one JSON object per line on stdin (requests) and stdout (replies).
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.save import failover
from stalwart.checkpoint.save.committer import Committer
from stalwart.checkpoint.save.mirroring import Mirrors
from stalwart.checkpoint.save.request import PersistReply, PersistRequest
from stalwart.checkpoint.save.retry import GaveUp, Quit, Retrier, Unanswered, failed_marker
from stalwart.checkpoint.save.save_hooks import NoSaveHooks, SaveHooks, save_hooks
from stalwart.checkpoint.storage import LocalStorage, Storage, describe_error, open_storage
from stalwart.runtime.process import die_with_parent, say
from stalwart.telemetry.events import EventLog

WRITE_CHUNK = 8 << 20
ZSTD_LEVEL = 3

Reply = Callable[[PersistReply], None]


class Persister:
    """Executes persist requests one at a time; see the module docstring."""

    def __init__(self, events: EventLog, reply: Reply) -> None:
        self._events = events
        self._reply = reply
        self._storages: dict[str, Storage] = {}
        self._maps: dict[tuple[int, int, int], mmap.mmap] = {}
        self._fulls: dict[int, dict[str, layout.TensorEntry]] = {}  # this rank's newest full checkpoints
        self._own_meta = b""
        self.quitting = threading.Event()
        self._retrier = Retrier(events, self.quitting)
        self._committer = Committer(events, self._retrier, self.quitting)
        self._hooks: SaveHooks = NoSaveHooks()  # the current save's (checkpoint/save/save_hooks.py)
        self._mirrors = Mirrors(events)  # rank 0's: each committed checkpoint copied to the job's mirrors
        self._elsewhere = False  # rank 0: the newest commit went to a mirror (failover.py)
        self._prepared: set[str] = set()  # mirrors whose root this persister checked and marked (failover.py)
        self._skipped: dict[str, str] = {}  # why a location was passed over, by URL (failover.py)

    def handle(self, req: PersistRequest) -> None:
        started = time.monotonic()
        step, ok, committed = req.step, False, None
        manifest: layout.Manifest | None = None
        written = 0
        place: failover.Location | None = None
        try:
            self._hooks = save_hooks(req.faults, req.step, int(req.staging["pid"]), self._events)
            view = self._staging(req.staging)
            places = failover.locations(req)
            self._skipped.clear()
            place, written = self._write_somewhere(places, view, req)
            ok = True
            if req.coordinator:
                storages = {p.index: self._located(p) for p in places}
                index, manifest = self._committer.commit(
                    storages,
                    place.index,
                    req,
                    self._own_meta,
                    self._hooks,
                    functools.partial(self._rewrite, place, places, view, req),
                )
                place, committed = places[index], True
        except Quit:
            self._events.emit("checkpoint_abandoned", step=step, reason="the job is closing")
        except GaveUp as exc:
            self._events.emit("checkpoint_skipped", step=step, reason=str(exc))
            if req.coordinator:
                committed = False
        except Exception as exc:  # a defect, not the store: report it and stay alive for the next save
            self._events.emit("checkpoint_skipped", step=step, reason=f"persister error: {describe_error(exc)}")
            ok, committed = False, False
            self._gave_up(req)
        storage = self._located(place) if manifest is not None and place is not None else None
        if manifest is not None and storage is not None and place is not None:  # queued before the reply: a commit
            self._committed_elsewhere(place, req)  # the trainer saw is the mirrors' pending one
            others = failover.others(req, place.url)
            self._mirrors.committed(storage, step, req.keep_last, others, source=place.url)
            if req.durable_in == "all" and others:  # committed once every location has it
                committed = self._everywhere(req, [m["url"] for m in others])
        prune_first = req.wait  # a save the trainer waits on (a run's last) ends fully tidied
        if manifest is not None and storage is not None and prune_first:
            self._committer.prune(storage, req.keep_last, manifest)
        elsewhere = committed and place is not None and place.index != 0
        self._reply(
            PersistReply(
                step=step,
                ok=ok,
                committed=committed,
                full=req.base is None and not elsewhere,  # a later delta's base must be in the checkpoint directory
                written_bytes=written,
                seconds=time.monotonic() - started,
                location=place.url if elsewhere and place is not None else "",
            )
        )
        if manifest is not None and storage is not None and not prune_first:
            self._committer.prune_later(storage, req.keep_last, manifest)

    def _write_somewhere(
        self, places: list[failover.Location], view: memoryview, req: PersistRequest
    ) -> tuple[failover.Location, int]:
        """This rank's shard written in the first location that takes it within `failover_s` (the last one: within
        the save's deadline); see failover.py."""
        for place, after in zip(places, [*places[1:], None], strict=True):
            until = None if after is None else time.monotonic() + req.failover_s
            try:
                self._retrier.target = self._located(place)  # where a `.failed` marker goes
                if place.index != 0 and place.url not in self._prepared:  # a mirror: its root marker first
                    self._retrier.run(
                        req, "root", functools.partial(layout.prepare_root, self._located(place), create=True), until
                    )
                    self._prepared.add(place.url)
                return place, self._write_shard(self._located(place), view, req, until)
            except Unanswered as exc:
                assert after is not None
                self._skipped[place.url] = str(exc)
                self._events.emit(
                    "checkpoint_failover",
                    step=req.step,
                    location=place.url,
                    to=after.url,
                    error=str(exc),
                    after_s=req.failover_s,
                )
        raise AssertionError("the last location raises GaveUp, not Unanswered")

    def _rewrite(
        self, own: failover.Location, places: list[failover.Location], view: memoryview, req: PersistRequest, index: int
    ) -> bytes:
        """Rank 0's shard, first written in `own`, written again where the other ranks' are (`places[index]`, the
        commit's, failover.py); its new meta."""
        place = places[index]
        self._events.emit("checkpoint_failover", step=req.step, location=own.url, to=place.url, error="", after_s=0.0)
        self._write_shard(self._located(place), view, req, None)
        return self._own_meta

    def _everywhere(self, req: PersistRequest, urls: list[str]) -> bool:
        """Whether every one of `urls` got the checkpoint within the save's deadline (`durable_in="all"`)."""
        missing = self._mirrors.wait_copied(req.step, urls, req.snapshot_mono + req.deadline_s)
        if missing:
            self._events.emit("checkpoint_not_everywhere", step=req.step, missing=missing)
        return not missing

    def _gave_up(self, req: PersistRequest) -> None:
        """This rank will not write its shard: a `.failed` marker wherever rank 0 may look for it, so that its
        commit gives up now rather than at the save's deadline (best effort: a store may be down)."""
        rel = failed_marker(req)
        for place in failover.locations(req):
            if place.index == 0 or place.url in self._prepared:  # never files in a mirror stalwart has not marked
                with contextlib.suppress(Exception):
                    self._storage(place.url, place.options).write_bytes(rel, b"")

    def _located(self, place: failover.Location) -> Storage:
        return self._hooks.storage(self._storage(place.url, place.options))

    def _committed_elsewhere(self, place: failover.Location, req: PersistRequest) -> None:
        """Say once per outage, in rank 0's output, that checkpoints are committed in a mirror (and when the
        checkpoint directory takes them again); the locations before it are down until they take a copy."""
        step = req.step
        for skipped in failover.locations(req)[: place.index]:
            self._mirrors.failed_over(skipped.url, skipped.options, step, self._skipped.get(skipped.url, ""))
        if place.index != 0 and not self._elsewhere:
            say(
                f"stalwart: the checkpoint directory does not answer; step {step} was committed in the mirror "
                f"{place.url}, and the checkpoint directory is caught up when it answers"
            )
        elif place.index == 0 and self._elsewhere:
            say(f"stalwart: the checkpoint directory answers again; step {step} was committed there")
        self._elsewhere = place.index != 0

    def finish(self) -> None:
        """Let queued retention and the mirrors' pending copies finish (bounded), at exit."""
        self._committer.finish()
        self._mirrors.finish()

    # -- the rank's own files ---------------------------------------------------------------------------------

    def _write_shard(self, storage: Storage, view: memoryview, req: PersistRequest, until: float | None) -> int:
        """Write the rank's data file, then its meta file; returns the bytes of data written. Raises Unanswered
        when `storage` fails until `until` (failover.py)."""
        step, rank, token = req.step, req.rank, req.token
        step_dir = layout.step_dir_name(step)
        data_rel = f"{step_dir}/{layout.data_name(rank, token)}"
        self._retrier.target = storage  # where a `.failed` marker goes
        base = self._fulls.get(req.base)  # type: ignore[arg-type]
        self._retrier.run(req, "directory", lambda: storage.makedirs(step_dir), until)
        if base is None and isinstance(storage, LocalStorage):
            entries = self._write_image(storage, view, req, data_rel, until)
        else:
            entries = self._write_stream(storage, view, req, data_rel, base, until)
        written = sum(e.stored_bytes for e in entries.values() if e.file == data_rel)
        meta = {
            "format": "stalwart-shard",
            "rank": rank,
            "step": step,
            "token": token,
            "skeleton": req.skeleton,
            "tensors": {tid: e.to_json() for tid, e in entries.items()},
            "written_bytes": written,
        }
        self._own_meta = json.dumps(meta).encode()
        meta_rel = f"{step_dir}/{layout.meta_name(rank, token)}"
        # Atomic: rank 0 polls for this name and must never read it half-written. Its directory fsync also
        # makes the data file's name durable.
        self._retrier.run(req, "meta", lambda: storage.write(meta_rel, _writer(self._own_meta)), until)
        if base is None:
            self._fulls[step] = dict(entries)
            while len(self._fulls) > 2:  # the newest full one, and the one before while it may still commit
                del self._fulls[min(self._fulls)]
        return written

    def _write_image(
        self, storage: LocalStorage, view: memoryview, req: PersistRequest, data_rel: str, until: float | None
    ) -> dict[str, layout.TensorEntry]:
        """A full checkpoint on a local filesystem: the data file is the staging memory as it is, written with
        O_DIRECT while this thread hashes the tensors (the write releases the GIL)."""
        tensors: list[dict[str, Any]] = req.tensors
        length = max((int(t["offset"]) + int(t["nbytes"]) for t in tensors), default=0)
        on_half = self._hooks.on_half_written
        failure: list[BaseException] = []

        def write() -> None:
            try:
                image = lambda: self._image_once(storage, data_rel, view, length, req, on_half)  # noqa: E731
                self._retrier.run(req, "data", image, until)
            except BaseException as exc:
                failure.append(exc)

        writer = threading.Thread(target=write, name="image-writer")
        writer.start()
        entries = {}
        for t in tensors:
            raw = view[int(t["offset"]) : int(t["offset"]) + int(t["nbytes"])]
            entries[t["id"]] = layout.TensorEntry(
                data_rel,
                int(t["offset"]),
                len(raw),
                len(raw),
                t["dtype"],
                tuple(int(d) for d in t["shape"]),
                layout.xxh3(raw),
                "raw",
                *layout.block_digests(t["id"], raw),
            )
        writer.join()
        if failure:
            raise failure[0]
        return entries

    def _image_once(
        self,
        storage: LocalStorage,
        rel: str,
        view: memoryview,
        length: int,
        req: PersistRequest,
        on_half: Callable[[], None] | None,
    ) -> None:
        storage.write_image(rel, view, length, on_half, slot=layout.recycle_slot(req.rank))

    def _write_stream(
        self,
        storage: Storage,
        view: memoryview,
        req: PersistRequest,
        data_rel: str,
        base: dict[str, layout.TensorEntry] | None,
        until: float | None,
    ) -> dict[str, layout.TensorEntry]:
        """Object stores, and delta checkpoints: tensors one after another, each hashed as it goes; a delta
        skips tensors whose hash matches its base and compresses the others."""
        tensors: list[dict[str, Any]] = req.tensors
        half = sum(int(t["nbytes"]) for t in tensors) // 2
        on_half = self._hooks.on_half_written
        entries: dict[str, layout.TensorEntry] = {}

        def body(f: BinaryIO) -> None:
            nonlocal on_half
            entries.clear()
            offset = done = 0
            compressor = _zstd() if base is not None else None
            for t in tensors:
                raw = view[int(t["offset"]) : int(t["offset"]) + int(t["nbytes"])]
                digest = layout.xxh3(raw)
                old = base.get(t["id"]) if base is not None else None
                shape = tuple(int(d) for d in t["shape"])
                if old is not None and old.xxh3 == digest and old.dtype == t["dtype"] and old.shape == shape:
                    entries[t["id"]] = old
                    continue
                payload = memoryview(compressor.compress(raw)) if compressor is not None else raw
                for start in range(0, len(payload), WRITE_CHUNK):
                    f.write(payload[start : start + WRITE_CHUNK])
                blocks = layout.block_digests(t["id"], raw) if compressor is None else ((), 0)  # a part of zstd: no
                entries[t["id"]] = layout.TensorEntry(
                    data_rel,
                    offset,
                    len(payload),
                    len(raw),
                    t["dtype"],
                    shape,
                    digest,
                    "zstd" if compressor else "raw",
                    *blocks,
                )
                offset += len(payload)
                done += len(raw)
                if on_half is not None and done >= half:
                    fire, on_half = on_half, None
                    fire()

        self._retrier.run(req, "data", lambda: storage.write(data_rel, body, atomic=False), until)
        return entries

    # -- resources ---------------------------------------------------------------------------------------------

    def _storage(self, url: str, options: dict[str, Any] | None) -> Storage:
        if url not in self._storages:
            self._storages[url] = open_storage(url, options)
        return self._storages[url]

    def _staging(self, spec: dict[str, Any]) -> memoryview:
        key = (int(spec["pid"]), int(spec["fd"]), int(spec["size"]))
        if key not in self._maps:
            for old in self._maps.values():
                # A view of it may outlive its save (a failed upload's traceback holds the data it was writing):
                # the map is then freed with the last view, not here (BufferError was a persister error that
                # skipped the next save, issue 46's 60-s S3 outage).
                with contextlib.suppress(BufferError):
                    old.close()
            self._maps.clear()
            with open(f"/proc/{key[0]}/fd/{key[1]}", "rb") as f:
                self._maps[key] = mmap.mmap(f.fileno(), key[2], prot=mmap.PROT_READ) if key[2] else mmap.mmap(-1, 1)
        return memoryview(self._maps[key])


def _zstd() -> Any:
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL)


def _writer(data: bytes) -> Callable[[BinaryIO], None]:
    def write(f: BinaryIO) -> None:
        f.write(data)

    return write


def yield_cpu() -> None:
    """Run only on CPU time training leaves idle (SCHED_IDLE; else the lowest nice level). GPU training leaves
    most of the CPU idle; on a CPU-bound job persisting slows down instead of the training steps."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.nice(19)


def serve(log: dict[str, Any]) -> None:
    """Requests on stdin, replies on stdout, events to the job's event log (`log`: its path and common fields);
    returns when stdin closes or says quit and what was asked is done."""
    out_lock = threading.Lock()

    def reply(msg: PersistReply) -> None:
        try:
            with out_lock:
                sys.stdout.write(msg.to_json() + "\n")
                sys.stdout.flush()
        except (BrokenPipeError, ValueError):  # the training process is gone: so is the reason to run
            os._exit(0)

    events = EventLog(log["path"], **{**log["common"], "source": "persister"})
    persister = Persister(events, reply)
    requests: queue.Queue[PersistRequest | None] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["op"] == "quit":
                persister.quitting.set()
                break
            requests.put(PersistRequest.from_json(msg))
        persister.quitting.set()
        requests.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    while (req := requests.get()) is not None:
        persister.handle(req)
    persister.finish()
    events.close()


def main() -> None:
    """The persister process started as a new interpreter (checkpoint/save/background.py)."""
    die_with_parent()  # a killed worker leaves no persister behind
    yield_cpu()
    serve(json.loads(sys.argv[1]))


if __name__ == "__main__":
    main()
