"""Torch's internals in one place (runtime/torch_compat.py): each private member or message text stalwart relies on
still behaves as described on the installed torch, every overridden or patched one still exists with the
parameters the override expects, and no other module reaches into torch's internals itself."""

from __future__ import annotations

import ast
import gc
import importlib
import inspect
import json
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stalwart
from conftest import child_env
from stalwart.runtime import (
    env,
    store,
    torch_compat,
    torch_compat_fsdp,
    torch_compat_groups,
    torch_compat_process,
    torch_compat_rendezvous,
)
from stalwart.runtime.process import spawn
from stalwart.runtime.torch_compat import CONTRACTS, Contract

SRC = Path(stalwart.__file__).parent
COMPAT = (
    "stalwart.runtime.torch_compat",
    "stalwart.runtime.torch_compat_groups",
    "stalwart.runtime.torch_compat_process",
    "stalwart.runtime.torch_compat_rendezvous",
    "stalwart.runtime.torch_compat_fsdp",
)
"""The modules that may reach into torch's internals."""
CHILD = Path(__file__).parent / "scripts" / "torch_compat_child.py"
pytestmark = pytest.mark.timeout(120)


# ---- Messages


def _gloo_pair() -> tuple[Any, Any]:
    """Two ranks of a gloo group in this process (threads as ranks), over a TCPStore on a free port."""
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    made: dict[int, Any] = {}

    def rank1() -> None:
        client = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=timedelta(seconds=30))
        made[1] = dist.ProcessGroupGloo(client, 1, 2, timedelta(seconds=30))

    thread = threading.Thread(target=rank1)
    thread.start()
    made[0] = dist.ProcessGroupGloo(server, 0, 2, timedelta(seconds=30))
    thread.join(30)
    return made[0], made[1]


def test_a_gloo_wait_that_times_out_is_told_apart_from_a_failure() -> None:
    """Rank 1 has not joined the all-reduce: rank 0's wait(timeout) raises, and that is a timeout, not a failure
    (the collective completes once rank 1 joins). torch raises no typed exception for it: should it ever, the
    type is what torch_compat.is_wait_timeout must check."""
    zero, one = _gloo_pair()
    mine = torch.ones(3)
    work = zero.allreduce([mine])
    with pytest.raises(RuntimeError) as raised:
        work.wait(timedelta(milliseconds=100))
    assert type(raised.value) is RuntimeError, "torch now types this timeout: check the type instead of the text"
    assert torch_compat.WAIT_TIMED_OUT in str(raised.value)
    assert torch_compat.is_wait_timeout(raised.value)
    assert not torch_compat.is_peer_failure(raised.value)
    one.allreduce([torch.ones(3)]).wait()
    assert work.wait() and mine.tolist() == [2.0, 2.0, 2.0]


def test_a_killed_peer_is_a_peer_failure_and_a_bug_is_not() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    peer = spawn(
        [sys.executable, str(CHILD), "peer", str(server.port)], stdout=subprocess.PIPE, env=child_env(), text=True
    )
    try:
        group = dist.ProcessGroupGloo(server, 0, 2, timedelta(seconds=30))
        group.allreduce([torch.ones(1)]).wait()
        assert peer.stdout is not None and peer.stdout.readline().strip() == "ready"
        peer.kill()
        peer.wait(30)
        with pytest.raises(RuntimeError) as raised:
            group.allreduce([torch.ones(1 << 16)]).wait(timedelta(seconds=20))
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        if peer.stdout is not None:
            peer.stdout.close()
    assert torch_compat.is_peer_failure(raised.value), f"not recognised: {raised.value}"
    assert not torch_compat.is_wait_timeout(raised.value)
    with pytest.raises(dist.DistStoreError) as store_timeout:
        server.wait(["never-set"], timedelta(milliseconds=50))
    assert torch_compat.is_peer_failure(store_timeout.value)
    bug = RuntimeError("The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 0")
    assert not torch_compat.is_peer_failure(bug) and not torch_compat.is_wait_timeout(bug)


# ---- Process groups and DDP


def _one_rank_group() -> dist.ProcessGroup:
    """A 1-rank group made in Python, its gloo backend given by torch_compat_groups.register_backends."""
    hashed = dist.HashStore()
    made = {"cpu": (dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(hashed, 0, 1, timedelta(seconds=10)))}
    group = dist.ProcessGroup(*torch_compat_groups.group_args(hashed, 0, 1, made))
    torch_compat_groups.register_backends(group, made)
    return group


