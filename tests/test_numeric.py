"""The numeric guard (detect/numeric.py): a non-finite gradient never reaches the parameters or the optimizer."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import child_env, tiny_args
from stalwart.detect.numeric import SPIKE_WARMUP, GuardConfig, NumericGuard
from stalwart.errors import EXIT_USER_ERROR, NumericError, is_user_error
from stalwart.telemetry.events import EventLog, read_events


def _setup(tmp_path: Path, **config: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, NumericGuard, Path]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    log = tmp_path / "events.jsonl"
    return model, optim, NumericGuard([optim], EventLog(log), GuardConfig(**config)), log


def _batch(step: int, nan_at: set[int] = frozenset()) -> torch.Tensor:  # type: ignore[assignment]
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
    return torch.full_like(x, float("nan")) if step in nan_at else x


def _train(
    model: Any, optim: Any, guard: NumericGuard | None, steps: int, nan_at: set[int], no_update: set[int]
) -> None:
    for step in range(steps):
        if guard is not None:
            guard.arm(step)
        x = _batch(step, nan_at)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        if step not in no_update:
            optim.step()
        if guard is not None:
            guard.disarm()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_nan_batch_is_skipped_as_if_it_was_never_seen(tmp_path: Path) -> None:
    model, optim, guard, log = _setup(tmp_path)
    _train(model, optim, guard, 12, nan_at={5}, no_update=set())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # A run that did not update at step 5 at all: bitwise the same parameters and optimizer state.
    ref_model, ref_optim, _, _ = _setup(tmp_path / "ref")
    _train(ref_model, ref_optim, None, 12, nan_at=set(), no_update={5})
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    for s, r in zip(optim.state.values(), ref_optim.state.values(), strict=True):
        assert all(torch.equal(s[k], r[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    events = [e for e in read_events(log) if e["event"] == "nonfinite_gradients"]
    assert [(e["step"], e["grad_norm"], e["action"]) for e in events] == [(5, "nan", "skipped")]
    assert guard.skipped == [5]


def test_without_the_guard_the_nan_reaches_the_parameters(tmp_path: Path) -> None:
    """What the guard prevents, so the test above cannot pass by accident."""
    model, optim, guard, _ = _setup(tmp_path, nonfinite="off", spike="off")
    _train(model, optim, guard, 8, nan_at={5}, no_update=set())
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_an_infinite_gradient_is_skipped_too(tmp_path: Path) -> None:
    model, optim, guard, log = _setup(tmp_path)
    before = _params(model)
    guard.arm(0)
    model(torch.ones(2, 4)).sum().backward()
    next(model.parameters()).grad[0, 0] = float("inf")  # type: ignore[index]
    optim.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not optim.state, "the optimizer's state was not even created"
    assert [e["grad_norm"] for e in read_events(log) if e["event"] == "nonfinite_gradients"] == ["inf"]


def test_outside_job_steps_nothing_is_judged(tmp_path: Path) -> None:
    model, optim, _guard, _ = _setup(tmp_path)
    model(torch.full((2, 4), float("nan"))).sum().backward()
    optim.step()  # not armed: an evaluation's or a user's own step outside the loop is theirs
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_too_many_skips_in_a_row_stop_the_job_with_an_error_a_restart_cannot_fix(tmp_path: Path) -> None:
    model, optim, guard, _ = _setup(tmp_path, max_skips=3)
    with pytest.raises(NumericError, match=r"3 steps in a row \(4-6\)") as info:
        _train(model, optim, guard, 10, nan_at={2, 4, 5, 6, 7}, no_update=set())
    assert is_user_error(info.value), "stalwart run must not spend its restarts on it"
    assert guard.skipped == [2, 4, 5, 6]


def _spike_run(tmp_path: Path, policy: str) -> tuple[torch.nn.Module, list[dict[str, Any]], list[torch.Tensor]]:
    model, optim, guard, log = _setup(tmp_path, spike=policy)
    steps = SPIKE_WARMUP + 5
    for step in range(steps):
        guard.arm(step)
        x = _batch(step) * (1000.0 if step == steps - 1 else 1.0)
        optim.zero_grad()
        (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()
        before = _params(model)
        optim.step()
        guard.disarm()
    return model, [e for e in read_events(log) if e["event"] == "grad_norm_spike"], before


@pytest.mark.parametrize("policy", ["warn", "skip", "rollback"])
def test_a_gradient_norm_spike_is_reported_and_skipped_if_asked(tmp_path: Path, policy: str) -> None:
    model, spikes, before = _spike_run(tmp_path, policy)
    assert [(e["step"], e["action"]) for e in spikes] == [
        (SPIKE_WARMUP + 4, "warned" if policy == "warn" else "skipped")
    ]
    assert spikes[0]["grad_norm"] > 10 * spikes[0]["mean"]
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert unchanged == (policy != "warn"), "skip and rollback drop the update before it is applied"


def test_half_precision_gradients_are_normed_in_float32(tmp_path: Path) -> None:
    """A float16 norm overflows past 65504: large but finite gradients must not read as infinite."""
    model = torch.nn.Linear(64, 64).half()
    optim = torch.optim.SGD(model.parameters(), lr=1e-4)
    log = tmp_path / "events.jsonl"
    guard = NumericGuard([optim], EventLog(log), GuardConfig())
    guard.arm(0)
    for p in model.parameters():
        p.grad = torch.full_like(p, 2000.0)  # the weight's norm is 128,000
    before = _params(model)
    optim.step()
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), "updated"
    assert not [e for e in read_events(log) if e["event"] == "nonfinite_gradients"]


def test_the_guard_leaves_a_deep_copied_optimizer_alone(tmp_path: Path) -> None:
    """Hooks are removed on close: a closed guard judges nothing."""
    model, optim, guard, _ = _setup(tmp_path)
    guard.close()
    guard.arm(0)
    model(torch.full((2, 4), float("nan"))).sum().backward()
    copy.deepcopy(optim).step()
    optim.step()
    assert not all(torch.isfinite(p).all() for p in model.parameters())


# -- under stalwart run: a 2-rank DDP job ------------------------------------------------------------------------


def test_a_nan_batch_on_one_rank_is_skipped_on_every_rank_and_the_run_ends_as_if_it_was_never_seen(
    launch: Any,
) -> None:
    args = ("--steps", "24")
    job = launch(tiny_args(*args), env=child_env(STALWART_FAULTS="nan@rank=1,step=12"))
    reference = launch(tiny_args(*args, "--no-update-at", "12"), name="reference")
    assert job.wait(180) == 0, job.output()
    assert reference.wait(180) == 0, reference.output()
    assert [(e["rank"], e["step"]) for e in job.events("fault_injected")] == [(1, 12)]
    skipped = job.events("nonfinite_gradients")
    assert sorted((e["rank"], e["step"], e["action"]) for e in skipped) == [(0, 12, "skipped"), (1, 12, "skipped")]
    results, expected = job.results(), reference.results()
    for rank in (0, 1):
        assert results[rank]["finite"], "no parameter became non-finite"
        assert results[rank]["sha256"] == expected[rank]["sha256"], "the same as a run that skipped that update"


def test_a_run_that_keeps_producing_nan_stops_with_one_line_and_is_not_restarted(launch: Any) -> None:
    faults = ";".join(f"nan@rank=0,step={s}" for s in range(10, 15))  # JobConfig.max_skipped_steps: 5
    job = launch(tiny_args("--steps", "24"), env=child_env(STALWART_FAULTS=faults))
    assert job.wait(180) == EXIT_USER_ERROR, job.output()
    lines = [line for line in job.output().splitlines() if "training diverged" in line]
    assert len(lines) == 1, "rank 0 says it for both: they met the same gradients"
    assert "the updates of 5 steps in a row (10-14) were skipped" in lines[0]
    assert "Traceback" not in job.output()
    assert {e["restart"] for e in job.events("worker_spawned")} == {0}, "not retried"


def test_a_sample_of_each_large_gradient_sees_a_nan_batch_but_not_a_lone_nan(tmp_path: Path) -> None:
    """The default reads the first 4,096 elements of each gradient: a NaN from the data reaches them all; a single
    NaN planted where the sample does not look is seen only by the exact check (sample=None)."""
    for sample, lone_seen in ((4096, False), (None, True)):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)  # a 65,536-element weight: sampled
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        log = tmp_path / f"events-{sample}.jsonl"
        guard = NumericGuard([optim], EventLog(log), GuardConfig(sample=sample))
        guard.arm(0)
        model(torch.full((2, 256), float("nan"))).sum().backward()
        optim.step()
        assert all(torch.isfinite(p).all() for p in model.parameters()), "a NaN batch is always seen"
        guard.arm(1)
        optim.zero_grad()
        model(torch.ones(2, 256)).sum().backward()
        model.weight.grad.view(-1)[-7] = float("nan")  # type: ignore[union-attr]  # past the sampled first 4,096
        optim.step()
        assert torch.isfinite(model.weight).all() == lone_seen
        assert [e["step"] for e in read_events(log) if e["event"] == "nonfinite_gradients"] == (
            [0, 1] if lone_seen else [0]
        )


def test_a_loss_over_five_times_the_recent_median_is_a_spike(tmp_path: Path) -> None:
    from stalwart.detect.numeric import LOSS_WARMUP, LossWatch

    log = tmp_path / "events.jsonl"
    watch = LossWatch(EventLog(log), factor=5.0)
    for step in range(LOSS_WARMUP + 30):
        loss = 2.0 - step * 0.01
        if step == 10:
            loss = 50.0  # in the warm-up: not judged
        if step == LOSS_WARMUP + 20:
            loss = 30.0
        watch.observe(step, torch.tensor(loss))
    watch.observe(999, float("nan"))  # the numeric guard's, not a spike
    assert watch.spikes == [LOSS_WARMUP + 20]
    (event,) = [e for e in read_events(log) if e["event"] == "loss_spike"]
    assert event["loss"] == 30.0 and event["median"] < 2.0


def test_a_job_in_one_process_reports_a_loss_spike_and_skips_a_nan_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The detectors wired into Job.steps(), without a launcher: a reported loss spike is an event, a NaN batch
    is skipped."""
    import stalwart

    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("STALWART_EVENT_LOG", str(log))
    job = stalwart.Job(tmp_path / "ck", checkpoint_every=100)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    job.track(model=model, optim=optim)
    for step, _ in job.steps(max_steps=40):
        x = torch.full((8, 4), float("nan")) if step == 33 else torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        job.report(loss=loss.detach() * (100.0 if step == 30 else 1.0))
    job.close()
    assert job.skipped_steps == [33] and all(torch.isfinite(p).all() for p in model.parameters())
    events = list(read_events(log))
    assert [e["step"] for e in events if e["event"] == "loss_spike"] == [31]  # after the step: 31 completed
    assert [e["step"] for e in events if e["event"] == "nonfinite_gradients"] == [33]


