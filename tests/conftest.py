"""Fixtures that start real `stalwart run` processes and always reap them, also when a test fails."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.runtime.process import spawn
from stalwart.supervisor import launch_server
from stalwart.supervisor.launch_server import LaunchServer

TINY = Path(__file__).parent / "scripts" / "train_tiny.py"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_", "PET_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    # The tests compare runs with failures bitwise to runs without: survivors wait for the replacement. Training on
    # shrunk meanwhile (the default) has its own tests (tests/test_shrink.py), which set it to 0.
    env["STALWART_WAIT_FOR_REPLACEMENT"] = "1"
    # The tests' jobs run on the CPU: a GPU machine's GPUs must not change them (warm spares turn off on a node with
    # GPUs). Tests of the telemetry give a scripted provider.
    env["STALWART_GPU_TELEMETRY"] = "off"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    """`predicate()`'s first truthy value, asked every 50 ms; the test fails after `timeout` s without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def committed_steps(ckpt: Path) -> list[int]:
    """The steps of the checkpoints under `ckpt` whose manifest landed (a checkpoint is committed once its manifest
    is written), oldest first: what a resume can read, whatever the timing of the run that wrote them."""
    return sorted(int(p.parent.name.removeprefix("step_")) for p in ckpt.glob("step_*/manifest.json"))


def process_log(job: Any, kind: str, pid: int | str) -> list[int]:
    """The numbers a test script's process wrote, one a line, to `kind/pid<pid>.txt` in the job's directory (its
    --served-log: the dataset's indices it read; its --step-log: each step's end), or to `kind/<pid>` given a
    file name; [] where it wrote none."""
    path = job.workdir / kind / (pid if isinstance(pid, str) else f"pid{pid}.txt")
    return [int(s) for s in path.read_text().split()] if path.exists() else []


def digests(job: Any) -> dict[int, str]:
    """Each rank's parameters' sha256, as the test scripts write them to --out."""
    return {rank: r["sha256"] for rank, r in job.results().items()}


def setups(job: Any) -> list[str]:
    """The pids that ran the script's set-up (its --setup-log), one per run of it."""
    return (job.workdir / "setups.txt").read_text().split()


