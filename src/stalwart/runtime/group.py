"""The process group stalwart gives a job that re-forms in place: it absorbs a peer's failure, and the objects the
job's modules hold go on working after it is re-formed.

Why: a survivor of a peer's death must stay in its training loop (the L1 rung of the recovery ladder), but a
failed collective raises inside the user's loop body (DDP's all-reduce raises from `loss.backward()`), where no
library code can catch it and go on; and the user's DDP or FSDP object holds the group it was built with, so a new
group would leave it talking to the dead one. torch 2.13's `shrink_group` does not help on CPU: gloo reports
`supports_shrinking` False. So the job's default group (WORLD) is this wrapper, a Python `ProcessGroup` that
forwards every collective to a real backend (gloo for CPU tensors, NCCL for CUDA ones) and:

- absorbs a failure, inside the job's training loop (`absorb_failures`): a collective that fails (or is started
  after one failed) completes without error and leaves its tensors as they are, and the group records `failed`.
  The step's update is then dropped (the job's optimizer pre-hook, recovery/in_loop/) and the step is redone
  once the group is re-formed, so the partial gradients are never applied. This is torchft's design: errors are
  reported to a manager instead of raised;
- is re-formed at a step boundary: aborting the groups, then `dist.init_process_group(backend="stalwart")` with the
  next round's store, makes the next formation's group, and every older one forwards to it, so torch's default
  group, the user's DDP and FSDP2 modules (whichever object they hold) and stalwart's own groups all talk to the
  new round. A new object each time because torch's C++ group keeps the rank, size and backends it was made with.

DTensor's functional collectives (`redistribute`, `full_tensor`) on the default group come through this wrapper's
Python methods too (`all_gather_single_coalesced` says why), so they are absorbed alike. What it cannot absorb: a
failure of a collective made on another group (the user's own `new_group`), and a hang with no failure (the agent
kills the hung rank, which turns it into a failure).
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stalwart.runtime import backend_name, staged_scatter
from stalwart.runtime.torch_compat_groups import AllgatherOptions, group_args, nccl_options, register_backends
from stalwart.runtime.works import AbsorbingWork, AllOf, DoneWork, Given, Then

KEEP_DONE_AT_MOST = 1024
"""How many works that are done but whose caller was never served (an async collective never waited on) a
formation keeps (`ReformableGroup.give`); past it they are let go, the oldest first. Works not yet done are kept
whatever their number: their callers will come."""

BACKEND = "stalwart"
"""The name `init_process_group(backend=...)` knows this group by once `register()` ran."""


class ReformableGroup(dist.ProcessGroup):
    """The job's default group under in-place re-forming, one object per formation; see the module docstring.

    Every formation makes a new object (torch's C++ group fixes its rank, size and backends when made, and C++
    callers, DTensor's functional collectives among them, read those) and the older ones forward to it: an object
    held by the user's DDP or FSDP2 modules, or by anything else, runs its collectives on the newest formation's
    backends and reports the newest formation's failure.

    `cuda_backend`: what carries CUDA tensors, "nccl" (the default) or "gloo" (ranks sharing a device, which NCCL
    refuses: runtime/dist.init_process_group chooses it when a node has more ranks than GPUs).
    """

    cuda_backend = "nccl"

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, generation: int = 1, *, connect: bool = True
    ) -> None:
        """`store`: the round's (already prefixed by torch); `rank` and `size`: this process's place in it. Not
        `connect`: a placeholder that joins nobody, its collectives local (`join`), until the next formation."""
        made = _make_backends(store, rank, size, timeout) if connect else {}
        super().__init__(*group_args(store, rank, size, made, subclass=True))
        self._rank, self._size, self._store = rank, size, store
        # Re-entrant: the agent's request to re-form has a Python handler (recovery/in_loop/group_side.py) that runs on
        # the main thread between two bytecodes, also inside `absorb`, `give` or `served` holding this lock, and
        # calls `fail` -> `absorb`. With a plain lock that survivor waited for itself until the agent replaced it
        # (a fresh clone's quick tier, 2026-11-29: both frames in `absorb` in its stack dump).
        self._lock = threading.RLock()
        self._failed: BaseException | None = None
        self._given: dict[Given, None] = {}  # insertion-ordered: the oldest first (runtime/works.py says why)
        self._joining = not connect
        self._absorbing = False
        self._next: ReformableGroup | None = None
        self.generation = generation
        """Which formation of this process made the group: 1 for the first."""
        self.placeholder = not connect
        """A replacement's group that joins nobody until its loop starts (recovery/shrink.py)."""
        self._backends: dict[str, Any] = {device: backend for device, (_, backend) in made.items()}
        if made:  # none: a replacement whose survivors train on shrunk meanwhile (recovery/shrink.py)
            # Registered on the C++ side too, for C++ callers that ask the group for its backend by device.
            register_backends(self, made)

    def latest(self) -> ReformableGroup:
        """The newest formation's group (this one until the group is re-formed)."""
        group = self
        while group._next is not None:
            group = group._next
        return group

    def succeeded_by(self, group: ReformableGroup) -> None:
        """`group` is the next formation's: this one's backends go, its collectives go to `group`."""
        self.abort_backends()
        self._next = group

    @property
    def failed(self) -> BaseException | None:
        """The first failure the newest formation absorbed (None: the group is whole)."""
        return self.latest()._failed

    def absorb_failures(self, on: bool) -> None:
        """Absorb failed collectives from now on (`on`), or let them raise as any group's do. stalwart.Job turns it
        on for its training loop only (recovery/in_loop/): there a failed step is redone, while a collective
        of the user's set-up or after the loop that failed silently would leave wrong results behind."""
        self.latest()._absorbing = on

    def _backend(self, device: str) -> Any:
        backend = self._backends.get(device)
        if backend is None:
            raise ValueError(f"the stalwart process group has no backend for {device} tensors")
        return backend

    def abort_backends(self) -> None:
        """Abort the backends (NCCL's communicator must be aborted to unblock; gloo's just closes its pairs, where
        it can: torch 2.4's gloo has neither `abort` nor `shutdown`, and its pairs close when the backend is freed)."""
        for backend in self._backends.values():
            for name in ("abort", "shutdown"):
                method = getattr(backend, name, None)
                if method is not None:
                    with contextlib.suppress(Exception):
                        method()
                    break
        self._backends = {}

    def abort(self) -> None:
        """torch's `_abort_process_group` calls it from Python: the backends go, the object stays."""
        self.abort_backends()

    def shutdown(self) -> None:
        """torch's `destroy_process_group` calls it: as `abort`."""
        self.abort_backends()

    def absorb(self, exc: BaseException) -> None:
        """Record a failure on the newest formation; the first one is kept (the others follow from it). At the
        first, the collectives given out and not done complete at once (`AbsorbingWork.release`): a waiter in C++
        (DDP's reducer, inside `loss.backward()`) is not woken by a Python exception or signal handler, and would
        otherwise wait for a peer that left without a connection error until the collective timeout."""
        group = self.latest()
        with group._lock:
            first = group._failed is None
            if first:
                group._failed = exc
            given = list(group._given)
        if first:
            for work in given:
                work.release()

    def work_failed(self, exc: BaseException) -> None:
        """A collective run on this formation failed: recorded as `absorb` does, unless a newer formation exists.
        A work released when its formation failed (`absorb`) may fail on its backend much later, after the job
        re-formed; that says nothing of the newest formation, which would otherwise be taken as failed too."""
        if self._next is None:
            self.absorb(exc)

    def give(self, work: Given) -> dist.Work:
        """Hand `work` to the caller, kept here until the caller has been served (`served`; runtime/works.py says
        why) and released if the group fails first (`absorb`); a failed group releases it at once."""
        work.kept_by(self)
        with self._lock:
            self._given[work] = None
            if len(self._given) > KEEP_DONE_AT_MOST:
                self._let_go_of_done(len(self._given) - KEEP_DONE_AT_MOST)
            failed = self._failed is not None
        if failed:
            work.release()
        return work

    def _let_go_of_done(self, count: int) -> None:
        """Let go of the `count` oldest works that are done (under the lock)."""
        for work in [w for w in list(self._given) if w.is_completed()][:count]:  # a copy: a handler may pop
            self._given.pop(work, None)  # a handler's release may have let go of it meanwhile

    def served(self, work: Given) -> None:
        """`work`'s caller has what it came for: no longer kept."""
        with self._lock:
            self._given.pop(work, None)

    def fail(self, why: str) -> None:
        """Treat the group as failed from now on (the agent asked this rank to re-form)."""
        self.absorb(RuntimeError(why))

    def join(self, joining: bool) -> None:
        """While `joining`, collectives are not run and complete as if every rank held this one's tensors.

        Why: a replacement runs the user's set-up while the survivors wait at their step boundary, and that set-up
        makes collectives the survivors never make again (DDP's constructor verifies the parameters' shapes with
        an all-gather and broadcasts rank 0's parameters). Run for real they would meet the survivors' next
        step's all-reduce. Its state arrives afterwards from a survivor (the job's restore), so nothing the
        skipped collectives would have brought is missed; the job ends the joining once it has resumed."""
        self.latest()._joining = joining

    @property
    def joining(self) -> bool:
        """Whether collectives run locally (`join`): a broadcast then leaves a receiving rank's tensor as it was, so
        what broadcasts Python objects (a size, then the bytes) must not be run; see integrations/lightning.py."""
        return bool(self.latest()._joining)

    def _local(self, name: str, result: Any, args: tuple[Any, ...]) -> dist.Work:
        """A collective of a joining rank: every rank is taken to hold what this one holds. The input is copied
        first: an all-gather in place (its input a slice of its output, as DeviceMesh's set-up makes) would
        otherwise read what it overwrites."""
        if name == "allgather":
            for outs, tensor in zip(args[0], args[1], strict=False):
                mine = tensor.clone()
                for out in outs:
                    out.copy_(mine)
        elif name == "_allgather_base":
            out, tensor = args[0], args[1]
            out.view(-1, tensor.numel()).copy_(tensor.reshape(1, -1).clone())
        return self.latest().give(DoneWork(result))

    def _run(self, name: str, tensors: list[torch.Tensor], result: Any, *args: Any, then: Then = None) -> dist.Work:
        """Backend method `name` on the newest formation; `then`: as AbsorbingWork's (runtime/works.py)."""
        group = self.latest()
        if group._joining:
            return self._local(name, result, args)
        if group._failed is not None:
            if not group._absorbing:
                raise RuntimeError(f"the process group failed: {group._failed}")
            return group.give(DoneWork(result))
        device = tensors[0].device.type if tensors else "cpu"
        if not group._absorbing:
            return getattr(group._backend(device), name)(*args)
        try:
            work = getattr(group._backend(device), name)(*args)
        except Exception as exc:
            group.absorb(exc)
            return group.give(DoneWork(result))
        return AbsorbingWork(group, work, result, then)  # given out by the group as it is made

    # The collectives torch's Python API and DDP/FSDP call, forwarded by name (the backends' signatures).
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._run("allreduce", tensors, tensors, tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", tensors, tensors, tensors, opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._run("broadcast", tensors, tensors, tensors, opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts if opts is not None else AllgatherOptions()
        return self._run("allgather", inputs, outputs, outputs, inputs, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else AllgatherOptions()
        return self._run("_allgather_base", [input], [output], output, input, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """torch >= 2.13's name for `_allgather_base` (`dist.all_gather_into_tensor`, FSDP2)."""
        return self._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """torch >= 2.13's name for `_reduce_scatter_base` (`dist.reduce_scatter_tensor`, FSDP2)."""
        return self._reduce_scatter_base(output, input, opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """Where functional collectives' all-gather (DTensor's `full_tensor` and `redistribute`) reaches a Python
        group. Defined so that it runs here: torch's fallback enqueues on gloo from C++ while holding the GIL, and a
        gloo worker dropping an earlier collective's last tensor needs the GIL under the lock that enqueue takes,
        so the two deadlocked (one run in a few with FSDP2 on 3-4 ranks); from here the backend is called with
        the GIL released, and the collective is absorbed like any other. One collective per tensor."""
        opts = opts if opts is not None else AllgatherOptions()
        return self._each("_allgather_base", outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]  # torch < 2.13's name for it

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """Functional collectives' reduce-scatter: as `all_gather_single_coalesced`."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._each("_reduce_scatter_base", outputs, inputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]  # torch < 2.13's name for it

    def _each(self, name: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        works = [getattr(self, name)(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return works[0] if len(works) == 1 else self.latest().give(AllOf(works, outputs))

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None
    ) -> dist.Work:
        """torch >= 2.13's name for `alltoall_base`."""
        return self.alltoall_base(output, input, out_splits, in_splits, opts)

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if staged_scatter.applies(self.latest()._absorbing, outputs):
            [output], [parts] = outputs, inputs
            return self._staged(output, parts, sum(part.numel() for part in parts[: self.rank()]), outputs, opts)
        return self._run("reduce_scatter", outputs, outputs, outputs, inputs, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if staged_scatter.applies(self.latest()._absorbing, [output]):
            return self._staged(output, [input], self.rank() * output.numel(), [output], opts)
        return self._run("_reduce_scatter_base", [input], [output], output, input, opts)

    def _staged(self, out: torch.Tensor, parts: list[torch.Tensor], offset: int, result: Any, opts: Any) -> dist.Work:
        """A reduce-scatter run as the all-reduce gloo makes of it (runtime/staged_scatter.py says why)."""
        staged = staged_scatter.stage(out, parts, offset, opts)
        return self._run("allreduce", [staged.buffer], result, [staged.buffer], staged.options, then=staged.then)

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._run("alltoall_base", [input], [output], output, input, out_splits, in_splits, opts)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts if opts is not None else dist.GatherOptions()
        return self._run("gather", inputs, outputs, outputs, inputs, opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._run("scatter", outputs, outputs, outputs, inputs, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._run("reduce", tensors, tensors, tensors, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._run("send", tensors, tensors, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._run("recv", tensors, tensors, tensors, src, tag)

    def barrier(self, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._run("barrier", [], [], opts)

    def rank(self) -> int:
        return self.latest()._rank

    def size(self) -> int:
        return self.latest()._size

    def _set_group_name(self, name: str) -> None:
        """torch names every group it makes (`init_process_group` calls this); the C++ side keeps the name on the
        group's backends, which a Python group has none of, so it is kept here (DeviceMesh and FSDP2 read it)."""
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return getattr(self, "_group_name", "")

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        """A method, as torch's (torch 2.4's `destroy_process_group` calls it)."""
        return BACKEND


_current: ReformableGroup | None = None
_placeholder_next = False


def make_placeholder_next() -> None:
    """The next formation is a placeholder (`ReformableGroup(connect=False)`)."""
    global _placeholder_next
    _placeholder_next = True


def current() -> ReformableGroup | None:
    """The newest formation's group of this process, once one was made."""
    return _current


def _create(options: Any, backend_options: Any) -> dist.ProcessGroup:
    """torch's creator for BACKEND. The default group: a new ReformableGroup for every formation, which the previous
    one forwards to. A subgroup made from it (`dist.new_group`, a 2-D DeviceMesh's dimensions): a plain group over
    gloo and NCCL, which does not absorb failures; the re-formation does not make it again either, so a collective
    on it after a failure raises and takes the fallback (the script run again, recovery/reform.py)."""
    global _current
    store, rank, size, timeout = options.store, int(options.group_rank), int(options.group_size), options.timeout
    if list(options.global_ranks_in_group):
        return _plain(store, rank, size, timeout)
    global _placeholder_next
    previous, connect = _current, not _placeholder_next
    _placeholder_next = False
    generation = previous.generation + 1 if previous else 1
    _current = ReformableGroup(store, rank, size, timeout, generation=generation, connect=connect)
    if previous is not None:
        previous.succeeded_by(_current)
    return _current


def _plain(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    made = _make_backends(store, rank, size, timeout)
    group = dist.ProcessGroup(*group_args(store, rank, size, made))
    register_backends(group, made)
    return group


def _make_backends(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dict[str, tuple[Any, Any]]:
    """device -> (backend type, backend) of a formation: gloo for CPU tensors; for CUDA ones, when CUDA is there,
    NCCL (it makes its communicator at the first collective: the object costs nothing) or, with
    `ReformableGroup.cuda_backend` "gloo", the same gloo backend (it takes CUDA tensors as they are)."""
    kinds = dist.ProcessGroup.BackendType
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    made: dict[str, tuple[Any, Any]] = {"cpu": (kinds.GLOO, gloo)}
    if torch.cuda.is_available():
        if ReformableGroup.cuda_backend == "gloo":
            made["cuda"] = (kinds.GLOO, gloo)
        else:
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, nccl_options(timeout))
            made["cuda"] = (kinds.NCCL, nccl)
    return made


def register() -> None:
    """Make BACKEND known to `dist.init_process_group` (once per process), and `dist.get_backend` name the backend
    that runs its collectives (runtime/backend_name.py)."""
    if BACKEND not in dist.Backend.backend_list:  # where register_backend lists what it registered
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    backend_name.report_underlying(BACKEND, underlying_backend)


def underlying_backend() -> str:
    """What `dist.get_backend` says of stalwart's group: NCCL where CUDA tensors go to NCCL, else gloo."""
    return backend_name.underlying(ReformableGroup.cuda_backend)
