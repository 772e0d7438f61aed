"""Numeric guards (L0 of the recovery ladder): an update computed from non-finite gradients is never applied.

Why: one batch of NaN inputs at step 60 of a 2-rank DDP job left every parameter NaN, and the job ran on to its
end and exited 0 (tried as a new user would, 2026-11-23). From that step on every step's compute was wasted,
and every checkpoint after it held a dead model.

How: a pre-hook on every tracked optimizer takes the total norm of the tracked optimizers' gradients (one fused
norm per device and dtype, then one read on the host per step: the same synchronisation torch's GradScaler makes).
By default it reads a sample of each gradient (its first 4,096 elements) and scales it up: a NaN or Inf from the
data, the loss or anywhere in the forward or backward pass reaches every gradient upstream of it, and the sample
sees it, at a small fraction of a full read (a full read cost more than the detectors' 1% budget on the bench
job, docs/benchmarks.md; `sample=None` makes it exact). What a sample can miss is a lone non-finite element that
propagates nowhere; the parameter it then corrupts makes the next forward pass non-finite, the guard skips that
step, and the job, finding a non-finite parameter, rolls back to before the update that put it there
(recovery/rollback.py).

If the norm is not finite, every one of those gradients is set to None before the optimizer runs. torch's
optimizers skip parameters without a gradient, so neither the parameters nor the optimizer's state (moments,
step counts) change: the step is as if its batch had never been seen. The loader has moved past the batch, so
the skip is also deterministic: a run resumed from before it meets the same batch and skips it the same way.
A norm that is finite but more than `spike_factor` times the mean of recent ones is a gradient-norm spike:
reported (policy "warn", the default) or skipped like a non-finite one ("skip").

Agreement: under DDP the gradients seen at the optimizer step are the all-reduced ones, equal on every rank, so
every rank decides alike without a collective. Sharded gradients (DTensor: FSDP2, tensor parallel) differ per
rank: their local shards' norms are combined with one small all-reduce per step, so that no rank updates its
shard while another skips.

A run that keeps producing non-finite gradients has diverged, and skipping cannot save it: after `max_skips`
skipped steps in a row the job stops with NumericError, which `stalwart run` does not retry.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stalwart.checkpoint.format import sharded
from stalwart.checkpoint.format.serialize import frozen
from stalwart.detect.host_reads import HostReads
from stalwart.errors import NumericError
from stalwart.runtime.torch_compat import foreach_norm
from stalwart.telemetry.events import EventLog

NONFINITE_POLICIES = ("skip", "off")
SPIKE_POLICIES = ("warn", "skip", "rollback", "off")
"""A gradient-norm spike is seen before its update is applied: "skip" drops the update; "rollback" is the same,
since nothing was applied that going back could undo."""
LOSS_SPIKE_POLICIES = ("warn", "skip", "rollback", "off")
"""A loss spike is seen after its update is applied: the only way to skip its batch is to go back to a state from
before it and drop it, so "skip" and "rollback" are the same."""
SPIKE_WINDOW = 100
"""Finite gradient norms the spike detector averages over."""
SPIKE_WARMUP = 20
"""Finite norms seen before spikes are judged: the first steps' norms fall fast and say nothing."""


@dataclass(frozen=True, slots=True)
class GuardConfig:
    nonfinite: str = "skip"
    spike: str = "warn"
    spike_factor: float = 10.0
    max_skips: int = 5
    sample: int | None = 4096
    """Elements read per gradient tensor: the first this many, contiguous (all of a smaller one).
    None reads every element: exact, at the cost of one read of all gradients per step (over the 1% the detectors
    may take on the bench job, docs/benchmarks.md)."""


