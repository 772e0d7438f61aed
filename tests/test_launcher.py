"""`stalwart run`: bad input, restarts, reaping, repeated kills, and the same script under torchrun."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY, Launch, alive, child_env, served_script, stalwart, tiny_args
from stalwart.errors import EXIT_USER_ERROR


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run", "--nproc-per-node", "2", "no_such_script.py"], "does not exist"),
        (["run", "--nproc-per-node", "0", str(TINY)], "--nproc-per-node must be at least 1"),
        (["run", "--nproc-per-node", "two", str(TINY)], "--nproc-per-node takes a number of processes"),
        (["run", "--nproc-per-node=--5", str(TINY)], "--nproc-per-node takes a number of processes"),
        (["run", "--no-such-flag", str(TINY)], "unrecognized arguments"),
        (["run", "--max-restarts", "-1", str(TINY)], "--max-restarts must be >= 0"),
        (["run", "--replace-wait-s", "-1", str(TINY)], "--replace-wait-s must be a number of seconds >= 0"),
        (["run", "--replace-wait-s", "nan", str(TINY)], "--replace-wait-s must be a number of seconds >= 0"),
        (["run", "--failover-s", "0", str(TINY)], "--failover-s must be a positive number of seconds"),
        (["run", "--nnodes", "2:1", str(TINY)], "--nnodes"),
        (["run", "--nnodes", "2", str(TINY)], "--rdzv-endpoint"),
        # 192.0.2.1 (TEST-NET-1) is no address of this host: as the store's host it cannot bind there.
        (
            [
                "run",
                "--event-log",
                "/dev/null",
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                "192.0.2.1:29999",
                "--rdzv-conf",
                "is_host=1",
                str(TINY),
            ],
            "cannot start the rendezvous at 192.0.2.1:29999",
        ),
        (["run", "-m", "no_such_module_xyz"], "cannot be found"),
        (["frobnicate"], "unknown command"),
        (["demo", "--steps", "3"], "--steps"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args: list[str], expected: str, tmp_path: Path) -> None:
    result = stalwart(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert expected in _one_error_line(result.stderr)
    assert list(tmp_path.iterdir()) == [], "nothing is written for bad input"


def test_run_s_help_sets_stalwart_s_own_options_apart_with_its_defaults() -> None:
    out = stalwart("run", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # whatever the terminal's width
    ours = text[text.index("stalwart's own options") :]
    assert "--event-log EVENT_LOG" in ours and "--event-log-handler" not in ours, "torchrun's, then stalwart's"
    assert "--spares" in ours and "--wait-for-replacement" in ours and "--nproc-per-node" not in ours
    assert "stalwart's default 3" in text and "torchrun's is 0" in text, "the default stalwart changes is said"


def _worker_error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("stalwart: error:")]


def _first_error(job: Any) -> str:
    """The first `stalwart: error:` line of a launch's output; fails with the whole output when there is none."""
    lines = _worker_error_lines(job.output())
    assert lines, job.output()
    return lines[0]


def test_foreign_checkpoint_directory_is_refused_without_restarts(launch: Any, tmp_path: Path) -> None:
    foreign = tmp_path / "job" / "ckpt"
    foreign.mkdir(parents=True)
    (foreign / "model.bin").write_bytes(b"someone else's")
    job = launch(tiny_args(), name="job")
    assert job.wait(120) == EXIT_USER_ERROR, job.output()
    lines = _worker_error_lines(job.output())
    assert len(lines) == 1 and "did not write" in lines[0], job.output()
    assert "Traceback" not in job.output()
    assert {e["restart"] for e in job.events("worker_spawned")} == {0}, "bad input is not retried"
    assert sorted(p.name for p in foreign.iterdir()) == ["model.bin"], "nothing was deleted or added"


_QUIET_FIRST = """
import os, time
from stalwart.errors import NumericError
from stalwart.job.lifecycle import install_worker_safety_nets
install_worker_safety_nets()
rank = int(os.environ["RANK"])
if rank == 0:
    time.sleep(1.0)  # the rank that prints is the slower one
raise NumericError("training diverged: said once, by rank 0", quiet=rank != 0)
"""