def kill_the_launcher(job: Any, step: int, checkpoint: int) -> int:
    """SIGKILL `job`'s launcher once `step` ended (its --step-log) and `checkpoint`'s manifest landed; its workers
    die with it. Returns the last committed step: `checkpoint`, or a later one whose commit landed before the kill."""
    ended = lambda: [s for f in (job.workdir / "steps").glob("pid*.txt") for s in f.read_text().split()]  # noqa: E731
    committed = lambda: committed_steps(job.workdir / "ckpt")  # noqa: E731
    job.wait_for(
        lambda: str(step) in ended() and checkpoint in committed(), 120, f"step {step} and {checkpoint}'s checkpoint"
    )
    workers = job.worker_pids(restart=0)
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait()
    wait_for(lambda: not [pid for pid in workers.values() if alive(pid)], 30, "the workers to die with the launcher")
    return committed()[-1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Launch:
    """One `stalwart run` process with its event log and output."""

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str], prefix: tuple[str, ...] = ()) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.event_log = workdir / "events.jsonl"
        self._events: list[dict[str, Any]] = []
        self._read_to = 0
        self.output_path = workdir / "output.log"
        argv = ["run", "--event-log", str(self.event_log), *args]
        self._out = open(self.output_path, "wb")  # noqa: SIM115 (closed in reap)
        self.proc: Any
        netns, rest = launch_server.split_netns([*prefix, "stalwart"])
        if rest != ["stalwart"] or os.environ.get("STALWART_TEST_NO_LAUNCH_SERVER"):
            # SIGTERM to the launcher if the test process dies (killed pytest, a crashed xdist worker).
            cmd = [*prefix, sys.executable, "-m", "stalwart", *argv]
            self.proc = spawn(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, cwd=workdir)
        else:  # forked with torch imported (into a host's namespace): supervisor/launch_server.py says why
            self.proc = _launch_server().start(argv, env, workdir, self.output_path, netns=netns)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The events logged so far (of `kind`), as `read_events` gives them. Read on from where the last call
        stopped: `wait_for` asks every 20 ms, and parsing the whole log each time cost a long test seconds of CPU."""
        try:
            with open(self.event_log, "rb") as f:
                f.seek(self._read_to)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written is read next time
        self._read_to += len(complete)
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):  # a torn line (a writer killed mid-write), as read_events skips it
                self._events.append(json.loads(line))
        return [e for e in self._events if kind is None or e["event"] == kind]

    def worker_pids(self, restart: int | None = None) -> dict[int, int]:
        return {
            e["rank"]: e["worker_pid"]
            for e in self.events("worker_spawned")
            if restart is None or e["restart"] == restart
        }

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stalwart run did not finish in {timeout} s; output:\n{self.output()[-3000:]}")

    def wait_for(self, predicate: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                pytest.fail(
                    f"stalwart run exited ({self.proc.returncode}) while waiting for {what}:\n{self.output()[-3000:]}"
                )
            time.sleep(0.02)
        pytest.fail(f"timed out after {timeout} s waiting for {what}:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def results(self) -> dict[int, dict[str, Any]]:
        return read_results(self.workdir / "out")

    def reap(self) -> None:
        """End the launcher and every worker it started that is still alive (only our own PIDs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for e in self.events("worker_spawned"):
            if alive(e["worker_pid"]):
                os.kill(e["worker_pid"], signal.SIGKILL)
        self._out.close()


_SERVER: LaunchServer | None = None


def _launch_server() -> LaunchServer:
    """This test process's launch server, started at its first use (and again if it ended)."""
    global _SERVER
    server = [sys.executable, "-u", str(Path(__file__).with_name("launch_server.py"))]
    _SERVER = launch_server.started(_SERVER, child_env(), server)
    return _SERVER


def served_script(script: Path, args: list[str], env: dict[str, str], cwd: Path, out: Path) -> Any:
    """`python SCRIPT ARGS...` forked from this test process's launch server (a Popen-like process, output to
    `out`), for tests that start a script's ranks themselves: torch imported, as by a launcher's zygote."""
    return _launch_server().start(["--script", str(script), *args], env, cwd, out)


def served_python(
    code: str, *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -c CODE ARGS...` as `subprocess.run(..., capture_output=True, text=True)` returns it, forked from
    this test process's launch server: for code that needs a process of its own (a process group, memory another
    process reads), not a fresh interpreter (that is `subprocess`'s)."""
    with tempfile.TemporaryDirectory(prefix="stalwart-python-") as tmp:
        script = Path(tmp) / "code.py"
        script.write_text(code)
        done = _served(["--script", str(script), *args], child_env(), cwd or Path.cwd(), timeout)
    return subprocess.CompletedProcess(["python", "-c", code, *args], done.returncode, done.stdout, done.stderr)


def stalwart(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -m stalwart <args>` with stdout and stderr captured as text, as `subprocess.run` returns it (and
    `subprocess.TimeoutExpired` after `timeout`), forked from this test process's launch server: it saves each call
    the 2-3 s of CPU a new interpreter spends importing torch (tests/launch_server.py says what differs). A new
    interpreter under STALWART_TEST_NO_LAUNCH_SERVER=1."""
    env = child_env() if env is None else env
    cwd = cwd or Path.cwd()
    if os.environ.get("STALWART_TEST_NO_LAUNCH_SERVER"):
        cmd = [sys.executable, "-m", "stalwart", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    done = _served(list(args), env, cwd, timeout)
    return subprocess.CompletedProcess(["stalwart", *args], done.returncode, done.stdout, done.stderr)


def _served(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """The tests' launch server's `argv` run to its end (killed after `timeout`, then TimeoutExpired), its stdout
    and stderr read back as text."""
    with tempfile.TemporaryDirectory(prefix="stalwart-served-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = _launch_server().start(argv, env, cwd, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        read = lambda path: path.read_text(errors="replace")  # noqa: E731
        return subprocess.CompletedProcess(argv, code, read(out), read(err))


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Any]:
    started: list[Launch] = []

    def start(
        args: list[str], name: str = "job", env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
    ) -> Launch:
        job = Launch(tmp_path / name, args, env or child_env(), prefix)
        started.append(job)
        return job

    yield start
    for job in started:
        job.reap()


def read_results(out: Path) -> dict[int, dict[str, Any]]:
    """The tiny job's results in `out` (its --out): rank -> step, parameters, their sha256, samples seen."""
    return {int(path.stem[4:]): json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))}


