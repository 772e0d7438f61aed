"""Torch's internals in one place: every private torch member and every torch message text stalwart relies on.

Why one module (DESIGN.md, "Torch's internals"): torch changes its private members and its messages between
releases without notice, and such a change must fail a test, not a production run. Each entry says what it relies
on, why no public way serves, and the torch releases it was checked on; tests/test_torch_compat.py fails when torch
changes the thing, and holds every other module to importing it from here. Where torch offers a typed way (an
exception class, a flag, a public API), stalwart uses that instead and needs nothing here.

Two kinds of entries:
- functions and constants the callers use instead of the private member (grouped below by what they touch);
- CONTRACTS: private members stalwart overrides or patches in place (torch elastic's agent and rendezvous, the
  hooks torch calls on a Python ProcessGroup), which cannot move here; the test asserts that each still exists
  with the parameters the override expects.

The torch releases named in the docstrings are those whose behaviour a condition here meets (torch 2.4 before 2.5);
"checked on" names those on which tests/test_torch_compat.py passed. What a process group made in Python needs
(its backends, its options) is in runtime/torch_compat_groups.py, torch elastic's rendezvous in
runtime/torch_compat_rendezvous.py, under the same rules.
"""

from __future__ import annotations

import gc
import importlib
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from stalwart.errors import PeerGone

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor as DTensor
    from torch.distributed.tensor import Replicate as Replicate
    from torch.distributed.tensor import Shard as Shard
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.hooks import RemovableHandle


def torch_older_than(release: str) -> bool:
    """Whether the installed torch is older than `release` ("2.5"); a local build ("2.4.1+cu121") counts as its
    release. Only for the differences below that no feature reveals."""
    return torch.torch_version.TorchVersion(torch.__version__) < release


# ---- Messages: what torch raises as a plain RuntimeError, told apart by its text


WAIT_TIMED_OUT = "Operation timed out!"
"""What `Work.wait(timeout)` raises when the timeout passes before the collective completes (c10d's Work::wait):
a plain RuntimeError, not a DistError, like gloo's own failures, so only the text tells a slow collective from a
failed one. Checked on torch 2.4.1 and 2.13.0 (gloo)."""


def is_wait_timeout(exc: BaseException) -> bool:
    """Whether `exc` is a `Work.wait(timeout)` whose timeout passed: the collective may still complete."""
    return isinstance(exc, RuntimeError) and WAIT_TIMED_OUT in str(exc)


PEER_LOST_TEXTS = re.compile(
    r"Connection (reset|closed) by peer|Connection refused|Broken pipe|Socket Timeout|Timed out waiting|"
    r"timed out after|remote process exited|NCCL communicator was aborted|ncclRemoteError|failed to recv|"
    r"failed to send",
    re.IGNORECASE,
)
"""What a collective raises, as a plain RuntimeError, when the other side of a connection is gone or silent: gloo's
pair errors and timeouts, NCCL's remote errors and aborts. A user's bug (mismatched sizes, bad arguments) matches
none of them and keeps its full traceback. Checked on torch 2.4.1 and 2.13.0 with gloo and a killed peer
("Connection closed by peer"); the NCCL texts are unchecked here."""


def is_peer_failure(exc: BaseException) -> bool:
    """True for what a collective or the store raises when a peer is gone; False for a bug in this rank's code.
    torch's own network and store errors are told by their type (DistNetworkError, DistStoreError: public since
    torch 2.2), gloo's and NCCL's by PEER_LOST_TEXTS."""
    if isinstance(exc, PeerGone | dist.DistNetworkError | dist.DistStoreError):
        return True
    return isinstance(exc, RuntimeError) and bool(PEER_LOST_TEXTS.search(str(exc)))


# ---- Process groups


def abort_process_group() -> bool:
    """Abort the default group and every group made from it, without waiting on peers; False (nothing done) on a
    torch without `distributed_c10d._abort_process_group` (before 2.5), where the caller destroys the group
    instead. Why: NCCL's communicators must be aborted to unblock a survivor; `destroy_process_group` may wait.
    Checked on torch 2.4.1 (False) and 2.13.0."""
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return False
    abort()
    return True


# ---- DistributedDataParallel


def ddp_bucket_layout(module: DistributedDataParallel) -> list[list[int]] | None:
    """The DDP `module`'s buckets as lists of parameter indices once it rebuilt them, else None: torch exposes no
    layout (`_has_rebuilt_buckets`, `_build_params_for_reducer`, `_get_zeros_like_grad_buckets`). Checked on torch
    2.4.1 and 2.13.0."""
    if not module._has_rebuilt_buckets:
        return None
    index = {id(p): i for i, p in enumerate(module._build_params_for_reducer()[0])}
    return [[index[id(p)] for p in bucket.parameters()] for bucket in module.reducer._get_zeros_like_grad_buckets()]


