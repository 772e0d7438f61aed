"""A small deterministic job for the distributed tests.

An MLP with dropout under DDP, AdamW and an LR schedule, fed by a ResumableLoader over sample ids. It also tracks
`SeenSamples`, the ids this rank trained on: since that list is checkpointed with everything else, the final one
is the history that survived every failure, which is what the exactly-once tests inspect.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import stalwart
from stalwart.runtime.env import SNAPSHOT_DIR_ENV


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.x[i]


class SeenSamples:
    """The sample ids this rank trained on, in a buffer that doubles when full: its state keeps one shape for many
    steps, as a real job's does. (A list made into a new tensor every step had each step's snapshot lay the state
    out anew: most of this job's CPU, and so much of the suite's.)"""

    def __init__(self) -> None:
        self._buf = torch.zeros(1024, dtype=torch.int64)
        self._n = 0

    @property
    def ids(self) -> list[int]:
        return self._buf[: self._n].tolist()

    def add(self, ids: torch.Tensor) -> None:
        end = self._n + ids.numel()
        if end > self._buf.numel():
            grown = torch.zeros(max(end, 2 * self._buf.numel()), dtype=torch.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : end] = ids.reshape(-1)
        self._n = end

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"ids": self._buf, "n": torch.tensor(self._n, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._buf = state["ids"].clone()
        self._n = int(state["n"])


class OwnBatches:
    """The script's own sampler (--own-data): each rank draws its batch's sample ids from a generator of its own, as
    scripts that sample from a token file do. Tracked per rank, so a resume draws what the run would have drawn."""

    def __init__(self, num_samples: int, per_rank: int, rank: int) -> None:
        self.num_samples, self.per_rank = num_samples, per_rank
        self.gen = torch.Generator().manual_seed(1000 + rank)

    def draw(self) -> torch.Tensor:
        return torch.randint(self.num_samples, (self.per_rank,), generator=self.gen)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.gen.set_state(state["gen"])


class _Holder:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _every(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--log-every", type=int, default=1, help="JobConfig.log_every: step_done every N steps")
    p.add_argument("--num-samples", type=int, default=60)
    p.add_argument("--gbs", type=int, default=6)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--allow-resize", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="shard model and optimizer with FSDP2 instead of DDP")
    p.add_argument("--fsdp-together", action="store_true", help="with --fsdp: the linear layers in one fully_shard")
    p.add_argument("--snapshot-every", type=_every, default=1, help="memory-tier snapshots (0: durable only; auto)")
    p.add_argument("--snapshot-budget", type=float, default=0.03, help="with --snapshot-every auto")
    p.add_argument("--light-snapshot-budget", type=float, default=0.02, help="as JobConfig's")
    p.add_argument("--replicated-snapshot-every", type=_every, default=1, help=">1 or auto: light snapshots (L1)")
    p.add_argument("--peer-replicas", type=int, default=1, help="L3: copies of each snapshot on other nodes")
    p.add_argument("--per-rank-sched", action="store_true", help="the scheduler is per-rank state (not replicated)")
    p.add_argument("--rank1-draws-late", action="store_true", help="rank 1 alone draws after the optimizer step")
    p.add_argument("--allreduce-after-step", action="store_true", help="a logging all-reduce after optim.step()")
    p.add_argument(
        "--check-gathered-loss",
        action="store_true",
        help="every rank's loss gathered into a NaN-filled buffer after the step, raising unless all are finite",
    )
    p.add_argument("--compute-sleep", type=float, default=0.0, help="seconds of 'compute' before each forward")
    p.add_argument("--divergence-every", type=int, default=100, help="0: no replica divergence check")
    p.add_argument("--robust", default="", help="DDP comm hook: stalwart.robust_aggregation(METHOD)")
    p.add_argument("--byzantine-rank", type=int, default=-1, help="this rank sends corrupted gradients")
    p.add_argument("--no-update-at", type=int, default=-1, help="skip optim.step() at this step (a reference run)")
    p.add_argument("--skip-batch", type=int, default=-1, help="drop this step's batch in the loop (a reference run)")
    p.add_argument("--loss-spike", default="warn", help="JobConfig.loss_spike")
    p.add_argument("--straggler-policy", default="report", help="JobConfig.straggler_policy")
    p.add_argument("--busy-at", type=int, default=-1, help="at this step, a long stretch marked with job.busy()")
    p.add_argument("--busy-s", type=float, default=0.0)
    p.add_argument("--hold-at", type=int, default=-1, help="at the end of this step, wait (job.busy) for --hold-file")
    p.add_argument("--hold-file", default="", help="the test creates it once it has done what needs the job running")
    p.add_argument("--when-busy", default="wait", help="wait: every save happens (deterministic steps for tests)")
    p.add_argument("--ckpt-per-rank", action="store_true", help="a node-local checkpoint dir on each rank (wrong)")
    p.add_argument("--unsavable-on-rank", type=int, default=-1, help="track a numpy scalar on this rank (wrong)")
    p.add_argument(
        "--die-in-setup", type=int, action="append", default=[], help="rank 1 of this restart dies half-way in set-up"
    )
    p.add_argument(
        "--die-early-in-setup",
        type=int,
        action="append",
        default=[],
        help="rank 1 of this restart dies as its set-up starts (while the survivors still form their own group)",
    )
    p.add_argument("--cuda", action="store_true", help="model and batches on GPU 0, shared by every rank (GPU checks)")
    p.add_argument("--no-randomness", action="store_true", help="no dropout, no noise: steps draw no random numbers")
    p.add_argument("--grow-to", type=int, default=0, help="as stalwart.chaos.tiny_job's: ranks to wait to grow back to")
    p.add_argument("--grow-wait-after", type=int, default=10, help="steps at fewer ranks before that wait")
    p.add_argument("--setup-s", type=float, default=0.0, help="seconds of set-up before the loop (data, model)")
    p.add_argument(
        "--dump-dir",
        default="",
        help="rank 0 writes the full parameters and optimizer state here: "
        "resumed-<step>.pt after a resume, at-<step>.pt at --dump-at, end-<step>.pt at the end",
    )
    p.add_argument("--dump-at", type=int, default=-1, help="with --dump-dir: also dump before this step")
    p.add_argument(
        "--batch-log",
        default="",
        help="append each step's samples here (a directory): step, the step this run resumed from, ids",
    )
    p.add_argument("--setup-log", default="", help="append this process's pid here each time the set-up runs")
    p.add_argument("--own-data", action="store_true", help="each rank draws its own batches in the loop (no loader)")
    p.add_argument("--protocol", action="store_true", help="drive the job through job.loop()'s begin/end/failed")
    p.add_argument("--rank-from-env", action="store_true", help="read RANK in the set-up, as a sampler's rank is")
    p.add_argument("--die-at", default="", help="STEP:PHASE (forward, backward, before_optimizer): rank 1 of the "
                   "first round dies there, the user's code killing its own process")  # fmt: skip
    p.add_argument("--fork-holder", default="", choices=("", "group", "session"),
                   help="rank 1 of the first round forks a child that holds its connections open (sleeping) and "
                   "writes its pid to holder.pid: in the rank's process group, or in a session of its own")  # fmt: skip
    p.add_argument("--ranks-per-node", type=int, default=0, help="rank r's node memory is $STALWART_SNAPSHOT_DIR/"
                   "node<r // K>: several nodes' memory tiers on one machine (torchrun)")  # fmt: skip
    args = p.parse_args()
    if args.ranks_per_node and os.environ.get(SNAPSHOT_DIR_ENV):
        memory = Path(os.environ[SNAPSHOT_DIR_ENV]) / f"node{int(os.environ['RANK']) // args.ranks_per_node}"
        memory.mkdir(exist_ok=True)
        os.environ[SNAPSHOT_DIR_ENV] = str(memory)
    if args.ckpt_per_rank:
        args.ckpt = f"{args.ckpt}-rank{os.environ.get('RANK', '0')}"

    torch.use_deterministic_algorithms(True)
    job = stalwart.Job(
        args.ckpt,
        checkpoint_every=args.every,
        log_every=args.log_every,
        allow_world_size_change=args.allow_resize,
        # DDP keeps them equal on every rank (the scheduler too): each is written once. FSDP2's DTensors are
        # written by shard.
        replicated=() if args.fsdp else ("model", "optim") if args.per_rank_sched else ("model", "optim", "sched"),
        when_busy=args.when_busy,
        snapshot_every=args.snapshot_every,
        snapshot_budget=args.snapshot_budget,
        light_snapshot_budget=args.light_snapshot_budget,
        replicated_snapshot_every=args.replicated_snapshot_every,
        peer_replicas=args.peer_replicas,
        divergence_every=args.divergence_every or None,
        loss_spike=args.loss_spike,
        straggler_policy=args.straggler_policy,
    )
    if args.setup_log:
        with open(args.setup_log, "a") as f:
            f.write(f"{os.getpid()}\n")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if job.rank == 1 and restart in args.die_early_in_setup:
        _die()
    if job.rank == 1 and restart in args.die_in_setup:
        time.sleep(args.setup_s / 2)
        _die()
    time.sleep(args.setup_s)
    if args.rank_from_env:
        print(f"set-up as rank {int(os.environ['RANK'])}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.0 if args.no_randomness else 0.2),
        torch.nn.Linear(args.hidden, 1),
    )
    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(0)
        model.to(device)
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (job.world_size,))
        linear = [layer for layer in model if isinstance(layer, torch.nn.Linear)]
        if args.fsdp_together:  # as torchtitan wraps its last norm and output: fully_shard([a, b])
            fully_shard(linear, mesh=mesh)
        else:
            for layer in linear:
                fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = DistributedDataParallel(model) if job.world_size > 1 else model
        if args.robust:
            ddp.register_comm_hook(None, stalwart.robust_aggregation(args.robust))
        if job.rank == args.byzantine_rank:  # its gradients, before they are sent: large and pointing the wrong way
            for param in model.parameters():
                param.register_hook(lambda g: g * -50.0 + 3.0)
    if args.fork_holder and job.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        _fork_holder(args.fork_holder == "session")
    die_step, die_phase = _die_at(args.die_at, job)
    if die_phase == "forward":
        model.register_forward_pre_hook(lambda m, a: _die() if _at(job, die_step) else None)
    elif die_phase == "backward":  # while the gradients are computed: DDP's all-reduce of other buckets in flight
        model[0].weight.register_hook(lambda g: _die() if _at(job, die_step) else None)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.5)
    loader = stalwart.ResumableLoader(
        Samples(args.num_samples), global_batch_size=args.gbs, seed=3, num_workers=args.workers
    )
    seen = SeenSamples()
    if args.own_data:
        own = OwnBatches(args.num_samples, args.gbs // job.world_size, job.rank)
        job.track(model=model, optim=optim, sched=sched, sampler=own, seen=seen)
        data = Samples(args.num_samples)
    else:
        job.track(model=model, optim=optim, sched=sched, data=loader, seen=seen)
    if job.rank == args.unsavable_on_rank:
        import numpy as np

        job.track(best=_Holder({"best_loss": np.float64(0.5)}))

    loss0 = _full_loss(model, args) if not args.fsdp else None
    if args.dump_dir and job.resume():
        _dump(model, optim, job, Path(args.dump_dir) / f"resumed-{job.step}.pt")
    shrunk_at: int | None = None  # the step from which the job ran at fewer than --grow-to ranks

    def train_step(step: int, drawn: Any) -> None:
        nonlocal shrunk_at
        ids, x = _own(own, data) if args.own_data else drawn
        shrunk_at = None if job.world_size >= args.grow_to else step if shrunk_at is None else shrunk_at
        if shrunk_at is not None and step - shrunk_at == args.grow_wait_after:
            from stalwart.chaos.tiny_job import wait_to_grow

            wait_to_grow(job, 120.0)  # the grow happens at this step, however long the new node takes to start
        if args.dump_dir and step == args.dump_at:
            with job.busy():
                _dump(model, optim, job, Path(args.dump_dir) / f"at-{step}.pt")
        if step == args.skip_batch:
            return
        seen.add(ids)
        if args.batch_log:
            with open(Path(args.batch_log) / f"pid{os.getpid()}.jsonl", "a") as f:
                since = job.resumed_from if job.resumed_from is not None else -1
                f.write(
                    json.dumps({"step": step, "since": since, "ids": ids.tolist(), "mono": time.monotonic()}) + "\n"
                )
        if args.compute_sleep:
            time.sleep(args.compute_sleep)  # a stand-in for compute (a GPU's kernels) that no other rank slows
        noise = torch.rand(len(x), 1) * (0.0 if args.no_randomness else 1.0)  # draws: RNG restore matters
        x, noise = x.to(device), noise.to(device)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True) - noise).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        if die_phase == "before_optimizer" and step == die_step:
            _die()
        if step != args.no_update_at:
            optim.step()
        if args.rank1_draws_late and job.rank == 1:
            torch.rand(1)  # per-rank state changed after the optimizer step, on one rank only
        sched.step()
        if args.allreduce_after_step and job.world_size > 1:
            torch.distributed.all_reduce(loss.detach().clone())  # a logged mean loss: a collective after the update
        if args.check_gathered_loss and job.world_size > 1:  # a Trainer's check that its logged loss is finite
            losses = torch.full((job.world_size,), float("nan"))
            torch.distributed.all_gather_into_tensor(losses, loss.detach().reshape(1).to(losses.dtype))
            if not bool(torch.isfinite(losses).all()):  # after an absorbed failure: the buffer as it was
                raise RuntimeError(f"Loss is not finite: {losses.tolist()}")
        job.report(loss=loss.detach())
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step == args.busy_at:
            with job.busy():
                time.sleep(args.busy_s)
        if step == args.hold_at:
            _hold(job, Path(args.hold_file))

    data_of_job = None if args.own_data else loader
    if args.protocol:  # driven through the step protocol, as a framework's Trainer drives it (job/step_loop.py)
        with job.loop(data_of_job, max_steps=args.steps) as loop:
            while (begun := loop.begin()) is not None:
                if begun.redo:
                    print(f"train_tiny: rank {job.rank} redoes step {begun.number}", flush=True)
                try:
                    train_step(begun.number, begun.batch)
                except Exception as exc:
                    loop.failed(exc)
                    continue
                loop.end()
    else:
        for step, drawn in job.steps(data_of_job, max_steps=args.steps):
            train_step(step, drawn)

    if args.dump_dir:
        _dump(model, optim, job, Path(args.dump_dir) / f"end-{job.step}.pt")
    digest = hashlib.sha256()
    finite = True
    for name, t in model.state_dict().items():
        t = _gathered(t)  # a DTensor under FSDP2
        digest.update(name.encode() + t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        finite = finite and bool(torch.isfinite(t).all())
    env = {k: os.environ.get(k) for k in _ENV}
    params = torch.cat([_gathered(p).detach().reshape(-1) for p in model.parameters()])  # collective under FSDP2
    full_loss = _full_loss(model, args) if not args.fsdp else None
    result = {"sha256": digest.hexdigest(), "seen": seen.ids, "step": job.step, "env": env, "finite": finite,
              "params": params.tolist(), "loss": full_loss,
              "loss0": loss0}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{job.rank}.json").write_text(json.dumps(result))


def _hold(job: stalwart.Job, path: Path, timeout_s: float = 240.0) -> None:
    """Wait at a step's end until the test created `path` (it does once what needs the job still running is done: a
    warm spare parked, a rank killed), so that no test races the job's end; already there: no wait."""
    deadline = time.monotonic() + timeout_s
    with job.busy():
        while not path.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"train_tiny: {path} did not appear in {timeout_s:.0f} s")
            time.sleep(0.05)