def test_a_noisy_per_batch_loss_raises_no_spike(tmp_path: Path) -> None:
    """Small batches give a heavy-tailed loss (here a chi-square of 4 degrees, scaled): 5x the median comes now and
    then, but no outlier of the median-absolute-deviation test; a 100x batch still does."""
    from stalwart.detect.numeric import LossWatch

    g = torch.Generator().manual_seed(0)
    watch = LossWatch(EventLog(tmp_path / "events.jsonl"), factor=5.0)
    losses = torch.randn(3000, 4, generator=g).pow(2).mean(dim=1) * 0.5
    assert (losses > 5 * losses.median()).sum() > 0, "the plain 5x rule would fire"
    for step, loss in enumerate(losses.tolist()):
        watch.observe(step, loss)
    assert watch.spikes == []
    watch.observe(3000, 100 * float(losses.median()))
    assert watch.spikes == [3000]


def test_the_loss_spike_window_travels_with_the_checkpoint(tmp_path: Path) -> None:
    """A resumed (or restarted) rank judges the next losses against the history a run without the stop had, not
    an empty window: otherwise a spike right after a restart goes unseen and the runs part."""
    import stalwart

    def run(steps: int) -> Any:
        job = stalwart.Job(tmp_path / "ckpt", checkpoint_every=1000)
        model = torch.nn.Linear(2, 1)
        job.track(model=model)
        for step, _ in job.steps(max_steps=steps):
            job.report(loss=1.0 + (step % 7) / 10)
        job.close()
        return job

    first = run(30)
    assert first.parts.detectors.loss_watch is not None and len(first.parts.detectors.loss_watch._losses) == 30
    resumed = stalwart.Job(tmp_path / "ckpt", checkpoint_every=1000)
    resumed.track(model=torch.nn.Linear(2, 1))
    resumed.resume()
    assert resumed.parts.detectors.loss_watch is not None
    assert list(resumed.parts.detectors.loss_watch._losses) == list(first.parts.detectors.loss_watch._losses)
    resumed.close()


