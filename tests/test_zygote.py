"""Worker hosts forked from the zygote (supervisor/zygote.py) behave as hosts started as new interpreters: exit
codes come back, each is its own session with its own random state, and a run ends exactly as without it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from conftest import alive, child_env, tiny_args

# Runs in its own process: Zygote.start() forks the caller, which must have a single thread (pytest-xdist's
# workers have several).
DRIVER = textwrap.dedent(
    """
    import json, os, sys, time
    from stalwart.supervisor.host_protocol import Activation
    from stalwart.supervisor.zygote import Zygote

    zygote = Zygote.start()
    assert zygote is not None
    report = {"zygote": zygote.pid, "hosts": []}
    for code in (0, 3):
        proc, status = zygote.fork_host(warm=False)
        script = sys.argv[1]
        env = {**os.environ, "EXIT_WITH": str(code)}
        proc.stdin.write(Activation([script], env).encode())
        proc.stdin.flush()
        report["hosts"].append({"pid": proc.pid, "code": proc.wait(60)})
    report["zygote_comm"] = open(f"/proc/{zygote.pid}/comm").read().strip()  # named before its first fork
    print(json.dumps(report))
    """
)
SCRIPT = textwrap.dedent(
    """
    import json, os, random, sys
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "random": random.random(),
                      "torch_loaded": "torch._dynamo" in sys.modules,
                      "comm": open("/proc/self/comm").read().strip()}), flush=True)
    sys.exit(int(os.environ["EXIT_WITH"]))
    """
)


def test_forked_hosts_report_exit_codes_and_are_fresh_processes(tmp_path: Path) -> None:
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "script.py").write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "script.py")],
        capture_output=True, text=True, timeout=120, env=child_env(), cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    hosts, report = lines[:2], lines[2]
    assert [h["code"] for h in report["hosts"]] == [0, 3], "the zygote reports each host's exit code"
    assert [h["pid"] for h in hosts] == [h["pid"] for h in report["hosts"]]
    for host in hosts:
        assert host["ppid"] == report["zygote"], "a host is the zygote's child"
        assert host["sid"] == host["pid"], "in its own session, as torch elastic starts workers"
        assert host["torch_loaded"], "forked after the zygote imported the training side"
        assert host["comm"] == Path(sys.executable).name[:15], "named as an interpreter started for it"
    assert report["zygote_comm"] == "stalwart-zygote"
    assert hosts[0]["random"] != hosts[1]["random"], "each fork reseeds Python's generator"


def test_the_cuda_driver_is_recognised_in_a_process_map() -> None:
    # The zygote forks nothing when this says the driver is loaded (its children could not use the GPU).
    from stalwart.supervisor.zygote import cuda_driver_loaded

    lib = "7f2a1c000000-7f2a1c200000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"
    torch = "7f2a1c000000-7f2a1c200000 r-xp 00000000 08:01 1234 /venv/lib/torch/lib/libtorch_cpu.so"
    assert cuda_driver_loaded(f"{torch}\n{lib}\n")
    assert not cuda_driver_loaded(f"{torch}\n")


def _zygote_of(launcher: int) -> int | None:
    """The launcher's child that is the parent of a worker host."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == launcher and "worker_host" not in Path(stat.parent, "cmdline").read_text():
                return int(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def test_when_the_zygote_dies_workers_restart_as_new_interpreters(launch: Any, tmp_path: Path) -> None:
    # Held in step 7 until the zygote was killed (train_tiny --hold-at): no race with the job's end.
    args = tiny_args("--steps", "20", "--step-sleep", "0.05", "--every", "5", "--hold-at", "7", "--hold-file", "go")
    job = launch(args)
    job.wait_for(lambda: len(job.events("step_done")) >= 6, 120, "first steps")
    zygote = _zygote_of(job.proc.pid)
    assert zygote is not None
    os.kill(zygote, signal.SIGKILL)
    (job.workdir / "go").touch()
    assert job.wait(180) == 0, job.output()
    assert job.events("restarting"), "the workers died with the zygote and were restarted"
    spawned = job.events("worker_spawned")
    assert all(e["forked"] for e in spawned if e["restart"] == 0)
    assert all(not e["forked"] for e in spawned if e["restart"] >= 1), "no zygote: new interpreters"
    # The reference without the zygote at all (STALWART_ZYGOTE=0: every worker a new interpreter from the start):
    # a forked run that went on in new interpreters and a run that never forked end the same.
    reference = launch(tiny_args("--steps", "20", "--every", "5"), name="reference", env=child_env(STALWART_ZYGOTE="0"))
    assert reference.wait(120) == 0, reference.output()
    assert not any(e["forked"] for e in reference.events("worker_spawned")), "no worker of the reference forked"
    assert job.results()[0]["sha256"] == reference.results()[0]["sha256"]
    assert job.results()[1]["seen"] == reference.results()[1]["seen"]


def test_the_zygote_waits_for_no_one_when_the_launcher_is_killed(launch: Any) -> None:
    job = launch(tiny_args("--steps", "100000", "--step-sleep", "0.05", "--every", "1000"))
    job.wait_for(lambda: len(job.events("step_done")) >= 4, 120, "first steps")
    zygote = _zygote_of(job.proc.pid)
    workers = [e["worker_pid"] for e in job.events("worker_spawned")]
    assert zygote is not None and workers
    made = {p.name.split("-")[1] for p in Path("/dev/shm").glob(f"stalwart-*-{job.proc.pid}-*")}
    assert made == {"heartbeat", "snapshots"}, made
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait()
    end = time.monotonic() + 10
    while time.monotonic() < end and any(alive(p) for p in [zygote, *workers]):
        time.sleep(0.1)
    assert not any(alive(p) for p in [zygote, *workers]), "the zygote and its hosts die with the launcher"
    # What the next launcher does at its start: the killed one's heartbeat board and memory tier go from /dev/shm
    # (the test leaves nothing behind either).
    from stalwart.supervisor.leftovers import _remove_stale_log_dirs, _remove_stale_shared_memory

    _remove_stale_log_dirs()
    ours = [p.name for p in _remove_stale_shared_memory() if f"-{job.proc.pid}-" in p.name]
    # Another test's launcher, starting meanwhile in a parallel worker, removes them just as well (it did once in a
    # fresh-clone suite): what must hold is that they were the board and the memory tier (`made`), and are gone.
    assert {n.split("-")[1] for n in ours} <= {"heartbeat", "snapshots"}, ours
    assert not list(Path("/dev/shm").glob(f"stalwart-*-{job.proc.pid}-*")), "a killed launcher's files stayed"