def rebuild_ddp_reducer(
    module: DistributedDataParallel, group: dist.ProcessGroup, layout: list[list[int]] | None = None
) -> None:
    """Give the DDP `module` a fresh reducer on `group`, as its constructor made it; its comm hooks carry over
    (recovery/ddp_layout.reset_ddp says why). torch has no public way: `_update_process_group` keeps the rebuilt
    buckets.
    So this repeats what DDP's constructor does after its checks, through its private members: the reducer's
    `_remove_autograd_hooks` and `_set_static_graph`, DDP's `_build_params_for_reducer`,
    `_build_debug_param_to_name_mapping`, `_ddp_init_helper`, `_comm_hooks`, `_has_rebuilt_buckets` and
    `_static_graph_delay_allreduce_enqueued`, the logger's `_set_static_graph`, `dist._register_comm_hook`.
    `layout` (`ddp_bucket_layout`'s): taken as rebuilt; `dist._compute_bucket_assignment_by_size` answers it to the
    constructor for the call (reversed: the constructor reverses it). Checked on torch 2.4.1 and 2.13.0."""
    module.reducer._remove_autograd_hooks()
    module.process_group = group
    params, sparse = module._build_params_for_reducer()
    names = module._build_debug_param_to_name_mapping(params)
    if layout is None:
        module._ddp_init_helper(params, sparse, names, module.static_graph)
    else:
        assignment = dist._compute_bucket_assignment_by_size
        given = ([list(b) for b in reversed(layout)], [module.bucket_bytes_cap] * len(layout))
        dist._compute_bucket_assignment_by_size = lambda *args, **kwargs: given
        try:
            module._ddp_init_helper(params, sparse, names, module.static_graph)
        finally:
            dist._compute_bucket_assignment_by_size = assignment
    if module.static_graph:
        module.reducer._set_static_graph()
        if module.logger is not None:
            module.logger._set_static_graph()
    for hook, state in module._comm_hooks:
        dist._register_comm_hook(module.reducer, state, hook)
    module._has_rebuilt_buckets = layout is not None
    module._static_graph_delay_allreduce_enqueued = False


def live_ddp_modules() -> list[DistributedDataParallel]:
    """Every DDP wrapper alive in this process. torch keeps no registry of them, and a job tracks the module a
    wrapper wraps as often as the wrapper, so they are found among every object the collector tracks. type(), not
    isinstance(): isinstance asks a weakref proxy for its __class__, which a dead one raises on. Checked on torch
    2.4.1 and 2.13.0."""
    from torch.nn.parallel import DistributedDataParallel

    return [obj for obj in gc.get_objects() if issubclass(type(obj), DistributedDataParallel)]


# ---- Tensors, modules, optimizers and schedulers