@pytest.mark.parametrize("checks", ["defaults", "all_off"])
def test_the_job_reads_a_value_to_the_host_at_most_once_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checks: str
) -> None:
    """On a GPU each read of a tensor's value (`.item()`, `.tolist()`, `float()`) waits for the device. With the
    defaults the job makes one a step, the guard's gradient norm, and the reported loss rides along with it;
    with the guard's and the loss-spike checks off, it makes none. Counted at torch's own methods, so a read
    made anywhere (not only through detect/host_reads.py) counts."""
    import stalwart

    options: dict[str, Any] = {} if checks == "defaults" else {
        "nonfinite_grads": "off", "grad_spike": "off", "loss_spike": "off",
    }  # fmt: skip
    job = stalwart.Job(tmp_path / "ck", checkpoint_every=10_000, log_every=10_000, **options)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)  # SGD: torch's own step reads nothing
    job.track(model=model, optim=optim)
    reads = [0]

    def counted(name: str) -> Any:
        real = getattr(torch.Tensor, name)

        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads[0] += 1
            return real(self, *args, **kwargs)

        return call

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    at_start = []
    for _, _ in job.steps(max_steps=30):
        at_start.append(reads[0])
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        job.report(loss=loss)
    monkeypatch.undo()
    job.close()
    per_step = {b - a for a, b in itertools.pairwise(at_start[2:])}  # after the first, logged, step
    assert per_step == ({1} if checks == "defaults" else {0}), per_step
    if checks == "defaults":
        assert len(job.parts.detectors.loss_watch._losses) == 30, "every reported loss was judged"  # type: ignore[union-attr]