def test_register_backends_gives_a_python_group_its_backend() -> None:
    group = _one_rank_group()
    assert group._get_backend(torch.device("cpu")).size() == 1
    assert not group._has_hooks()  # asks C++'s default backend: raises "Could not find the default backend" if none
    t = torch.tensor([3.0])
    group.allreduce([t]).wait()
    assert t.tolist() == [3.0]


def test_works_the_group_gives_to_cpp_keep_their_python_methods() -> None:
    """DDP's reducer (C++) takes each bucket's all-reduce from the re-formable group and at once asks it for its
    future. torch 2.4 keeps no Python work alive for a C++ holder: without the group keeping its works until served
    (runtime/works.py), the reducer meets torch's base Work ("Work::getFuture not implemented"). Served, they go."""
    from stalwart.runtime.group import ReformableGroup

    group = ReformableGroup(dist.HashStore(), 0, 1, timedelta(seconds=10))
    group.absorb_failures(True)
    ddp = DistributedDataParallel(torch.nn.Linear(64, 64), process_group=group)
    for _ in range(3):
        ddp(torch.randn(2, 64)).sum().backward()
        gc.collect()
    assert group.failed is None
    assert not group._given, "works kept after their callers were served"
    group.abort_backends()


def test_a_rebuilt_ddp_reducer_trains_on_the_new_group_with_its_comm_hook() -> None:
    """DDP trains on group `a`, is rebuilt on `b` (its bucket rebuild forgotten, its comm hook kept), `a` is shut
    down, and it trains on: bitwise as the same model trained without DDP (one rank)."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.load_state_dict(plain.state_dict())
    a, b = _one_rank_group(), _one_rank_group()
    ddp = DistributedDataParallel(model, process_group=a)
    calls = {"n": 0}

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses a string annotation on `bucket`
        state["n"] += 1
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(calls, hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, ddp)]
    data = [torch.randn(5, 4) for _ in range(6)]

    def step(x: torch.Tensor) -> None:
        for module, opt in zip((plain, ddp), opts, strict=True):
            opt.zero_grad()
            module(x).pow(2).sum().backward()
            opt.step()

    for x in data[:3]:
        step(x)
    assert ddp._has_rebuilt_buckets
    seen = calls["n"]
    torch_compat.rebuild_ddp_reducer(ddp, b)
    old = a._get_backend(torch.device("cpu"))
    if hasattr(old, "abort"):  # what the reducer must no longer use; torch 2.4's gloo cannot be aborted
        old.abort()
    assert ddp.process_group is b and not ddp._has_rebuilt_buckets
    for x in data[3:]:
        step(x)
    assert calls["n"] > seen, "the comm hook did not carry over"
    for mine, theirs in zip(plain.parameters(), ddp.module.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_ddp_reducer_rebuilt_with_a_given_layout_keeps_it() -> None:
    """The layout a DDP rebuilt after its first iteration is read, and a fresh reducer made with it has it, taken
    as rebuilt (no second rebuild): what a replacement takes from a survivor (recovery/ddp_layout.py). A model
    of several buckets."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(3)), torch.nn.Linear(512, 1))
    ddp = DistributedDataParallel(model, process_group=_one_rank_group(), bucket_cap_mb=1)
    assert torch_compat.ddp_bucket_layout(ddp) is None
    for _ in range(2):  # DDP rebuilds at the second iteration's forward, from the first one's order
        ddp(torch.randn(3, 512)).sum().backward()
    layout = torch_compat.ddp_bucket_layout(ddp)
    assert layout is not None and len(layout) > 1
    assert sorted(i for bucket in layout for i in bucket) == list(range(8))
    other = DistributedDataParallel(model, process_group=_one_rank_group(), bucket_cap_mb=1)
    torch_compat.rebuild_ddp_reducer(other, other.process_group, layout)
    assert other._has_rebuilt_buckets and torch_compat.ddp_bucket_layout(other) == layout
    other(torch.randn(3, 512)).sum().backward()
    assert torch_compat.ddp_bucket_layout(other) == layout


def test_nccl_options_carry_the_timeout() -> None:
    # The base of NCCL's options, present on a CPU build too: ProcessGroup.Options on torch 2.4.
    base = getattr(torch._C._distributed_c10d.Backend, "Options", None) or dist.ProcessGroup.Options
    assert "_timeout" in dir(base)
    if not hasattr(dist, "ProcessGroupNCCL"):
        pytest.skip("this torch has no NCCL")
    assert torch_compat_groups.nccl_options(timedelta(seconds=7))._timeout == timedelta(seconds=7)