def tensor_versions(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Each tensor's version counter, which every in-place write through torch bumps (not one through `.data` or
    numpy): torch exposes it only as the private `Tensor._version` (autograd's check of saved tensors reads it).
    Checked on torch 2.4.1 and 2.13.0."""
    return [t._version for t in tensors]


def module_state_dict_extended(module: torch.nn.Module) -> bool:
    """Whether `module` itself (not its children) may put more than its parameters in its state_dict: a buffer,
    a None one too (it may be set later), or a state-dict hook. torch's `buffers()` leaves None ones out and no
    public call tells of hooks: relies on `Module._buffers`, `_state_dict_hooks` and `_state_dict_pre_hooks`.
    Checked on torch 2.4.1 and 2.13.0."""
    return bool(
        module._buffers or getattr(module, "_state_dict_hooks", None) or getattr(module, "_state_dict_pre_hooks", None)
    )


def optimizer_state_dict_hooked(opt: torch.optim.Optimizer) -> bool:
    """Whether a state-dict pre- or post-hook is registered on `opt`: no public call tells; relies on
    `Optimizer._optimizer_state_dict_pre_hooks` and `_optimizer_state_dict_post_hooks`. Checked on torch 2.4.1 and
    2.13.0."""
    return bool(opt._optimizer_state_dict_pre_hooks or opt._optimizer_state_dict_post_hooks)


def register_first_step_pre_hook(opt: torch.optim.Optimizer, hook: Callable[..., Any]) -> RemovableHandle:
    """`opt.register_step_pre_hook(hook)`, run before the pre-hooks registered earlier: torch runs them in the
    order of the private `Optimizer._optimizer_step_pre_hooks` (an OrderedDict by handle id) and has no `prepend`.
    Checked on torch 2.4.1 and 2.13.0."""
    handle = opt.register_step_pre_hook(hook)
    cast("OrderedDict[int, Any]", opt._optimizer_step_pre_hooks).move_to_end(handle.id, last=False)
    return handle


def scale_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, factor: float) -> None:
    """Scale the rates `scheduler.get_last_lr()` reports, the private `_last_lr` its steps set (no setter): a world
    size change rescales them between steps, and what the scheduler reports must agree. Checked on torch 2.4.1 and
    2.13.0."""
    last = getattr(scheduler, "_last_lr", None)
    if isinstance(last, list):
        scheduler._last_lr = [lr * factor for lr in last]


def saved_last_lr(state: dict[str, Any]) -> list[float] | None:
    """The rates a learning-rate scheduler's state_dict recorded as its last (`get_last_lr()`), for a person reading
    a checkpoint (`stalwart ckpt inspect`): saved under the private member's name `_last_lr`. None when `state` is
    not such a state_dict. Checked on torch 2.4.1 and 2.13.0."""
    rates = state.get("_last_lr") if "last_epoch" in state else None
    return [float(r) for r in rates if isinstance(r, int | float)] if isinstance(rates, list) else None


def carry_scheduler_mark(real_step: Callable[..., Any], step: Callable[..., Any]) -> None:
    """Give `step`, which stands in for an optimizer's `real_step`, the mark torch's LR schedulers put on the step
    they wrap (`_wrapped_by_lr_sched`): without it the scheduler's next step warns that `optimizer.step()` was
    overridden after its initialization. Checked on torch 2.4.1 and 2.13.0."""
    if hasattr(real_step, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> Sequence[torch.Tensor]:
    """The 2-norm of each tensor, computed in `dtype` when given, as one fused operation: `torch._foreach_norm`,
    which clip_grad_norm_ uses (no public fused form). A torch whose `_foreach_norm` takes no dtype gets one norm
    per tensor. Checked on torch 2.4.1 and 2.13.0 (dtype taken)."""
    if dtype is None:
        return torch._foreach_norm(tensors)
    try:
        return torch._foreach_norm(tensors, 2, dtype=dtype)
    except (TypeError, RuntimeError):
        return [torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]


FIRST_STEP_IMPORTS = ("torch._dynamo",)
"""Modules torch imports at a process's first optimizer step, a large part of that step's time; a warm worker
host imports them beforehand (supervisor/worker_host.py). Checked on torch 2.4.1 and 2.13.0 (a fresh interpreter's first
AdamW step imports torch._dynamo)."""


# ---- Checkpoints and stores: where torch 2.4 differs


WEIGHTS_ONLY_REFUSES_BYTES = torch_older_than("2.5")
"""Whether `torch.load(weights_only=True)` refuses a `bytes` value, which torch.save stores as a call of
`_codecs.encode`: torch 2.4's does, later releases allow it (checkpoint/format/serialize.py allows it once where
refused). By version: only a load that fails would tell. Checked on torch 2.4.1 (refused) and 2.13.0 (allowed)."""

LIBUV_TAKES_LISTEN_FD = not torch_older_than("2.5")
"""Whether torch's default TCPStore server (libuv since torch 2.4) accepts a listening socket (`master_listen_fd`):
torch 2.4's logs an error and raises NotImplementedError, so runtime/store.py starts the legacy server there (and
falls back to it on that error with any torch). By version: only a store would tell. Checked on torch 2.4.1 (refused)
and 2.13.0."""

_DTENSOR_CLASSES = ("DTensor", "Replicate", "Shard")

if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        """DTensor, Replicate and Shard, imported when first asked for (`torch.distributed.tensor` is a large
        import, which the launcher need not pay): public since torch 2.5; torch 2.4 has the same classes in the
        private `torch.distributed._tensor`. Checked on torch 2.4.1 (the private module) and 2.13.0 (the public one)."""
        if name not in _DTENSOR_CLASSES:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module = importlib.import_module("torch.distributed.tensor")  # torch 2.4's lacks them (tensor.parallel)
        if not hasattr(module, name):
            module = importlib.import_module("torch.distributed._tensor")
        value = getattr(module, name)
        globals()[name] = value  # found as a plain attribute from now on: `is_dtensor` asks for every leaf of a state
        return value


# ---- torch elastic's launcher (its rendezvous: runtime/torch_compat_rendezvous.py)


def custom_device_name() -> str:
    """The name of a device backend registered beside CUDA, which torchrun's --nproc-per-node also takes: torch's
    private `_C._get_privateuse1_backend_name` (its default 'privateuseone' when none is), as torchrun reads it.
    Checked on torch 2.13.0."""
    return str(torch._C._get_privateuse1_backend_name())


# ---- What cannot move here: overridden and patched in place


@dataclass(frozen=True, slots=True)
class Contract:
    """A private member of torch that a stalwart module overrides, patches or reads in place."""

    owner: str
    """Where torch defines it: "module" or "module:Class"."""
    name: str
    """The member's name."""
    params: tuple[str, ...] | None
    """A method's or function's parameter names, in order (a trailing "..." allows more); None: an attribute
    that the owner's constructor sets (a class) or that the module defines."""
    where: str
    """The stalwart module that relies on it."""
    why: str
    checked_on: tuple[str, ...] = ("2.4.1", "2.13.0")
    """The torch releases on which tests/test_torch_compat.py found it as described."""