class NumericGuard:
    """Checks the gradients at the first optimizer step of each step and skips the update when they are bad."""

    def __init__(
        self,
        optimizers: list[torch.optim.Optimizer],
        events: EventLog,
        config: GuardConfig,
        *,
        quiet: bool = False,
        reads: HostReads | None = None,
    ) -> None:
        """`quiet`: another rank (rank 0) sees the same gradients and reports a divergence for both. `reads`: the
        job's reads to the host; what waits there (a reported loss) rides along with the guard's read."""
        self._optimizers = optimizers
        self._reads = reads or HostReads()
        self._quiet = quiet
        self._events = events
        self.config = config
        self._handles = [opt.register_step_pre_hook(self._before_optimizer_step) for opt in optimizers]
        self._step = -1  # the completed steps of the step under way; -1: not inside a step
        self._decided = -1  # the step whose gradients were checked
        self._skip = False  # whether that step's update is skipped
        self._norms: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.skipped: list[int] = []
        """Steps (completed steps before them) whose update was skipped, in this process."""
        self.nonfinite_at: int | None = None
        """The step whose update was last skipped for non-finite gradients (the job then checks the parameters)."""
        self._in_a_row = 0
        self.seconds = 0.0
        """Time spent judging, on the training thread (the detectors' cost, `Job.detector_seconds`)."""

    def arm(self, step: int) -> None:
        """The step after `step` completed steps is starting."""
        self._step = step

    def disarm(self) -> None:
        self._step = -1

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._step < 0:
            return  # outside job.steps(): not ours to judge
        if self._decided != self._step:
            started = time.perf_counter()
            self._decided = self._step
            try:
                self._skip = self._judge(self._step)
            finally:
                self.seconds += time.perf_counter() - started
        if self._skip:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _judge(self, step: int) -> bool:
        norm = self._norm()
        if not math.isfinite(norm):
            if self.config.nonfinite == "off":
                return False
            self._events.emit("nonfinite_gradients", step=step, grad_norm=str(norm), action="skipped")
            self.nonfinite_at = step
            return self._skipped(step, f"non-finite gradients (norm {norm})")
        spike = self._spike(norm)
        self._norms.append(norm)
        if spike is not None:
            drops = self.config.spike in ("skip", "rollback")
            action = "skipped" if drops else "warned"
            self._events.emit("grad_norm_spike", step=step, grad_norm=norm, mean=spike, action=action)
            if drops:
                self._norms.pop()  # a skipped spike does not raise the bar for the next one
                return self._skipped(step, f"a gradient-norm spike ({norm:.3g}, {norm / spike:.0f}x the mean)")
        self._in_a_row = 0
        return False

    def _spike(self, norm: float) -> float | None:
        """The recent mean norm if `norm` is a spike over it, else None."""
        if self.config.spike == "off" or len(self._norms) < SPIKE_WARMUP:
            return None
        mean = sum(self._norms) / len(self._norms)
        return mean if mean > 0 and norm > self.config.spike_factor * mean else None

    def _skipped(self, step: int, why: str) -> bool:
        self.skipped.append(step)
        self._in_a_row += 1
        if self._in_a_row >= self.config.max_skips:
            first = step - self._in_a_row + 1
            raise NumericError(
                f"training diverged: the updates of {self._in_a_row} steps in a row ({first}-{step}) were "
                f"skipped, the last for {why}; none was applied, so the parameters (those of step {first}) and "
                "the checkpoints are intact. A restart would meet the same batches: fix the data or lower the "
                "learning rate, then resume",
                quiet=self._quiet,
            )
        return True

    def rolled_back(self) -> None:
        """The job went back to an earlier state: the skips in a row before it say nothing about what follows."""
        self._in_a_row = 0
        self._decided = -1
        self.nonfinite_at = None

    def _norm(self) -> float:
        """The total 2-norm of every tracked optimizer's gradients (inf or nan if any element is)."""
        plain, shards = _gradients(self._optimizers)
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in plain:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        groups = [_norms(group, self.config.sample) for group in by_kind.values()]
        tensors = [norms for norms, _ in groups]
        if shards:
            local = [g.to_local() for g in shards]  # type: ignore[attr-defined]  # DTensor
            mine = torch.stack([t.float().square().sum() for t in local]).sum()
            # Every rank's shards: one all-reduce on the gradients' own group (a shard replicated over some
            # mesh dimension is counted once per replica: a scaled norm, equally finite, and spikes are relative).
            dist.all_reduce(mine)
            tensors.append(mine.reshape(1))
        values = self._reads.read(tensors)  # the step's one read to the host (a device sync on a GPU)
        squares, at = [], 0
        for _, scales in groups:
            group = values[at : at + len(scales)]
            squares.append(sum(v * v * scale for v, scale in zip(group, scales, strict=True)))
            at += len(scales)
        if shards:
            squares.append(values[at])  # already a sum of squares
        return math.sqrt(sum(squares))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _sampled(grads: list[torch.Tensor], sample: int | None) -> tuple[list[torch.Tensor], list[float]]:
    """Each gradient, or (when it has more than `sample` elements and is contiguous) its first `sample` elements,
    with the factor that scales the sample's sum of squares to an estimate of the whole's.

    One contiguous block rather than every k-th element: after the backward pass the gradients are out of the
    caches, and a strided sample pays a cache miss per element (five times a contiguous block's cost on the bench
    job, docs/benchmarks.md). Which elements does not matter for what the guard is for: a NaN or
    Inf that reaches the loss reaches every gradient element upstream of it. The norm of a fixed block is a
    biased estimate of the whole's, but a consistent one, and spikes are judged against its own history."""
    views, scales = [], []
    for g in grads:
        n = g.numel()
        if sample is None or n <= sample or not g.is_contiguous():
            views.append(g)
            scales.append(1.0)
            continue
        views.append(g.as_strided((sample,), (1,)))  # one operation; the tensor's own storage offset is kept
        scales.append(n / sample)
    return views, scales