def test_allgather_options_are_what_a_group_s_all_gather_takes() -> None:
    assert not hasattr(dist, "AllgatherOptions"), "now public: take it from torch.distributed"
    out, mine = [torch.zeros(2)], torch.tensor([1.0, 2.0])
    _one_rank_group().allgather([out], [mine], torch_compat_groups.AllgatherOptions()).wait()
    assert out[0].tolist() == [1.0, 2.0]


def test_every_live_ddp_wrapper_is_found_and_a_dead_proxy_is_passed_over() -> None:
    class Held:
        pass

    held = Held()
    proxy = weakref.proxy(held)
    del held  # a dead proxy among the objects: isinstance() on it would raise
    ddp = DistributedDataParallel(torch.nn.Linear(2, 2), process_group=_one_rank_group())
    assert any(found is ddp for found in torch_compat.live_ddp_modules())
    assert proxy is not None


@pytest.fixture(scope="module")
def fresh() -> dict[str, Any]:
    """What a fresh interpreter saw (tests/scripts/torch_compat_child.py)."""
    out = subprocess.run(
        [sys.executable, str(CHILD), "fresh"], capture_output=True, text=True, env=child_env(), timeout=100
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_abort_process_group_aborts_the_default_group(fresh: dict[str, Any]) -> None:
    if torch_compat.torch_older_than("2.5"):  # no _abort_process_group: nothing done, the caller destroys instead
        assert fresh["aborted"] is False and fresh["left"] is True
        return
    assert fresh["aborted"] is True and fresh["left"] is False


def test_the_first_optimizer_step_imports_what_a_warm_host_imports_before(fresh: dict[str, Any]) -> None:
    assert fresh["before"] == [], "imported with torch already: no need to import it before the first step"
    assert fresh["imported"] == list(torch_compat.FIRST_STEP_IMPORTS)


# ---- Tensors, modules, optimizers and schedulers


def test_tensor_versions_count_in_place_writes() -> None:
    t, u = torch.zeros(3), torch.zeros(3)
    before = torch_compat.tensor_versions([t, u])
    t.add_(1)
    t[0] = 5
    after = torch_compat.tensor_versions([t, u])
    assert after[0] == before[0] + 2 and after[1] == before[1]


def test_what_may_extend_a_module_s_state_dict() -> None:
    assert not torch_compat.module_state_dict_extended(torch.nn.Linear(2, 2))
    norm = torch.nn.BatchNorm1d(2)
    assert torch_compat.module_state_dict_extended(norm)
    empty = torch.nn.Linear(2, 2)
    empty.register_buffer("later", None)
    assert torch_compat.module_state_dict_extended(empty) and not list(empty.buffers())
    hooked = torch.nn.Linear(2, 2)
    # Public since torch 2.5; torch 2.4 registers the same hook only through the private name.
    register = getattr(hooked, "register_state_dict_post_hook", None) or hooked._register_state_dict_hook
    register(lambda module, state, prefix, local: None)
    assert torch_compat.module_state_dict_extended(hooked)
    pre = torch.nn.Linear(2, 2)
    pre.register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)
    assert torch_compat.module_state_dict_extended(pre)


def test_an_optimizer_s_state_dict_hooks_are_seen() -> None:
    def make() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    plain, pre, post = make(), make(), make()
    pre.register_state_dict_pre_hook(lambda opt: None)
    post.register_state_dict_post_hook(lambda opt, state: state)
    assert not torch_compat.optimizer_state_dict_hooked(plain)
    assert torch_compat.optimizer_state_dict_hooked(pre) and torch_compat.optimizer_state_dict_hooked(post)


def test_the_first_step_pre_hook_runs_before_the_earlier_ones() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    ran: list[str] = []
    opt.register_step_pre_hook(lambda *a: ran.append("earlier"))
    handle = torch_compat.register_first_step_pre_hook(opt, lambda *a: ran.append("first"))
    param.grad = torch.ones(1)
    opt.step()
    assert ran == ["first", "earlier"]
    handle.remove()
    opt.step()
    assert ran == ["first", "earlier", "earlier"]


def test_a_scheduler_s_saved_last_rates_are_read_as_it_reports_them() -> None:
    optim = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    optim.step()
    sched.step()
    assert torch_compat.saved_last_lr(sched.state_dict()) == sched.get_last_lr() == [0.05]
    assert torch_compat.saved_last_lr(optim.state_dict()) is None


def test_a_scaled_last_lr_is_what_the_scheduler_reports() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    torch_compat.scale_last_lr(scheduler, 0.5)
    assert scheduler.get_last_lr() == [0.2]


