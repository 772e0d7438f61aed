"""The process group stalwart gives a job that re-forms in place: it absorbs a peer's failure and is re-formed
under the same Python object.

Why: a survivor of a peer's death must stay in its training loop (the L1 rung of the recovery ladder), but a
failed collective raises inside the user's loop body (DDP's all-reduce raises from `loss.backward()`), where no
library code can catch it and go on; and the user's DDP or FSDP object holds the group it was built with, so a new
group would leave it talking to the dead one. torch 2.13's `shrink_group` does not help on CPU: gloo reports
`supports_shrinking` False. So the job's default group (WORLD) is this wrapper, a Python `ProcessGroup` that
forwards every collective to a real backend (gloo for CPU tensors, NCCL for CUDA ones) and:

- absorbs a failure: a collective that fails (or is started after one failed) completes without error and leaves
  its tensors as they are, and the group records `failed`. The step's update is then dropped (the job's optimizer
  pre-hook, recovery/in_loop.py) and the step is redone once the group is re-formed, so the partial gradients
  are never applied. This is torchft's design: errors are reported to a manager instead of raised;
- is re-formed at a step boundary: `dist.destroy_process_group()` then `dist.init_process_group(backend="stalwart")`
  with the next round's store hands the same object new backends (`configure`), so torch's default group, the
  user's DDP and stalwart's own groups all talk to the new round.

What it cannot absorb: a failure of a collective made on another group (the user's own `new_group`), a hang with
no failure (the agent kills the hung rank, which turns it into a failure), and a rank-count change seen by code
that read the size before (DDP reads it at construction: the in-place path keeps the world size).
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.futures import Future

BACKEND = "stalwart"
"""The name `init_process_group(backend=...)` knows this group by once `register()` ran."""


class _DoneWork(dist.Work):
    """A collective that was not run (the group has failed): done at once, its tensors left as they are."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: Future[Any] = Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _AbsorbingWork(dist.Work):
    """A collective of the real backend whose failure is recorded on the group instead of raised."""

    def __init__(self, group: ReformableGroup, work: dist.Work, result: Any) -> None:
        super().__init__()
        self._group, self._work, self._result = group, work, result
        self._future: Future[Any] = Future()

        def done(inner: Future[Any]) -> None:
            try:
                inner.value()
            except Exception as exc:
                group.absorb(exc)
            with contextlib.suppress(RuntimeError):  # set once, by whichever of wait() and the callback is first
                self._future.set_result(result)

        work.get_future().add_done_callback(done)

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as exc:
            self._group.absorb(exc)
        return True

    def get_future(self) -> Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def is_success(self) -> bool:
        return self._group.failed is None