def _norms(grads: list[torch.Tensor], sample: int | None = None) -> tuple[torch.Tensor, list[float]]:
    """The norm of a sample of each gradient (see GuardConfig.sample), one fused norm per tensor, stacked (not
    read: the caller reads every group's at once), with the factors that scale each square to the whole's.
    Half-precision norms are taken in float32: a float16 norm overflows past 65504. Few tensor operations on
    purpose: each costs tens of microseconds of dispatch on a slow CPU, whatever the tensor's size."""
    grads, scales = _sampled(grads, sample)
    wide = None if grads[0].dtype in (torch.float32, torch.float64) else torch.float32
    return torch.stack(list(foreach_norm(grads, wide))), scales


def _gradients(optimizers: Iterable[torch.optim.Optimizer]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(plain gradients, sharded ones) of every parameter of `optimizers`, each tensor once."""
    seen: set[int] = set()
    plain: list[torch.Tensor] = []
    shards: list[torch.Tensor] = []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or id(g) in seen:
                    continue
                seen.add(id(g))
                (shards if sharded.is_dtensor(g) else plain).append(g)
    return plain, shards


LOSS_WINDOW = 100
"""Reported losses the loss-spike check takes the median of."""
LOSS_WARMUP = 20
"""Losses seen before spikes are judged: the first steps' losses fall fast and say nothing."""
LOSS_MAD_K = 20.0
"""A spike must also stand this many median absolute deviations above the median: a per-batch loss is noisy and
heavy-tailed (on the chaos suite's job, batches of 4 per rank, 5x the median came every hundred steps or so; a
chi-square loss of 4 degrees reached 14 MADs in 3,000 steps), while the losses that matter (a bad batch, a
blow-up) stand hundreds or millions of MADs out."""


class LossWatch:
    """Loss spikes: a reported loss over `factor` times the median of the last LOSS_WINDOW, and over LOSS_MAD_K
    median absolute deviations above it, is a `loss_spike` event.
    The update computed from that loss is already applied when the job sees it: the policy (JobConfig.loss_spike)
    warns, or rolls back to a state from before it and skips the batch (recovery/rollback.py). A non-finite loss
    is the numeric guard's. A spike does not join the window, so it does not raise the bar for the next one.

    The loss comes from `job.report(loss=...)`. With the job's `reads` (detect/host_reads.py), a loss tensor is
    not read at the step's end (a device sync on a GPU) but with the next step's read of the gradients' norm,
    and judged then: a warning one step late costs nothing. A rollback must be decided at the step's end, so
    the job asks for that read `now` under the rollback policy."""

    def __init__(self, events: EventLog, factor: float, reads: HostReads | None = None) -> None:
        self._events = events
        self.factor = factor
        self._reads = reads
        self._losses: deque[float] = deque(maxlen=LOSS_WINDOW)
        self.spikes: list[int] = []
        self._window: torch.Tensor | None = None  # state() until the window changes
        self._waiting: list[tuple[int, torch.Tensor, str]] = []  # (step, loss, action) read with the next read

    def observe(self, step: int, loss: Any, *, action: str = "warned", now: bool = False) -> bool:
        """Whether `loss` (after `step` completed steps) is a spike; if so, an event with `action`. A tensor waits
        for the job's next read (False now, judged then) unless `now` or there are no job reads."""
        if isinstance(loss, torch.Tensor):
            if self._reads is None:
                return self._judge(step, float(loss.detach().float().item()), action)
            value = loss.detach().float().reshape(1)  # float32, as `.float().item()` read it before
            if not now:
                entry = (step, value, action)
                self._waiting.append(entry)
                self._reads.later([value], lambda got: self._settle(entry, got[0]))
                return False
            return self._judge(step, self._reads.read([value])[0], action)
        return self._judge(step, float(loss), action)

    def _settle(self, entry: tuple[int, torch.Tensor, str], value: float) -> None:
        """A waiting loss, read: judged now, unless a load replaced the history it belonged to."""
        if any(e is entry for e in self._waiting):
            self._waiting = [e for e in self._waiting if e is not entry]
            self._judge(entry[0], value, entry[2])

    def _judge(self, step: int, value: float, action: str) -> bool:
        if not math.isfinite(value):
            return False
        if len(self._losses) >= LOSS_WARMUP:
            ordered = sorted(self._losses)
            median = ordered[len(ordered) // 2]
            deviations = sorted(abs(v - median) for v in ordered)
            mad = deviations[len(deviations) // 2]
            if median > 0 and value > self.factor * median and value - median > LOSS_MAD_K * mad:
                self.spikes.append(step)
                self._events.emit("loss_spike", step=step, loss=value, median=median, factor=self.factor, action=action)
                return True
        self._losses.append(value)
        self._window = None
        return False

    def state(self) -> dict[str, Any]:
        """The window, for checkpoints and snapshots: a restarted rank must judge the next losses against the same
        history as a run without the failure, or it decides differently and the runs part. A fixed shape (NaN
        past the losses seen), so the state's layout stays the same from step to step. The same tensor until a
        loss joins the window (light snapshots read it twice a step); never written in place once returned.
        With it, the newest loss still waiting to be read (as a tensor: taking the state reads nothing), which
        a restored rank judges with its first read."""
        if self._window is None:
            window = np.full(LOSS_WINDOW, math.nan)  # numpy: a few us where torch's full and tensor took tens
            window[: len(self._losses)] = self._losses
            self._window = frozen(torch.from_numpy(window))
        state: dict[str, Any] = {"loss_window": self._window}
        if self._waiting:
            step, loss, action = self._waiting[-1]
            state["loss_waiting"] = {"step": step, "loss": loss, "action": action}
        return state

    def load(self, state: dict[str, Any]) -> None:
        """The state of `state()` (a checkpoint of an older stalwart holds the window alone)."""
        window = state.get("loss_window")
        if not isinstance(window, torch.Tensor):
            return
        self._losses.clear()
        self._losses.extend(float(v) for v in window.tolist() if math.isfinite(v))
        self._window = None
        self._waiting = []
        waiting = state.get("loss_waiting")
        if isinstance(waiting, dict) and isinstance(waiting.get("loss"), torch.Tensor):
            self.observe(int(waiting["step"]), waiting["loss"], action=str(waiting["action"]))