def test_a_stand_in_step_carries_the_scheduler_s_mark() -> None:
    """Without the mark torch's scheduler warns that the optimizer's step was replaced (the reason for it)."""
    for carry in (False, True):
        param = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([param], lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        real = opt.step

        def step(*args: Any, real: Any = real, **kwargs: Any) -> Any:
            return real(*args, **kwargs)

        if carry:
            torch_compat.carry_scheduler_mark(real, step)
        opt.step = step  # type: ignore[method-assign]
        param.grad = torch.ones(1)
        opt.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scheduler.step()
        overridden = [w for w in caught if "overridden" in str(w.message)]
        assert bool(overridden) is not carry


def test_foreach_norm_is_each_tensor_s_norm_in_the_dtype_asked() -> None:
    tensors = [torch.randn(5), torch.randn(3, 2)]
    wanted = [torch.linalg.vector_norm(t) for t in tensors]
    assert all(torch.equal(a, b) for a, b in zip(torch_compat.foreach_norm(tensors), wanted, strict=True))
    half = [t.to(torch.bfloat16) for t in tensors]
    torch._foreach_norm(half, 2, dtype=torch.float32)  # the fused form with a dtype: the fallback is not needed
    norms = torch_compat.foreach_norm(half, torch.float32)
    assert [n.dtype for n in norms] == [torch.float32, torch.float32]
    wide = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in half]
    assert all(torch.allclose(a, b) for a, b in zip(norms, wide, strict=True))


# ---- Checkpoints and stores


def test_weights_only_loading_of_bytes_is_as_the_condition_says(tmp_path: Path) -> None:
    import _codecs

    if _codecs.encode in torch.serialization.get_safe_globals():
        pytest.skip("allowed in this process already")
    torch.save({"b": b"raw"}, tmp_path / "s.pt")
    if torch_compat.WEIGHTS_ONLY_REFUSES_BYTES:
        with pytest.raises(Exception, match="encode"):
            torch.load(tmp_path / "s.pt", weights_only=True)
    else:
        assert torch.load(tmp_path / "s.pt", weights_only=True) == {"b": b"raw"}


def test_the_default_store_server_takes_a_listening_socket_as_the_condition_says() -> None:
    sock = store.bound_listener("127.0.0.1", 0)
    port = sock.getsockname()[1]
    serve: dict[str, Any] = {"is_master": True, "wait_for_workers": False, "master_listen_fd": sock.fileno()}
    if not torch_compat.LIBUV_TAKES_LISTEN_FD:
        with pytest.raises(NotImplementedError):
            dist.TCPStore("127.0.0.1", port, 1, use_libuv=True, **serve)
        sock.close()
        return
    server = dist.TCPStore("127.0.0.1", port, 1, use_libuv=True, **serve)
    sock.detach()
    assert server.libuvBackend
    server.set("k", "v")
    assert server.get("k") == b"v"


def test_dtensor_classes_are_the_public_module_s() -> None:
    public = importlib.import_module("torch.distributed.tensor")
    assert hasattr(public, "DTensor") is not torch_compat.torch_older_than("2.5")
    if not hasattr(public, "DTensor"):  # torch 2.4: the private module's
        public = importlib.import_module("torch.distributed._tensor")
    assert torch_compat.DTensor is public.DTensor
    assert (torch_compat.Replicate, torch_compat.Shard) == (public.Replicate, public.Shard)
    with pytest.raises(AttributeError):
        torch_compat.NotThere  # noqa: B018


def test_a_rank_change_in_one_process_meets_no_stale_sharding() -> None:
    """Two meshes over the same ranks compare equal whatever rank this process holds in them, so DTensor's sharding
    caches hand an op on the second mesh an output on the first, at the old rank's coordinate: what a warm spare
    given another rank met (its FSDP2 parameters sharded as the old rank). forget_sharding_caches clears them."""
    if torch_compat.torch_older_than("2.6"):
        pytest.skip("DeviceMesh takes no _rank before torch 2.6")
    from torch.distributed.device_mesh import DeviceMesh

    old = DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=1)
    new = DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0)
    assert old == new and old.get_coordinate() != new.get_coordinate()

    def doubled_on(mesh: Any) -> Any:
        x = torch_compat.DTensor.from_local(torch.ones(2, 3), mesh, [torch_compat.Shard(0)], run_check=False)
        return (x * 2).device_mesh.get_coordinate()

    torch_compat_groups.forget_sharding_caches()  # nothing an earlier test cached on an equal mesh
    assert doubled_on(old) == (1,)
    assert doubled_on(new) == (1,), "torch no longer hands out a stale sharding: the clearing may go"
    assert torch_compat_groups.forget_sharding_caches()
    assert doubled_on(new) == (0,)