class ReformableGroup(dist.ProcessGroup):
    """The job's default group under in-place re-forming; see the module docstring.

    `cuda_backend`: what carries CUDA tensors, "nccl" (the default) or "gloo" (ranks sharing a device, which NCCL
    refuses: runtime/dist.init_process_group chooses it when a node has more ranks than GPUs).

    torch fixes a ProcessGroup's C++ rank and size at construction, and C++ callers (DDP's reducer) read those;
    Python callers read `rank()`/`size()`, which follow `configure`. Re-forming keeps the world size, so both agree.
    """

    cuda_backend = "nccl"

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size = rank, size
        self._backends: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.failed: BaseException | None = None
        """The first failure absorbed since the last `configure` (None: the group is whole)."""
        self.generation = 0
        """How many times the group was configured: 1 after the first formation."""
        self.joining = False
        """A replacement joining a running job, before its state arrived: see `join`."""

    def configure(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        """Take backends for a new round: `store` is the round's (already prefixed by torch), `rank` and `size`
        this process's place in it. The previous backends are aborted first."""
        self.abort_backends()
        self.generation += 1
        self._rank, self._size = rank, size
        self._timeout = timeout
        self._store = store
        self._backends = {"cpu": dist.ProcessGroupGloo(store, rank, size, timeout)}
        self.failed = None

    def _backend(self, device: str) -> Any:
        backend = self._backends.get(device)
        if backend is None and device == "cuda" and self.cuda_backend == "gloo":
            backend = self._backends["cuda"] = self._backends["cpu"]  # gloo takes CUDA tensors as they are
        if backend is None and device == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            backend = self._backends["cuda"] = dist.ProcessGroupNCCL(
                dist.PrefixStore("nccl", self._store), self._rank, self._size, options
            )
        if backend is None:
            raise ValueError(f"the stalwart process group has no backend for {device} tensors")
        return backend

    def abort_backends(self) -> None:
        """Abort the backends (NCCL's communicator must be aborted to unblock; gloo's just closes its pairs)."""
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
        """Record a failure; the first one is kept (the others follow from it)."""
        with self._lock:
            if self.failed is None:
                self.failed = exc

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
        self.joining = joining

    def _local(self, name: str, result: Any, args: tuple[Any, ...]) -> dist.Work:
        """A collective of a joining rank: every rank is taken to hold what this one holds."""
        if name == "allgather":
            for outs, tensor in zip(args[0], args[1], strict=False):
                for out in outs:
                    out.copy_(tensor)
        elif name == "_allgather_base":
            out, tensor = args[0], args[1]
            out.view(-1, tensor.numel()).copy_(tensor.reshape(1, -1))
        return _DoneWork(result)

    def _run(self, name: str, tensors: list[torch.Tensor], result: Any, *args: Any) -> dist.Work:
        if self.joining:
            return self._local(name, result, args)
        if self.failed is not None:
            return _DoneWork(result)
        try:
            device = tensors[0].device.type if tensors else "cpu"
            work = getattr(self._backend(device), name)(*args)
        except Exception as exc:
            self.absorb(exc)
            return _DoneWork(result)
        return _AbsorbingWork(self, work, result)

    # The collectives torch's Python API and DDP/FSDP call, forwarded by name (the backends' signatures).
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else c10d.AllreduceOptions()
        return self._run("allreduce", tensors, tensors, tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", tensors, tensors, tensors, opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if opts is not None else c10d.BroadcastOptions()
        return self._run("broadcast", tensors, tensors, tensors, opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._run("allgather", inputs, outputs, outputs, inputs, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._run("_allgather_base", [input], [output], output, input, opts)

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        return self._run("reduce_scatter", outputs, outputs, outputs, inputs, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        return self._run("_reduce_scatter_base", [input], [output], output, input, opts)

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None
    ) -> dist.Work:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        return self._run("alltoall_base", [input], [output], output, input, out_splits, in_splits, opts)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts if opts is not None else c10d.GatherOptions()
        return self._run("gather", inputs, outputs, outputs, inputs, opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts if opts is not None else c10d.ScatterOptions()
        return self._run("scatter", outputs, outputs, outputs, inputs, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        opts = opts if opts is not None else c10d.ReduceOptions()
        return self._run("reduce", tensors, tensors, tensors, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._run("send", tensors, tensors, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._run("recv", tensors, tensors, tensors, src, tag)

    def barrier(self, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.BarrierOptions()
        return self._run("barrier", [], [], opts)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def name(self) -> str:  # type: ignore[override]
        return BACKEND


_current: ReformableGroup | None = None


def current() -> ReformableGroup | None:
    """This process's group, once made (it lives as long as the process: the user's DDP may hold it)."""
    return _current


def _create(options: Any, backend_options: Any) -> ReformableGroup:
    """torch's creator for BACKEND: the process's one group, made at the first formation and configured anew at
    every later one."""
    global _current
    rank, size = int(options.group_rank), int(options.group_size)
    if _current is None or _current.size() != size:
        _current = ReformableGroup(rank, size)
    _current.configure(options.store, rank, size, options.timeout)
    return _current


def register() -> None:
    """Make BACKEND known to `dist.init_process_group` (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def reset_ddp(module: torch.nn.Module, group: dist.ProcessGroup) -> bool:
    """Give a DDP module a fresh reducer on `group`, as its constructor made it; returns whether it is one.

    Why: after its first iteration DDP rebuilds its gradient buckets in the order the gradients became ready,
    while a replacement's new DDP starts with the constructor's buckets; an all-reduce of buckets laid out
    differently sums unrelated gradients. Every survivor resets its DDP modules when the group is re-formed, so
    survivors and replacements start the next step alike and rebuild their buckets together (the rebuild
    broadcasts rank 0's order) at the step after. torch's own `_update_process_group` keeps the rebuilt buckets
    for one more step, which is exactly the step that went wrong. Comm hooks registered on the module carry over.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, DistributedDataParallel):
        return False
    module.reducer._remove_autograd_hooks()
    module.process_group = group
    params, sparse = module._build_params_for_reducer()
    names = module._build_debug_param_to_name_mapping(params)
    module._ddp_init_helper(params, sparse, names, module.static_graph)
    if module.static_graph:
        module.reducer._set_static_graph()
        if module.logger is not None:
            module.logger._set_static_graph()
    for hook, state in module._comm_hooks:
        dist._register_comm_hook(module.reducer, state, hook)
    module._has_rebuilt_buckets = False
    module._static_graph_delay_allreduce_enqueued = False
    return True
