"""The step protocol (job/step_loop.py): a Job driven by begin()/end()/failed() from a loop it does not own, as a
framework's Trainer drives it, keeps every guarantee of `job.steps()`: the same resume, checkpoints and steps in
one process, and after a peer's death the survivor stays in its loop, is told to redo the failed step, and the
run ends bitwise identical to a fault-free one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import stalwart
from conftest import child_env, fault_free_results, tiny_args
from stalwart.errors import ConfigError
from stalwart.job.step_loop import Step

STEPS = 24
ARGS = ("--steps", str(STEPS), "--step-sleep", "0.03", "--replicated-snapshot-every", "20")


def _train_through_the_protocol(ckpt: Path, max_steps: int, failing: set[int] = frozenset()) -> list[Step]:  # type: ignore[assignment]
    """A tiny model trained in one process through the protocol; a step in `failing` raises in its body the first
    time. Returns the steps begun."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    job = stalwart.Job(ckpt, checkpoint_every=5)
    job.track(model=model, optim=optim)
    begun = []
    with job.loop(None, max_steps=max_steps) as loop:
        while (step := loop.begin()) is not None:
            begun.append(step)
            try:
                if step.number in failing:
                    failing = failing - {step.number}
                    raise RuntimeError("the user's own error")
                loss = model(torch.ones(2, 4)).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
            except Exception as exc:
                loop.failed(exc)
                continue
            loop.end()
    job.close()
    return begun


def test_the_protocol_runs_and_resumes_as_steps_does(tmp_path: Path) -> None:
    """In one process: the steps from the resumed one to max_steps, the last one's checkpoint durable at the end,
    and a second run resumes there with nothing left to do."""
    begun = _train_through_the_protocol(tmp_path / "ck", 7)
    assert [s.number for s in begun] == list(range(7)) and not any(s.redo for s in begun)
    job = stalwart.Job(tmp_path / "ck")
    job.track(model=torch.nn.Linear(4, 1), optim=torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1))
    with job.loop(None, max_steps=7) as loop:
        assert loop.begin() is None, "resumed at step 7 of 7: nothing to run"
    assert job.step == 7
    job.close()


def test_a_body_that_raises_its_own_error_ends_the_run_with_that_error(tmp_path: Path) -> None:
    """failed() recovers only from a peer's failure; the user's own exception is raised again, as by steps()."""
    with pytest.raises(RuntimeError, match="the user's own error"):
        _train_through_the_protocol(tmp_path / "ck", 5, failing={2})


def test_calls_out_of_order_get_one_clear_error(tmp_path: Path) -> None:
    job = stalwart.Job(tmp_path / "ck")
    job.track(model=torch.nn.Linear(2, 2))
    loop = job.loop(None, max_steps=3)
    with pytest.raises(ConfigError, match=r"end\(\) called not started"):
        loop.end()
    first = loop.begin()
    assert first == Step(0, None, redo=False)
    with pytest.raises(ConfigError, match=r"begin\(\) called again before end\(\)"):
        loop.begin()
    loop.end()
    with pytest.raises(ConfigError, match=r"failed\(\) called between steps"):
        loop.failed(RuntimeError("x"))
    assert loop.begin() == Step(1, None) and not loop.update_dropped(), "one process: no peer to fail"
    loop.close()
    with pytest.raises(ConfigError, match=r"begin\(\) called after close\(\)"):
        loop.begin()
    with pytest.raises(ConfigError, match="max_steps must be >= 0"):
        job.loop(None, max_steps=-1)
    job.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return fault_free_results(tmp_path_factory.mktemp("protocol-reference"), *ARGS)


@pytest.mark.parametrize(
    "where",
    [
        ("--die-at", "13:backward"),  # inside the backward pass, with DDP's all-reduce of a bucket in flight
        ("STALWART_FAULTS", "kill@rank=1,step=13"),  # between two steps
        ("--die-at", "13:backward", "--check-gathered-loss"),  # and the body raises on what a collective left
    ],
    ids=["backward", "between-steps", "the-body-raises-after-the-failure"],
)
def test_a_loop_driven_through_the_protocol_redoes_the_failed_step_and_ends_bitwise(
    launch: Any, reference: Any, where: tuple[str, ...]
) -> None:
    """Under stalwart run, rank 1 dies mid-run; the replacement is waited for (the tests' default): the survivor
    stays in its loop, its next begin() is the failed step again (Step.redo), and both ranks end where a fault-free
    run of `job.steps()` ends. With --check-gathered-loss the body gathers every rank's loss into a NaN-filled
    buffer after its optimizer step and raises unless all are finite, as a Trainer's loss check: after the absorbed
    failure the gather leaves the buffer as it was, the body's error goes to failed(), and it is taken as the
    failure's consequence (the survivor stays in its loop all the same)."""
    flag, value = where[:2]
    extra = where if flag.startswith("--") else ()
    env = child_env(**({flag: value} if not flag.startswith("--") else {}))
    job = launch(tiny_args(*ARGS, "--protocol", "--setup-log", "setups.log", *extra), env=env)
    assert job.wait(180) == 0, job.output()
    results = job.results()
    for rank in reference:
        assert results[rank]["sha256"] == reference[rank]["sha256"], f"rank {rank} differs from the fault-free run"
        assert results[rank]["seen"] == reference[rank]["seen"], "the sample history differs"
    assert {e["rank"] for e in job.events("reformed_in_loop")} == {0}, "rank 0 stayed in its loop"
    redone = [e["step"] for e in job.events("resumed") if e["rank"] == 0 and e["restart"] == 1]
    assert len(redone) == 1, job.events("resumed")
    assert f"train_tiny: rank 0 redoes step {redone[0]}" in job.output(), "the survivor was told to redo the step"
    if "--check-gathered-loss" in where:
        assert "(then: RuntimeError: Loss is not finite" in job.output(), "the body raised after the failure"
    setups = (job.workdir / "setups.log").read_text().split()
    assert len(setups) == len(set(setups)) == 3, f"the set-up ran once in each process: {setups}"


def test_with_its_own_data_a_loop_driven_through_the_protocol_trains_on_shrunk(launch: Any) -> None:
    """The default (no --wait-for-replacement): the survivor trains on alone through the protocol while the
    replacement sets up, and the job grows back; every step is run and the run ends."""
    env = child_env(STALWART_WAIT_FOR_REPLACEMENT="0")
    job = launch(tiny_args(*ARGS, "--protocol", "--own-data", "--setup-s", "1", "--die-at", "13:forward"), env=env)
    assert job.wait(180) == 0, job.output()
    assert [(e["from"], e["to"]) for e in job.events("world_resized") if e.get("rank") == 0][:1] == [(2, 1)]
    assert "train_tiny: rank 0 redoes step" in job.output()
    assert job.results()[0]["step"] == STEPS