@pytest.mark.parametrize("grouped", [False, True], ids=["one-at-a-time", "wrapped-together"])
def test_fsdp2_modules_are_sharded_again_in_place_on_a_smaller_group(tmp_path: Path, grouped: bool) -> None:
    """Two ranks train an FSDP2 model, one leaves: the other shards the same modules again on a group of one, each
    parameter on the dimension it was sharded on, with the settings given after `fully_shard`; the optimizer follows
    the new parameters, the full state taken before loads bit for bit and a step trains them (what a survivor of a
    lost host does instead of running its script again: recovery/in_loop/driver.py). Wrapped together
    (`fully_shard([a, b])`, as torchtitan wraps its last norm and output), the two layers are wrapped together
    again: one state, one `fully_shard` call."""
    if torch_compat.torch_older_than("2.6"):
        pytest.skip("FSDP2 on CPU needs torch 2.6")
    done = subprocess.run(
        [sys.executable, str(CHILD), "reshard", str(tmp_path), *(["grouped"] if grouped else [])],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=100,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["why_not"] is None and report["modules"] == (2 if grouped else 3), report
    assert report["class"] == "FSDPSequential", "the root is an FSDP module again"
    assert report["wrapped_classes"] == ["FSDPLinear", "FSDPLinear"], report
    assert report["one_state"] is grouped, "wrapped together again exactly when they were"
    assert report["local_shapes"] == [[12, 7], [12], [5, 12], [5]], "each parameter whole on a group of one"
    assert report["shard_dims"] == ([0, 0, 0, 0] if grouped else [0, 0, 1, 0]), report
    assert report["reshard_after_backward"] is False, "a setting given after fully_shard survives"
    assert report["new_parameters"] and report["optimizer_follows"], report
    assert report["loaded_equal"] and report["trained"] and report["optimizer_states"] == 4, report


def test_what_cannot_be_sharded_again_in_place_is_named() -> None:
    """Prefetching set by hand between modules (their states point at one another) is not carried over: `why_not`
    names it and leaves the model as it is."""
    if torch_compat.torch_older_than("2.6"):
        pytest.skip("FSDP2 on CPU needs torch 2.6")
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
        assert torch_compat_fsdp.why_not([model], 1, 1) is None, "nothing to shard: nothing stands in the way"
        fully_shard(model[0])
        fully_shard(model[1])
        fully_shard(model)
        model[0].set_modules_to_forward_prefetch([model[1]])
        why = torch_compat_fsdp.why_not([model], 1, 1)
        assert why is not None and "prefetching set by hand" in why, why
        with pytest.raises(ValueError):
            torch_compat_fsdp.reshard_in_place([model], 1)
    finally:
        dist.destroy_process_group()


def test_what_the_modules_are_sharded_for_is_read_once_their_group_is_gone() -> None:
    """`sharded_as`: the mesh's size and this process's coordinate, read after a failure aborted the group (the
    survivor's case: asking the mesh its local rank asks the group, which is gone)."""
    if torch_compat.torch_older_than("2.6"):
        pytest.skip("FSDP2 on CPU needs torch 2.6")
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    assert torch_compat_fsdp.sharded_as([model]) is None, "nothing sharded"
    fully_shard(model[0])
    fully_shard(model)
    dist.destroy_process_group()
    assert torch_compat_fsdp.sharded_as([model]) == (1, 0)


# ---- torch elastic


def test_rendezvous_and_launcher_helpers() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    assert torch_compat.custom_device_name() == "privateuseone", "no device backend is registered beside CUDA here"
    assert torch_compat_rendezvous.matches_machine_hostname("localhost")
    assert torch_compat_rendezvous.matches_machine_hostname("127.0.0.1")
    assert not torch_compat_rendezvous.matches_machine_hostname("192.0.2.1")
    static = RendezvousParameters(backend="static", endpoint="10.1.2.3:29511", run_id="r", min_nodes=1, max_nodes=1)
    assert torch_compat_rendezvous.static_master(static) == ("10.1.2.3", 29511)
    params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id="r", min_nodes=1, max_nodes=2)
    hashed = dist.HashStore()
    handler = create_handler(hashed, C10dRendezvousBackend(hashed, "r"), params)
    assert torch_compat_rendezvous.set_last_call(handler, timedelta(seconds=3))
    assert handler.settings.timeout.last_call == timedelta(seconds=3)
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    if torch_compat_rendezvous.rendezvous_gives_local_addr():
        assert RendezvousStoreInfo.build(0, hashed, local_addr="10.9.8.7").master_addr == "10.9.8.7"
    else:  # torch 2.4: the host's FQDN, whatever --local-addr says (supervisor/rendezvous.py publishes it instead)
        assert RendezvousStoreInfo.build(0, hashed).master_addr == socket.getfqdn()