_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"
_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_GROUP = "torch.distributed:ProcessGroup"
_OVERRIDE = "overridden to add stalwart's rules; passes on what torch gives"

CONTRACTS: tuple[Contract, ...] = (
    Contract(_AGENT, "_start_workers", ("self", "worker_group"), "stalwart.supervisor.agent", _OVERRIDE),
    Contract(_AGENT, "_restart_workers", ("self", "worker_group"), "stalwart.supervisor.agent", _OVERRIDE),
    Contract(_AGENT, "_shutdown", ("self", "death_sig", "..."), "stalwart.supervisor.agent", _OVERRIDE),
    Contract(
        _AGENT,
        "_stop_workers",
        ("self", "worker_group", "..."),
        "stalwart.supervisor.agent",
        f"{_OVERRIDE}, whatever follows the worker group too (torch 2.4's takes is_restart)",
    ),
    Contract(_AGENT, "_monitor_workers", ("self", "worker_group"), "stalwart.supervisor.agent", _OVERRIDE),
    Contract(
        "torch.distributed.elastic.agent.server.api:SimpleElasticAgent",
        "_worker_group",
        None,
        "stalwart.supervisor.agent",
        "read: the spec's max_restarts",
    ),
    Contract(
        "torch.distributed.elastic.agent.server.api:SimpleElasticAgent",
        "_remaining_restarts",
        None,
        "stalwart.supervisor.agent",
        "read for the restart count; set to 0 to stop restarting (bad input, an excluded node)",
    ),
    Contract(
        _AGENT,
        "_pcontext",
        None,
        "stalwart.supervisor.agent",
        "read: the workers' process context, a HostContext when they run in host processes",
    ),
    Contract(
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "start_processes",
        ("name", "entrypoint", "args", "envs", "..."),
        "stalwart.supervisor.host_pool",
        "replaced while the agent starts workers in host processes; `_start_workers` calls it by this global name",
    ),
    Contract(
        "torch.distributed.elastic.multiprocessing.api:PContext",
        "pids",
        ("self",),
        "stalwart.supervisor.host_pool",
        "HostContext stands in for a PContext: what LocalElasticAgent calls on its `_pcontext`",
    ),
    Contract(
        "torch.distributed.elastic.multiprocessing.api:PContext",
        "wait",
        ("self", "timeout", "period"),
        "stalwart.supervisor.host_pool",
        "HostContext stands in for a PContext",
    ),
    Contract(
        "torch.distributed.elastic.multiprocessing.api:PContext",
        "close",
        ("self", "death_sig", "timeout"),
        "stalwart.supervisor.host_pool",
        "HostContext stands in for a PContext",
    ),
    Contract(
        _RDZV,
        "_delay",
        ("seconds",),
        "stalwart.supervisor.rendezvous",
        "patched during a round: the 1 s poll (its one fixed delay) shortened, the start skew (a tuple) skipped on "
        "one node",
    ),
    Contract(
        _RDZV,
        "get_method_name",
        ("depth",),
        "stalwart.supervisor.rendezvous",
        "replaced by one that reads sys._getframe instead of inspect.stack() (cheap event names)",
    ),
    Contract(
        _GROUP,
        "_set_group_name",
        ("self", "arg0"),
        "stalwart.runtime.group",
        "overridden: torch names every group it makes through it; a Python group keeps the name itself",
    ),
    Contract(_GROUP, "_set_group_desc", ("self", "arg0"), "stalwart.runtime.group", "overridden, as _set_group_name"),
    Contract(
        _GROUP,
        "_allgather_base",
        ("self", "output", "input", "opts"),
        "stalwart.runtime.group",
        "overridden: what dist.all_gather_into_tensor calls on a Python group",
    ),
    Contract(
        _GROUP,
        "_reduce_scatter_base",
        ("self", "outputTensor", "inputTensor", "opts"),
        "stalwart.runtime.group",
        "overridden: what dist.reduce_scatter_tensor calls on a Python group",
    ),
)
"""Every private torch member used in place by another module: what the test checks of each."""