def check_global_batch_kept(results: dict[int, Any], reference: dict[int, Any], tolerance: float) -> None:
    """Every sample of the fault-free run seen once, none twice, and every rank's parameters within `tolerance` of
    it, relative to the parameters' largest magnitude (tests/test_shrink.py says why a tolerance)."""
    seen = sorted(i for r in results for i in results[r]["seen"])
    assert seen == sorted(i for r in reference for i in reference[r]["seen"]), "every sample once, none twice"
    scale = max(abs(v) for v in reference[0]["params"])
    for rank in reference:
        diff = max(abs(a - b) for a, b in zip(results[rank]["params"], reference[rank]["params"], strict=True))
        assert diff <= tolerance * scale, f"rank {rank}: {diff} from the fault-free run"


def tiny_args(*extra: str, nproc: int = 2, max_restarts: int = 3) -> list[str]:
    """`stalwart run` arguments for the tiny job; it writes ckpt/ and out/ in the Launch's directory (its cwd)."""
    return [
        "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        str(TINY), "--ckpt", "ckpt", "--out", "out", *extra,
    ]  # fmt: skip


def fault_free_results(
    directory: Path, *job_args: str, timeout: float = 120, nproc: int = 2
) -> dict[int, dict[str, Any]]:
    """The tiny job's results (rank -> step, parameters' sha256, samples seen) from a fault-free run under
    `stalwart run` with `job_args` (tiny_args' extras): what a run with failures must end identical to.

    Run once per test run for each `job_args` and `nproc`, whichever xdist worker asks first (the others wait for
    it and read its results): a module's tests are spread over the workers, and each of them ran the same
    reference before. The results are the job's alone (the reference has no faults), so any run of it will do."""
    shared = directory.parent.parent if directory.parent.name.startswith("popen-gw") else None
    if shared is None:
        return _fault_free_run(directory, job_args, timeout, nproc)
    key = hashlib.sha256(json.dumps([list(job_args), nproc]).encode()).hexdigest()[:16]
    cached = shared / f"fault-free-{key}.json"
    with open(shared / f"fault-free-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this test fails
        if cached.exists():
            return {int(rank): result for rank, result in json.loads(cached.read_text()).items()}
        results = _fault_free_run(directory, job_args, timeout, nproc)
        cached.write_text(json.dumps(results))
        return results


@contextlib.contextmanager
def finished(directory: Path, args: list[str], timeout: float = 180.0) -> Iterator[Launch]:
    """A run a module's tests compare with (a Trainer alone, without a failure): launched, required to exit 0, and
    reaped when the `with` ends, also when the tests fail."""
    job = Launch(directory, args, child_env())
    try:
        assert job.wait(timeout) == 0, job.output()[-3000:]
        yield job
    finally:
        job.reap()


def _fault_free_run(
    directory: Path, job_args: tuple[str, ...], timeout: float, nproc: int
) -> dict[int, dict[str, Any]]:
    job = Launch(directory, tiny_args(*job_args, nproc=nproc), child_env())
    try:
        assert job.wait(timeout) == 0, job.output()
        return job.results()
    finally:
        job.reap()


_OPEN_CHECKPOINTERS: list[Any] = []


def open_checkpointer(root: Path | str, log: Path | None = None, **options: Any) -> Any:
    """A one-rank Checkpointer (token "t") whose persister is stopped after the test, pass or fail."""
    from stalwart.checkpoint import Checkpointer
    from stalwart.telemetry.events import EventLog

    options.setdefault("keep_last", 3)
    ck = Checkpointer.standalone(root, events=EventLog(log), token="t", **options)
    _OPEN_CHECKPOINTERS.append(ck)
    return ck


@pytest.fixture(autouse=True)
def _close_checkpointers() -> Iterator[None]:
    yield
    while _OPEN_CHECKPOINTERS:
        _OPEN_CHECKPOINTERS.pop().close()


# The quick tier (`scripts/test.sh --quick`) runs everything but these: the unit tests and one or two real
# multi-process scenarios of each kind (a kill, a re-form, a signal to the launcher, the demo's leftovers).
SLOW_MODULES = {
    "test_bench_checkpoint.py",
    "test_demo.py",
    "test_exactly_once.py",
    "test_multinode.py",
    "test_s3.py",
    "test_sharded.py",
    "test_spares.py",
}
SLOW_TESTS = {
    "test_docs.py": ("test_the_readmes_port_runs_as_pasted",),
    "test_bench_overhead.py": ("test_a_small_run_reports_plain_and_each_configuration",),
    "test_launcher.py": (
        "test_checkpoint_directory_not_shared_by_all_ranks_is_refused",
        "test_state_that_cannot_be_checkpointed_stops_before_training",
        "test_other_model_shape_and_world_size_are_refused",
        "test_world_size_change_when_allowed_continues_at_the_global_position",
        "test_max_restarts_is_honoured",
        "test_no_orphaned_workers_when_the_launcher_dies[1]",
        "test_no_orphaned_workers_when_the_launcher_dies[2]",
        "test_no_orphaned_workers_when_the_launcher_dies[9]",
        "test_ten_kills_in_a_row_recover_every_time",
        "test_same_script_under_torchrun_and_as_one_process",
    ),
    "test_resume.py": (
        "test_sigkill_at_random_step_ends_bitwise_identical[2]",
        "test_sigkill_at_random_step_ends_bitwise_identical[3]",
        "test_memory_tier_resumes_from_the_last_completed_step",
        "test_kill_inside_save_keeps_previous_checkpoint[0-before_commit]",
        "test_corrupt_newest_shard_falls_back_on_every_rank",
        "test_budgeted_snapshots_resume_from_the_newest_one_every_rank_holds",
    ),
    "test_reform.py": (
        "test_survivors_keep_their_process_and_the_run_ends_bitwise_identical[hang",
        "test_survivors_keep_their_process_and_the_run_ends_bitwise_identical[kill@rank=1,step=13;",
        "test_light_snapshots",
        "test_a_rank_dying_after_the_last_collective_of_a_step_loses_at_most_that_step",
        "test_without_a_survivor_the_newest_full_copy_or_checkpoint_is_used",
        "test_under_the_defaults_without_a_survivor",
        "test_a_full_copy_newer_than_the_checkpoint_is_used_when_no_one_survives",
        "test_with_spares_only_the_failed_rank_takes_one",
        "test_no_reform_restarts_every_worker",
    ),
    "test_own_group.py": (
        "test_a_kill_is_survived_in_the_loop_whatever_way_the_script_made_its_group[url",
        "test_a_kill_is_survived_in_the_loop_whatever_way_the_script_made_its_group[store",
        "test_a_kill_is_survived_in_the_loop_whatever_way_the_script_made_its_group[env-after",
        "test_a_stopped_rank_is_replaced",
        "test_a_killed_launcher_leaves_no_worker",
        "test_two_kills[wait]",
    ),
    "test_shrink.py": (
        "test_own_data_with_wait_for_replacement_ends_bitwise",
        "test_own_data_survives_a_death_in_every_phase_of_a_step[backward]",
        "test_own_data_survives_a_death_in_every_phase_of_a_step[before_optimizer]",
        "test_own_data_survives_a_stop_then_a_kill",
        "test_shrink_then_grow_keeps_the_global_batch[light]",
    ),
    "test_in_loop.py": ("test_fsdp2_survivors_keep_their_shards_in_their_loop[wait-for-replacement]",),
    "test_warm_spares.py": (
        "test_with_wait_for_replacement_a_warm_spare_ends_bitwise",
        "test_a_warm_spare_given_another_rank_than_it_read_says_so",
        "test_a_spare_killed_while_parked_is_replaced_by_a_new_one",
        "test_two_ranks_lost_at_once_with_one_warm_spare",
        "test_a_warm_spare_with_sharded_state_given_another_rank_runs_its_set_up_again",
        "test_a_warm_spare_killed_while_joining_is_a_failure_like_any_other",
    ),
    "test_hang.py": (
        "test_hung_rank_is_detected_killed_and_the_job_ends_bitwise_identical[sleep]",
        "test_hung_rank_is_detected_killed_and_the_job_ends_bitwise_identical[deadlock]",
        "test_a_long_stretch_marked_busy_is_not_a_hang",
        "test_a_stopped_survivor_is_killed_at_once_in_any_phase[kill@rank=0,step=8;",
    ),
    # The quick tier's longest (409 s for 501 tests at f3f32f5, 2026-11-28); each kind keeps a quicker scenario there.
    "test_reshard.py": (
        "test_the_reshard_bench_loads_every_byte_at_another_world_size",
        "test_fsdp2_state_of_4_ranks_reshards_from_node_memory_at_2_then_at_3",
    ),
    "test_chaos.py": (
        "test_your_own_scenario_file_with_time_and_poisson_faults",
        "test_a_scenario_that_fails_verification_exits_1",
    ),
    "test_bench_recovery.py": ("test_a_killed_rank_0_is_measured_from_its_survivor_rank_1",),
    "test_group.py": ("test_survivors_absorb_a_peers_death_and_reform_in_their_loop",),
    "test_straggler.py": (
        "test_a_clean_run_under_stalwart_run_flags_nobody",
        "test_an_evicted_straggler_is_replaced_and_the_run_ends_as_without_it",
    ),
    "test_preemption.py": ("test_sigterm_saves_at_an_agreed_step_and_the_next_launch_resumes_there",),
    "test_preflight.py": ("test_stalwart_run_checks_the_node_first_and_a_failing_one_never_joins",),
    "test_zygote.py": (
        "test_when_the_zygote_dies_workers_restart_as_new_interpreters",
        "test_same_result_with_and_without_the_zygote",
    ),
    # The bench checkpoint's case is quick since its measurements are forks (5.5 s in fc32, 2026-11-29); the demo's
    # took 14-20 s, the zygote's two runs 18-19 s, the straggler's eviction 18-22 s, the HTML page 13-25 s: the
    # quick tier was 257 s of pytest for 503 tests.
    "test_leftovers.py": (
        "test_sigkill_of_bench_recovery_in_its_torchrun_phase_leaves_nothing",
        "test_sigkill_of_the_demo_leaves_nothing",
    ),
    "test_goodput.py": (
        "test_the_html_page_is_one_self_contained_file",
        "test_the_report_counts_from_the_last_step_done_not_the_last_logged",
    ),
    # The quick tier took 303 s of pytest for 512 tests (2026-11-29, eleventh session): a scenario run twice to see it
    # fail verification (27 s), the second FSDP2 mode and the second snapshot mode of a grow (10-15 s each) go.
}


LONGEST = {
    "test_chaos.py::test_the_quick_suite_recovers_from_every_fault_type_bitwise": 130,
    "test_warm_spares.py::test_a_warm_spare_with_sharded_state_given_another_rank_runs_its_set_up_again": 45,
    "test_demo.py::test_demo_recovers_and_ends_bitwise_identical": 40,
    "test_bench_checkpoint.py::test_small_run_reports_every_system_as_one_json_object": 35,
    "test_chaos.py::test_your_own_scenario_file_with_time_and_poisson_faults": 35,
    "test_warm_spares.py::test_a_spare_killed_while_parked_is_replaced_by_a_new_one": 35,
    "test_warm_spares.py::test_with_wait_for_replacement_a_warm_spare_ends_bitwise": 34,
    "test_multinode.py::test_a_lost_node_shrinks_the_sharded_job_in_place_and_a_new_one_grows_it_back": 33,
    "test_launcher.py::test_same_script_under_torchrun_and_as_one_process": 30,
    "test_warm_spares.py::test_a_warm_spare_killed_while_joining_is_a_failure_like_any_other": 35,
}
"""The longest tests and their seconds in a full run of three at a time (2-core VM, 2026-11-29). Each worker starts
with some of them (`_longest_first`): one left for the end ran alone while the other workers sat idle (the last 50 s
of a 634 s run, the CPUs 60% idle then)."""

WORKERS = 4
"""scripts/test.sh's `-n`: how many workers xdist's worksteal scheduling splits the collection among."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path, _, name = item.nodeid.partition("::")
        module = path.rsplit("/", 1)[-1]
        if module in SLOW_MODULES or name.startswith(SLOW_TESTS.get(module, ("\0",))):
            item.add_marker(pytest.mark.slow)
    items[:] = _longest_first(items, WORKERS)


def _longest_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """The order with each worker's share (xdist's worksteal hands worker i the i-th contiguous part of it) starting
    with some of the LONGEST tests, balanced by their seconds; everything else keeps the collection's order. Putting
    every slow test first was tried and made the suite slower (871 s against 792 s), the long multi-process tests then
    all competing for the two cores; this moves only the longest few."""
    long_ids = {item.nodeid.split("/", 1)[-1]: item for item in items}
    longest = sorted((i for i in LONGEST if i in long_ids), key=lambda i: -LONGEST[i])
    if not longest:
        return items
    sizes, left = [], len(items)
    for k in range(workers):  # as worksteal's first distribution: remaining // nodes remaining
        sizes.append(left // (workers - k))
        left -= sizes[-1]
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0] * workers
    for i in longest:
        k = min(range(workers), key=lambda k: (load[k], len(heads[k])))
        if len(heads[k]) < sizes[k]:
            heads[k].append(long_ids[i])
            load[k] += LONGEST[i]
    placed = {id(item) for head in heads for item in head}
    rest = [item for item in items if id(item) not in placed]
    order: list[pytest.Item] = []
    for k in range(workers):
        take = sizes[k] - len(heads[k])
        order += heads[k] + rest[:take]
        rest = rest[take:]
    return order + rest


def run_forked_ranks(
    target: Callable[..., None], tmp_path: Path, *extra: Any, world: int = 2, timeout: float = 60
) -> None:
    """`target(rank, store_path, *extra)` in `world` processes forked from this one (a FileStore at `store_path` for
    their group): a test of collectives between real processes. Fails with every rank's traceback; a rank still
    running after `timeout` is killed."""
    context = multiprocessing.get_context("fork")
    store = str(tmp_path / "store")
    procs = [
        context.Process(target=_traced, args=(target, r, store, str(tmp_path / f"error{r}"), *extra), daemon=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = "\n".join(f.read_text() for f in sorted(tmp_path.glob("error*")))
    assert [p.exitcode for p in procs] == [0] * world, errors


def _traced(target: Callable[..., None], rank: int, store: str, errors: str, *extra: Any) -> None:
    try:
        target(rank, store, *extra)
    except BaseException:
        Path(errors).write_text(traceback.format_exc())
        raise