def test_an_agent_sees_another_nodes_change_once_its_shortened_state_cache_runs_out() -> None:
    """supervisor/rendezvous.py shortens how long an agent trusts the rendezvous state it read (torch's 1 s): a node
    that joined the wait list is seen by the other agent's `num_nodes_waiting()` once that time has passed."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id="r", min_nodes=1, max_nodes=2)
    hashed = dist.HashStore()
    watching, other = (dr.create_handler(hashed, C10dRendezvousBackend(hashed, "r"), params) for _ in range(2))
    assert torch_compat_rendezvous.set_state_cache(watching, 0.05)
    assert watching.num_nodes_waiting() == 0
    holder = other._state_holder
    holder.sync()
    holder.state.wait_list.add(dr._NodeDesc("10.0.0.2", 4242, 0))
    holder.mark_dirty()
    holder.sync()
    time.sleep(0.1)
    assert watching.num_nodes_waiting() == 1


def test_a_node_found_gone_leaves_the_completed_round_at_the_next_sync() -> None:
    """supervisor/lifeline.py: the node a waiting agent waits for (a participant of a completed round it left) is
    named, and once marked gone torch's own sanitizer removes it at the handler's next sync."""
    from datetime import UTC, datetime

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id="r", min_nodes=1, max_nodes=2)
    hashed = dist.HashStore()
    handler = dr.create_handler(hashed, C10dRendezvousBackend(hashed, "r"), params)
    holder = handler._state_holder
    holder.sync()
    other = dr._NodeDesc("10.0.0.2", 4242, 0)
    state = holder.state
    state.participants[other] = 0
    aware = "timezone.utc" in inspect.getsource(dr._BackendRendezvousStateHolder._sanitize)  # torch 2.4: naive
    state.last_heartbeats[other] = datetime.now(UTC) if aware else datetime.now(UTC).replace(tzinfo=None)
    state.complete = True
    holder.mark_dirty()
    holder.sync()
    assert torch_compat_rendezvous.this_node(handler) not in holder.state.participants
    assert torch_compat_rendezvous.blocking_nodes(handler) == [other]
    assert torch_compat_rendezvous.node_key(other) == "10.0.0.2_4242_0" == repr(other)
    assert torch_compat_rendezvous.mark_gone(handler, other)
    holder.sync()  # writes the lapsed keep-alive; the sanitizer removes the node
    holder.sync()
    assert other not in holder.state.participants and not torch_compat_rendezvous.blocking_nodes(handler)


def test_a_node_on_the_redundancy_list_of_a_completed_round_waits_as_a_spare() -> None:
    """supervisor/spare_host.py warms spares only while its node waits as a spare: on the redundancy list of a
    completed round it is not part of; not while the round is open, nor as one of its participants."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id="r", min_nodes=1, max_nodes=1)
    hashed = dist.HashStore()
    handler = dr.create_handler(hashed, C10dRendezvousBackend(hashed, "r"), params)
    holder = handler._state_holder
    holder.sync()
    me, other = torch_compat_rendezvous.this_node(handler), dr._NodeDesc("10.0.0.2", 4242, 0)
    holder.state.redundancy_list.add(me)
    assert not torch_compat_rendezvous.waits_as_spare(handler), "the round is not complete"
    holder.state.participants[other] = 0
    holder.state.complete = True
    assert torch_compat_rendezvous.waits_as_spare(handler)
    holder.state.participants[me] = 1
    assert not torch_compat_rendezvous.waits_as_spare(handler), "a participant is no spare"


def test_group_ranks_are_numbered_as_the_nodes_had_them_where_they_can_be() -> None:
    assert torch_compat_rendezvous.stable_ranks(["b", "c"], {"b": 1}) == {"b": 1, "c": 0}
    assert torch_compat_rendezvous.stable_ranks(["b", "c"], {}) == {"b": 0, "c": 1}, "a first round: torch's order"
    assert torch_compat_rendezvous.stable_ranks(["c"], {"c": 1}) == {"c": 0}, "a rank beyond the round's size"
    assert torch_compat_rendezvous.stable_ranks(["a", "b", "c"], {"a": 2, "b": 2, "c": 0}) == {"a": 2, "b": 1, "c": 0}