def _own(own: OwnBatches, data: Samples) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's batch, drawn in the loop body (--own-data)."""
    ids = own.draw()
    return ids, data.x[ids]


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: an FSDP2 DTensor gathered with `full_tensor` (a functional collective, on stalwart's re-formable
    group under stalwart run)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def _dump(model: torch.nn.Module, optim: torch.optim.Optimizer, job: stalwart.Job, path: Path) -> None:
    """The full parameters and optimizer state (DTensors gathered: a collective, so every rank calls it); rank 0
    writes them."""

    def full(t: torch.Tensor) -> torch.Tensor:
        return _gathered(t)

    names = [name for name, _ in model.named_parameters()]
    state = {f"param/{name}": full(t) for name, t in model.state_dict().items()}
    for name, param in zip(names, model.parameters(), strict=True):
        for key, value in optim.state.get(param, {}).items():
            state[f"optim/{name}/{key}"] = full(value)
    if job.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)


def _die_at(spec: str, job: stalwart.Job) -> tuple[int, str]:
    """(step, phase) at which this rank is to die; (-1, "") on any other rank or round."""
    if not spec or job.rank != 1 or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return -1, ""
    step, phase = spec.split(":")
    return int(step), phase


def _at(job: stalwart.Job, step: int) -> bool:
    return job.step == step


def _fork_holder(own_session: bool) -> None:
    """A child that inherits this rank's sockets (its process group's connections) and sleeps: after the rank's
    death they stay open, as a DataLoader worker's do until its watchdog notices, or as a peer cut off by the
    network would leave them. In a session of its own, the agent's end of the rank's process group misses it."""
    pid = os.fork()
    if pid == 0:
        if own_session:
            os.setsid()
        time.sleep(600)
        os._exit(0)
    Path("holder.pid").write_text(str(pid))


def _die() -> None:
    os.kill(os.getpid(), 9)


def _full_loss(model: torch.nn.Module, args: argparse.Namespace) -> float:
    """The model's loss over the whole dataset (noise at its mean), the same on every rank."""
    was = model.training
    model.eval()
    with torch.no_grad():
        data = Samples(args.num_samples).x.to(next(model.parameters()).device)
        loss = float((model(data) - data.sum(dim=1, keepdim=True) - 0.5).pow(2).mean())
    model.train(was)
    return loss


_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS", "ROLE_RANK",
)  # fmt: skip

if __name__ == "__main__":
    main()
