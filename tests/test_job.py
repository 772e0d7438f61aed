"""The Job loop in one process: resume, RNG restore, API surface, config errors."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import stalwart
from stalwart.errors import CheckpointMismatchError, ConfigError
from stalwart.job.rng import capture_rng, restore_rng


def test_public_api_is_exported() -> None:
    for name in stalwart.__all__:
        assert hasattr(stalwart, name), name
    assert {"Job", "ResumableLoader", "ConfigError"} <= set(stalwart.__all__)


def test_rng_roundtrip_covers_python_numpy_torch() -> None:
    state = capture_rng()
    first = (random.random(), np.random.rand(), torch.rand(2))
    restore_rng(state)
    second = (random.random(), np.random.rand(), torch.rand(2))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def _numpy_matches(captured: dict[str, object]) -> bool:
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    n = captured["numpy"]
    assert isinstance(n, dict)
    return np.array_equal(n["keys"].numpy(), keys.astype(np.int64)) and (
        n["kind"],
        n["pos"],
        n["has_gauss"],
        n["cached"],
    ) == (kind, pos, has_gauss, cached)


def test_rng_capture_follows_every_move_of_the_generators_it_skips_reading() -> None:
    """capture_rng reuses the previous capture of numpy's and Python's generators when they have not moved; a
    cached Gaussian used up without the words moving must still be seen."""
    np.random.seed(3)
    assert _numpy_matches(capture_rng())
    assert _numpy_matches(capture_rng())  # unchanged: the reused capture is still right
    np.random.rand(5)
    assert _numpy_matches(capture_rng())
    np.random.randn()  # draws two, caches one: has_gauss 1
    got = capture_rng()
    assert _numpy_matches(got) and got["numpy"]["has_gauss"] == 1
    np.random.randn()  # uses the cached one: the words do not move, has_gauss 0
    got = capture_rng()
    assert _numpy_matches(got) and got["numpy"]["has_gauss"] == 0
    np.random.seed(3)
    assert _numpy_matches(capture_rng())
    # A restore can bring back a cached Gaussian with the same words: (W, p, 1) -> draw -> (W, p, 0) -> restore.
    np.random.randn()
    cached = capture_rng()
    assert cached["numpy"]["has_gauss"] == 1
    saved = {**cached, "numpy": dict(cached["numpy"])}
    np.random.randn()
    assert capture_rng()["numpy"]["has_gauss"] == 0
    restore_rng(saved)
    got = capture_rng()
    assert _numpy_matches(got) and got["numpy"]["has_gauss"] == 1
    before = capture_rng()["python"]["state"]
    assert capture_rng()["python"]["state"] is before  # Python's generator did not move: the same tensor
    random.random()
    after = capture_rng()
    assert not torch.equal(after["python"]["state"], before)
    restore_rng(after)
    assert random.getstate()[1] == tuple(after["python"]["state"].tolist())


def _train(ckpt: Path, steps: int, seed: int = 0) -> tuple[torch.Tensor, list[float]]:
    random.seed(seed)
    np.random.seed(seed)
    job = stalwart.Job(ckpt, checkpoint_every=3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5), torch.nn.Linear(3, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = stalwart.ResumableLoader(
        torch.randn(24, 3, generator=torch.Generator().manual_seed(1)), global_batch_size=4
    )
    job.track(model=model, optim=optim, data=loader)
    noise = []
    for _, x in job.steps(loader, max_steps=steps):
        n = random.random() + float(np.random.rand())
        noise.append(n)
        loss = model(x).pow(2).mean() * n
        optim.zero_grad()
        loss.backward()
        optim.step()
    job.close()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), noise


def test_resume_in_one_process_is_bitwise_identical(tmp_path: Path) -> None:
    straight, noise = _train(tmp_path / "a", 10)
    _, head = _train(tmp_path / "b", 7)  # stops after step 7, which it checkpoints as its last
    # Another seed stands for a fresh process's RNG state: only the checkpoint's RNG state can make this equal.
    resumed, tail = _train(tmp_path / "b", 10, seed=123)
    assert torch.equal(straight, resumed)
    assert head + tail == noise


def test_job_config_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='checkpoint_every must be "auto" or a positive integer'):
        stalwart.Job(tmp_path, checkpoint_every=0)
    with pytest.raises(ConfigError, match="unexpected keyword"):
        stalwart.Job(tmp_path, checkpoint_evry=5)


def test_track_requires_state_dict_protocol(tmp_path: Path) -> None:
    job = stalwart.Job(tmp_path / "ck")
    with pytest.raises(ConfigError, match="state_dict"):
        job.track(thing=object())
    job.close()


def test_tracked_names_must_match_the_checkpoint(tmp_path: Path) -> None:
    job = stalwart.Job(tmp_path / "ck", checkpoint_every=1)
    job.track(model=torch.nn.Linear(2, 2))
    for _ in job.steps(max_steps=1):
        pass
    job.close()
    again = stalwart.Job(tmp_path / "ck")
    again.track(net=torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointMismatchError, match="track the same names"):
        again.resume()
    again.close()


def test_lazy_modules_resume(tmp_path: Path) -> None:
    for steps in (2, 4):
        job = stalwart.Job(tmp_path / "ck", checkpoint_every=1)
        model = torch.nn.LazyLinear(2)
        model(torch.ones(1, 3))  # materialised by the first forward, as in a real loop before the first save
        job.track(model=model)
        for _ in job.steps(max_steps=steps):
            pass
        job.close()
    assert job.resumed_from == 2


_FAILING_JOB = """
import faulthandler
import sys
faulthandler.dump_traceback_later(90, exit=True)  # a hang fails the test with every thread's stack
import torch.distributed as dist
import stalwart
from stalwart.errors import StalwartError
try:
    stalwart.Job(sys.argv[1])
except StalwartError as exc:
    print("caught:", type(exc).__name__)
print("group left:", not dist.is_initialized())
"""


@pytest.mark.parametrize("why", ["hang_timeout", "foreign_dir"])
def test_a_job_that_fails_to_start_leaves_nothing_for_the_exit_and_leaves_its_group(tmp_path: Path, why: str) -> None:
    """A caller that catches Job()'s error must not meet a traceback at interpreter exit (an exit handler of a
    half-made Job), and the process group that Job() joined must be left again."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_", "PET_"))}
    if why == "hang_timeout":
        env["STALWART_HANG_TIMEOUT"] = "soon"
    else:
        (ckpt / "notes.txt").write_text("not stalwart's")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FAILING_JOB, str(ckpt)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank}: {err}"
        assert "caught:" in out and "group left: True" in out, f"rank {rank}: {out}\n{err}"
        assert "Exception ignored" not in err and "Traceback" not in err, f"rank {rank}: {err}"
    assert (ckpt / "notes.txt").exists() == (why == "foreign_dir"), "nothing of the user's is deleted"


def test_a_loader_may_yield_none_as_a_batch(tmp_path: Path) -> None:
    """Only an exhausted loader ends the steps; a None batch (a loader of side-effect steps) is a batch."""
    job = stalwart.Job(tmp_path / "ck", checkpoint_every=2)
    job.track(model=torch.nn.Linear(2, 2))
    seen = [(step, batch) for step, batch in job.steps([None, None, None], max_steps=3)]
    job.close()
    assert seen == [(0, None), (1, None), (2, None)]
    assert job.step == 3