def test_a_survivor_keeps_its_group_rank_when_a_new_node_sorts_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch numbers a round's nodes by address: node a (10.0.0.1, rank 0) is lost and node c (10.0.0.3) joins in its
    place; torch would make survivor b (10.0.0.2) rank 0, and b's node memory holds snapshots of rank 1. With
    `keep_ranks` b stays rank 1 and c takes the lost rank 0."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    monkeypatch.setenv(env.SHARE_STORE_ENV, "1")  # rank 0 would host a store at its (made-up) address otherwise
    hashed = dist.HashStore()

    def node(addr: str) -> Any:
        params = RendezvousParameters("c10d", "localhost:0", "r", 2, 2, local_addr=addr, join_timeout="60")
        handler = dr.create_handler(hashed, C10dRendezvousBackend(hashed, "r"), params)
        assert torch_compat_rendezvous.keep_ranks(handler)
        return handler

    def together(*handlers: Any) -> dict[str, int]:
        ranks: dict[str, int] = {}

        def join(handler: Any) -> None:
            ranks[torch_compat_rendezvous.this_node(handler).addr] = handler.next_rendezvous().rank

        threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return ranks

    a, b = node("10.0.0.1"), node("10.0.0.2")
    c = None
    try:
        assert together(a, b) == {"10.0.0.1": 0, "10.0.0.2": 1}
        a._stop_heartbeats()  # a is lost; the lifeline marks it gone (supervisor/lifeline.py)
        holder = b._state_holder
        holder.sync()
        assert torch_compat_rendezvous.mark_gone(b, torch_compat_rendezvous.this_node(a))
        holder.sync()
        holder.sync()
        c = node("10.0.0.3")
        nodes = [torch_compat_rendezvous.this_node(h) for h in (b, c)]
        assert sorted(nodes) == nodes, "torch's own order would make b rank 0"
        assert together(b, c) == {"10.0.0.2": 1, "10.0.0.3": 0}
        assert together(b, c) == {"10.0.0.2": 1, "10.0.0.3": 0}, "and again in the round after"
    finally:
        for handler in (a, b, c):
            if handler is not None:
                handler._stop_heartbeats()


def test_the_environment_variable_unshares_the_rendezvous_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    params = RendezvousParameters(backend="c10d", endpoint="localhost:0", run_id="r", min_nodes=1, max_nodes=2)
    hashed = dist.HashStore()
    handler = create_handler(hashed, C10dRendezvousBackend(hashed, "r"), params)
    monkeypatch.setenv(env.SHARE_STORE_ENV, "1")
    assert not handler.use_agent_store
    monkeypatch.setenv(env.SHARE_STORE_ENV, "0")
    # torch 2.4's dynamic rendezvous never shares its store: rank 0 hosts the workers' store whatever is set.
    assert handler.use_agent_store is not torch_compat.torch_older_than("2.5")


# ---- Contracts: what is overridden or patched in place


def _owner(contract: Contract) -> Any:
    module, _, cls = contract.owner.partition(":")
    found: Any = importlib.import_module(module)
    return getattr(found, cls) if cls else found


def _pybind_params(member: Any) -> list[str]:
    """Parameter names from a pybind11 docstring's first line, `name(self: T, arg0: str, ...) -> R`."""
    first = (member.__doc__ or "").splitlines()[0]
    inside = first[first.index("(") + 1 : first.rindex(")")]
    names, depth, current = [], 0, ""
    for char in inside + ",":
        if char == "," and depth == 0:
            names.append(current.split(":")[0].strip())
            current = ""
            continue
        depth += char in "[(<"
        depth -= char in "])>"
        current += char
    return [n for n in names if n]


def _params(member: Any) -> list[str]:
    try:
        return list(inspect.signature(member).parameters)
    except ValueError:
        return _pybind_params(member)


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: f"{c.owner.rpartition('.')[2]}.{c.name}")
def test_a_contract_still_holds(contract: Contract) -> None:
    owner = _owner(contract)
    if contract.params is None:
        if inspect.isclass(owner):
            assigned = inspect.unwrap(owner.__init__).__code__.co_names
            assert contract.name in assigned, f"{contract.owner}.__init__ no longer sets {contract.name}"
        else:
            assert hasattr(owner, contract.name)
    else:
        assert hasattr(owner, contract.name), f"{contract.owner} has no {contract.name}"
        params = _params(getattr(owner, contract.name))
        wanted = list(contract.params)
        if wanted[-1] == "...":
            wanted = wanted[:-1]
            params = params[: len(wanted)]
        assert params == wanted, f"{contract.owner}.{contract.name} now takes {params}"
    relying = importlib.import_module(contract.where)
    assert contract.name in inspect.getsource(relying), f"{contract.where} no longer uses {contract.name}: drop it"