def test_an_error_every_rank_met_is_printed_though_a_quiet_rank_exited_first(launch: Any, tmp_path: Path) -> None:
    """Rank 1 exits for the error at once and without a line, as every rank but 0 does; the group is not stopped
    before rank 0 has said why (host_pool.USER_ERROR_GRACE_S)."""
    script = tmp_path / "quiet_first.py"
    script.write_text(_QUIET_FIRST)
    job = launch(["--nproc-per-node", "2", str(script)])
    assert job.wait(120) == EXIT_USER_ERROR, job.output()
    assert _worker_error_lines(job.output()) == ["stalwart: error: training diverged: said once, by rank 0"], (
        job.output()
    )
    assert {e["exitcode"] for e in job.events("worker_failed")} == {EXIT_USER_ERROR}, "a rank was stopped"


def test_checkpoint_directory_not_shared_by_all_ranks_is_refused(launch: Any) -> None:
    job = launch(tiny_args("--ckpt-per-rank"))
    assert job.wait(120) == EXIT_USER_ERROR, job.output()
    lines = _worker_error_lines(job.output())
    assert len(lines) == 1 and "rank 1 cannot see the checkpoint directory" in lines[0], job.output()


def test_state_that_cannot_be_checkpointed_stops_before_training(launch: Any) -> None:
    job = launch(tiny_args("--unsavable-on-rank", "0"))
    assert job.wait(120) == EXIT_USER_ERROR, job.output()
    assert "numpy.float64" in _first_error(job)
    assert {e["restart"] for e in job.events("worker_spawned")} == {0}
    assert not job.events("step_done")


def test_unwritable_checkpoint_directory(launch: Any, tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "blocker").write_text("a file where a directory should be")
    job = launch([*tiny_args()[:-4], "--ckpt", "blocker/ckpt", "--out", "out"], name="job")
    assert job.wait(120) == EXIT_USER_ERROR, job.output()
    assert "not writable" in _first_error(job)


def test_other_model_shape_and_world_size_are_refused(launch: Any, tmp_path: Path) -> None:
    first = launch(tiny_args("--steps", "8"), name="job")
    assert first.wait(120) == 0, first.output()
    ckpt = tmp_path / "job" / "ckpt"
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))

    shape = launch(tiny_args("--steps", "12", "--hidden", "16"), name="job")
    assert shape.wait(120) == EXIT_USER_ERROR
    assert "has shape (32, 8) in the checkpoint and (16, 8) in the model" in _first_error(shape)

    resized = launch(tiny_args("--steps", "12", nproc=1), name="job")
    assert resized.wait(120) == EXIT_USER_ERROR
    assert "written by 2 ranks and this job has 1" in _first_error(resized)
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before, "refusals change nothing on disk"


def test_world_size_change_when_allowed_continues_at_the_global_position(launch: Any, tmp_path: Path) -> None:
    from stalwart.data.order import epoch_permutation

    first = launch(tiny_args("--steps", "8"), name="job")
    assert first.wait(120) == 0, first.output()
    rank0_before = first.results()[0]["seen"]
    again = launch(tiny_args("--steps", "12", "--allow-resize", nproc=1), name="job")
    assert again.wait(120) == 0, again.output()
    seen = again.results()[0]["seen"]
    assert seen[: len(rank0_before)] == rank0_before
    # Steps 8..11 at world size 1 take whole global batches 8 and 9 of epoch 0, then 0 and 1 of epoch 1.
    order0, order1 = epoch_permutation(60, 3, 0).tolist(), epoch_permutation(60, 3, 1).tolist()
    assert seen[len(rank0_before) :] == order0[48:60] + order1[0:12]


def test_max_restarts_is_honoured(launch: Any, tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    job = launch(["--nproc-per-node", "1", "--max-restarts", "2", str(script)])
    assert job.wait(120) == 1
    assert sorted(e["restart"] for e in job.events("worker_spawned")) == [0, 1, 2]
    assert [e["exitcode"] for e in job.events("worker_failed")] == [3, 3, 3]
    assert job.events("job_stopped")[0]["reason"] == "max_restarts"


@pytest.mark.parametrize("flags", [("--no-reform",), ("--no-reform", "--redirects", "3")], ids=["forked", "spawned"])
def test_workers_are_forked_with_torch_imported_unless_an_option_needs_torch_elastics_own(
    launch: Any, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """Under --no-reform too the workers are forked from the zygote (no import of torch in each); with an option
    only torch elastic's own spawned processes honour (--redirects) they are spawned, and their output is where
    torch elastic writes it."""
    script = tmp_path / "where.py"
    script.write_text("import sys\nprint('torch imported at start:', 'torch' in sys.modules)\n")
    logs = tmp_path / "logs"
    job = launch([*flags, "--log-dir", str(logs), "--nproc-per-node", "1", str(script)])
    assert job.wait(120) == 0, job.output()
    written = [p.read_text() for p in logs.rglob("stdout.log")]
    said = written[0] if written else job.output()
    assert f"torch imported at start: {flags == ('--no-reform',)}" in said, (said, job.output())
    assert bool(written) == ("--redirects" in flags), "torch elastic's files only where it spawned the worker"


@pytest.mark.parametrize(
    ("sig", "grace"),
    [(signal.SIGTERM, "30"), (signal.SIGTERM, "0")]
    + [(s, "30") for s in (signal.SIGHUP, signal.SIGINT, signal.SIGKILL)],
)
def test_no_orphaned_workers_when_the_launcher_dies(launch: Any, sig: signal.Signals, grace: str) -> None:
    """SIGTERM is a preemption by default (a last checkpoint, then 143); with --preempt-grace-s 0, and for the
    other signals, the launcher stops the workers at once like torchrun. Either way nothing is left behind."""
    job = launch(
        [
            "--preempt-grace-s",
            grace,
            *tiny_args("--steps", "100000", "--step-sleep", "0.05", "--workers", "1", "--every", "1000"),
        ]
    )
    job.wait_for(lambda: len(job.events("step_done")) >= 2, 90, "training to start")
    workers = list(job.worker_pids().values())
    assert len(workers) == 2 and all(alive(p) for p in workers)
    pids = workers + _children(workers)
    assert len(pids) >= 4, "each worker runs a DataLoader worker process"
    shm = sorted(Path("/dev/shm").glob(f"stalwart-*-{job.proc.pid}-*"))
    assert {p.name.split("-")[1] for p in shm} == {"heartbeat", "snapshots"}, shm
    job.proc.send_signal(sig)
    code = job.proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), f"workers or their DataLoader workers outlived a {sig.name}ed launcher"
    if sig != signal.SIGKILL:  # handled like torchrun: workers stopped, shared memory removed, an event, 128 + N
        assert code == 128 + sig, job.output()[-2000:]
        preempted = sig == signal.SIGTERM and grace != "0"
        reason = "preempted" if preempted else f"signal {sig.name}"
        assert [e["reason"] for e in job.events("launcher_exit")] == [reason]
        assert not [p for p in shm if p.exists()], "the heartbeat board and the memory tier are removed"
        assert f"received {sig.name}" in job.output()
        if preempted:
            (saved,) = {e["step"] for e in job.events("preempted")}
            assert (job.workdir / "ckpt" / f"step_{saved:08d}").is_dir(), "the last checkpoint is durable"


def _children(parents: list[int]) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) in parents:
            found.append(int(stat.parent.name))
    return found