def test_the_agent_still_starts_workers_through_the_patched_name() -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert "start_processes" in inspect.unwrap(LocalElasticAgent._start_workers).__code__.co_names


def test_the_group_s_own_private_names_shadow_nothing_of_torch_s() -> None:
    """runtime/group.ReformableGroup subclasses torch's ProcessGroup: its own `_x` attributes and methods must not
    replace one of torch's, except the overrides listed as contracts."""
    from stalwart.runtime.group import ReformableGroup

    tree = ast.parse(inspect.getsource(ReformableGroup))
    own = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    own |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    private = {n for n in own if n.startswith("_") and not n.startswith("__")}
    overrides = {c.name for c in CONTRACTS if c.where == "stalwart.runtime.group"}
    assert not {n for n in private - overrides if hasattr(dist.ProcessGroup, n)}


# ---- The house: nothing else reaches into torch's internals

WRAPPED = frozenset(
    {
        "_register_backend",
        "_set_default_backend",
        "_plugins",
        "_timeout",
        "_abort_process_group",
        "_remove_autograd_hooks",
        "_build_params_for_reducer",
        "_build_debug_param_to_name_mapping",
        "_ddp_init_helper",
        "_comm_hooks",
        "_has_rebuilt_buckets",
        "_static_graph_delay_allreduce_enqueued",
        "_register_comm_hook",
        "_version",
        "_buffers",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_step_pre_hooks",
        "_last_lr",
        "_wrapped_by_lr_sched",
        "_foreach_norm",
        "_last_call",
        "_settings",
        "_matches_machine_hostname",
        "_get_addr_and_port",
    }
)
"""The private torch names torch_compat wraps: no other module may name them."""


def _reaches_in(name: str, tree: ast.AST) -> list[str]:
    torch_names = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            for alias in node.names:
                full = f"{module}.{alias.name}" if module else alias.name
                if full.split(".")[0] == "torch":
                    torch_names.add(alias.asname or alias.name.split(".")[0])
                    if any(p.startswith("_") and not p.startswith("__") for p in full.split(".")):
                        found.append(f"imports {full}")
    contracts = {c.name: c.where for c in CONTRACTS if c.name.startswith("_")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attr, owner = node.attr, getattr(node.value, "id", "")
            if contracts.get(attr) == name:
                continue  # a contract of this module: overridden or patched here
            if owner in torch_names and re.match(r"_[a-z]", attr):
                found.append(f"{owner}.{attr}")
            elif attr in WRAPPED and owner not in ("self", "cls"):
                found.append(f".{attr}")
            elif (
                attr in contracts and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super"
            ):
                found.append(f"super().{attr} (a contract of {contracts[attr]})")
            if attr == "get_objects" and owner == "gc":
                found.append("gc.get_objects")
        elif isinstance(node, ast.Constant) and node.value in WRAPPED:
            found.append(repr(node.value))
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
            right = node.comparators[0]
            if isinstance(right, ast.Call) and getattr(right.func, "id", "") == "str":
                found.append(f"{node.left.value!r} in str(...): a message text")
    return found


def test_torchs_operator_libraries_are_not_taken_apart_at_exit_and_the_users_finalizers_still_run() -> None:
    """torch_compat_process.skip_operator_deregistration_at_exit finds torch's finalizer of each operator library
    (the one of a library made here among them) and leaves every other finalizer to run at exit."""
    lib = torch.library.Library("stalwart_exit_test", "FRAGMENT")
    theirs = [f for f in weakref.finalize._registry if (f.peek() or (None, None))[0] is lib]  # type: ignore[attr-defined]
    mine = weakref.finalize(lib, print, "the user's")
    assert len(theirs) == 1 and theirs[0].atexit, "torch registers one finalizer per library, run at exit"
    turned = torch_compat_process.skip_operator_deregistration_at_exit()
    assert turned >= 1 and not theirs[0].atexit, "torch's own: off"
    assert mine.atexit, "the user's: on"
    assert torch_compat_process.skip_operator_deregistration_at_exit() == 0, "once is enough"
    mine.detach()
    theirs[0]()  # as the library's end would: its operators go now, while this process lives


def test_no_module_but_torch_compat_reaches_into_torch_s_internals() -> None:
    strays = []
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        if name in COMPAT:
            continue
        strays += [f"{name}: {what}" for what in _reaches_in(name, ast.parse(path.read_text()))]
    assert not strays, "through runtime/torch_compat.py instead:\n" + "\n".join(strays)