def test_ten_kills_in_a_row_recover_every_time(launch: Any, tmp_path: Path) -> None:
    """Stock torchrun 2.13 recovered from one SIGKILL in 10 of 21 runs (ten in a row: about 1 in 1000);
    stalwart run must recover every time. A kill before the job's first snapshot leaves the survivor nothing to
    go back to: it runs its script again, which can take one more round (seen once in a full suite, 2026-11-27),
    so each kill waits for steps of any later round."""
    kills, steps = 10, 120
    args = tiny_args("--steps", str(steps), "--every", "5", "--step-sleep", "0.01", max_restarts=2 * kills + 2)
    job = launch(args, name="killed")
    rng = random.Random(2026)
    since = 0
    for n in range(kills):
        job.wait_for(lambda r=since: [e for e in job.events("step_done") if e["restart"] >= r], 90, f"kill {n}'s round")
        since = max(e["restart"] for e in job.events("step_done"))
        time.sleep(rng.uniform(0, 0.05))
        victim = job.worker_pids(restart=since)[rng.randrange(2)]
        os.kill(victim, signal.SIGKILL)
        since += 1
    assert job.wait(240) == 0, job.output()
    assert len(job.events("restarting")) >= kills
    reference = launch(tiny_args("--steps", str(steps), "--every", "5"), name="reference")
    assert reference.wait(120) == 0, reference.output()
    assert job.results()[0]["sha256"] == reference.results()[0]["sha256"], "bitwise identical after 10 kills"
    assert job.results()[1]["seen"] == reference.results()[1]["seen"]


def test_torchrun_static_flags_keep_their_meaning(monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.supervisor.run_args import parse

    script = str(TINY)
    assert parse([script]).rdzv_backend == "c10d"
    two_static = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "--master-port", "5", script])
    assert two_static.rdzv_backend == "static", "several static nodes keep torchrun's static rendezvous"
    one = parse(["--master_port=1234", script])
    assert (one.rdzv_backend, one.rdzv_endpoint) == ("c10d", "127.0.0.1:1234"), "one node: c10d on that port"
    assert parse([script, "--master-port", "9"]).rdzv_endpoint == "", "the script's own flags are its own"
    monkeypatch.setenv("PET_RDZV_BACKEND", "static")
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "h:5")
    assert parse([script]).rdzv_backend == "static"


def test_same_script_under_torchrun_and_as_one_process(launch: Any, tmp_path: Path) -> None:
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir", "logs",
         str(TINY), "--ckpt", "ckpt", "--out", "out", "--steps", "6"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=child_env(),
    )  # fmt: skip
    assert torchrun.returncode == 0, torchrun.stderr
    (tmp := tmp_path / "tmp").mkdir()
    ours = launch(tiny_args("--steps", "6"), name="ours", env=child_env(TMPDIR=str(tmp)))
    assert ours.wait(120) == 0, ours.output()
    # torch's compile cache (torchinductor_<user>) is shared by every run and meant to stay.
    left = [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == [], "torch elastic's log directories are removed with the launcher"
    under_torchrun = json.loads((tmp_path / "out" / "rank1.json").read_text())
    assert under_torchrun["sha256"] == ours.results()[1]["sha256"], "torchrun and stalwart run train alike"
    # As `python train_tiny.py ...`, forked with torch imported (conftest.served_script): no launcher, one process.
    single = served_script(TINY, ["--ckpt", "ckpt1", "--out", "out1", "--steps", "6"], child_env(), tmp_path,
                           tmp_path / "single.log")  # fmt: skip
    assert single.wait(120) == 0, (tmp_path / "single.log").read_text()
    assert (tmp_path / "ckpt1" / "step_00000006" / "manifest.json").exists()


def test_launch_reports_the_workers_environment(tmp_path: Path) -> None:
    job = Launch(tmp_path / "job", tiny_args("--steps", "2", nproc=1), child_env())
    try:
        assert job.wait(120) == 0
        env = job.results()[0]["env"]
        assert env["WORLD_SIZE"] == "1" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        started = job.events("launcher_started")[0]
        assert started["nproc_per_node"] == 1 and started["max_restarts"] == 3
    finally:
        job.reap()


def _listeners(pids: list[int]) -> list[str]:
    """ "address:port" of every listening TCP socket the processes hold (from /proc, like `ss -ltnp`)."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if len(raw) == 4:
                addr = ipaddress.ip_address(raw[::-1])
            else:  # four little-endian 32-bit words
                addr = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
            found.append(f"{addr}:{int(hex_port, 16)}")
    return found


def test_a_one_node_run_listens_on_loopback_only(launch: Any) -> None:
    job = launch(tiny_args("--steps", "100000", "--step-sleep", "0.05", "--every", "1000"))
    job.wait_for(lambda: len(job.events("step_done")) >= 4, 90, "training to start")
    pids = [job.proc.pid, *job.worker_pids().values()]
    pids += _children(pids)
    listening = _listeners(pids)
    # The agent's rendezvous store, rank 0's process-group store, gloo's pairs: all there, all on loopback.
    assert len(listening) >= 2, listening
    outside = [a for a in listening if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
    assert not outside, f"listening beyond loopback: {outside} (all: {listening})"


def test_a_one_node_rendezvous_skips_the_random_start_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sleeps a random 0-0.3 s before joining round 0 (the start and the first restart) to spread several
    nodes' joins; one node has nothing to spread, so that sleep is skipped, and polling delays are kept."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous

    from stalwart.supervisor.rendezvous import rendezvous_handler

    delays: list[object] = []

    def record(seconds: object) -> None:
        delays.append(seconds)

    monkeypatch.setattr(dynamic_rendezvous, "_delay", record)
    params = RendezvousParameters("c10d", "127.0.0.1:0", "one-node", 1, 1, is_host="1")
    handler = rendezvous_handler(params)
    try:
        handler.next_rendezvous()
    finally:
        handler.shutdown()
    assert not [d for d in delays if isinstance(d, tuple)], delays
    assert dynamic_rendezvous._delay is record, "torch's own delay function is back in place"


def test_where_torch_names_rank_0_by_host_name_every_agent_gets_its_local_addr_as_master() -> None:
    """torch 2.4's rendezvous gives the workers rank 0's socket.getfqdn() as MASTER_ADDR whatever --local-addr
    says; there rank 0's agent publishes its address in the round's store (later torch does it itself)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from stalwart.supervisor.rendezvous import _master_at_local_addr

    def round_of(store: Any, rank: int) -> Any:
        store.set_timeout(timedelta(seconds=5))  # a key never published fails the test instead of hanging it
        info = SimpleNamespace(rank=rank, store=store, bootstrap_store_info=SimpleNamespace(master_addr="vm.fqdn"))
        return lambda: info

    store = dist.HashStore()
    head = _master_at_local_addr(round_of(store, 0), "10.231.79.1")
    other = _master_at_local_addr(round_of(store, 1), "10.231.79.2")
    assert head.bootstrap_store_info.master_addr == other.bootstrap_store_info.master_addr == "10.231.79.1"
    unnamed = dist.HashStore()  # rank 0 without --local-addr: torch's choice stands, for every agent
    head = _master_at_local_addr(round_of(unnamed, 0), None)
    other = _master_at_local_addr(round_of(unnamed, 1), "10.231.79.2")
    assert head.bootstrap_store_info.master_addr == other.bootstrap_store_info.master_addr == "vm.fqdn"


def test_the_rendezvous_names_its_events_without_inspecting_the_whole_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch names each rendezvous event after its caller with inspect.stack() (most of a restart's rendezvous in
    the agent); stalwart's handler swaps in a frame lookup that gives the same names."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous

    from stalwart.supervisor.rendezvous import rendezvous_handler

    original = dynamic_rendezvous.get_method_name
    original = getattr(original, "__wrapped__", original)  # torch's own (an earlier handler replaced it)
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", original)

    def caller(name_of: Any) -> str:
        def recorder() -> str:
            return name_of()  # like torch's _record: the name is that of recorder's caller

        return recorder()

    expected = caller(original)
    handler = rendezvous_handler(RendezvousParameters("c10d", "127.0.0.1:0", "names", 1, 1, is_host="1"))
    try:
        replaced = dynamic_rendezvous.get_method_name
        assert replaced is not original, "torch's stack-inspecting version is still in place"
        assert expected == caller(replaced) == "caller"
        assert replaced(10_000) == original(10_000) == "no_method_name"
        handler.next_rendezvous()  # and a rendezvous still completes with it
    finally:
        handler.shutdown()
