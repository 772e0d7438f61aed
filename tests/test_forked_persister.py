"""Persisters forked by their process's forker (checkpoint/save/forked.py): a worker host forks its forker ahead,
each job's persister is a fork of it in the job's directory holding none of the host's file descriptors, named; a
process forked from the host later does not use it; a process with threads starts its forker as an interpreter and
keeps it; a forker ends with its host, and its persisters with it."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

from conftest import child_env, served_script
from stalwart.runtime.process import process_state

# Run as a script forked from the tests' launch server: one thread, torch imported, as a worker host is when it
# forks ahead. It prints one JSON line of what it saw.
SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys, time
    from pathlib import Path

    import torch

    from stalwart.checkpoint import Checkpointer
    from stalwart.checkpoint.save import forked
    from stalwart.telemetry.events import EventLog, read_events

    work = Path(sys.argv[1])
    marker = socket.socket()  # a connection of the host's: neither the forker nor a persister may hold it
    marker.bind(("127.0.0.1", 0))
    marker.listen()
    os.set_inheritable(marker.fileno(), True)
    assert forked.prefork()
    assert not forked.prefork(), "one at a time"
    forker = forked._forker.proc.pid
    child = os.fork()  # a process forked from the host later (a DataLoader worker): the forker is not its own
    if child == 0:
        os._exit(0 if forked._current() is None else 1)
    _, status = os.waitpid(child, 0)
    os.chdir(work)  # after the fork: the persister must write where the job is
    marker_path = os.readlink(f"/proc/self/fd/{marker.fileno()}")

    def held(pid):
        return sorted(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))

    def parent(pid):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    def comm(pid, deadline=time.monotonic() + 20):  # the forker names itself once it runs: not at once under load
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        while name != "stalwart-forker" and time.monotonic() < deadline:
            time.sleep(0.01)
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        return name

    seen = {"forker": forker, "forker_comm": comm(forker),
            "forker_holds_marker": marker_path in held(forker), "jobs": []}
    for step in (1, 2):  # two jobs one after the other, as a survivor's script run again
        ck = Checkpointer.standalone(f"ckpt{step}", events=EventLog(work / "events.jsonl"), token="t", keep_last=3)
        assert ck.save(step, {"objects": {"w": {"weight": torch.ones(64)}}}, wait=True)
        proc = ck._bg._proc
        pid = proc.pid
        seen["jobs"].append({
            "pid": pid,
            "parent": parent(pid),
            "comm": Path(f"/proc/{pid}/comm").read_text().strip(),
            "cwd": os.readlink(f"/proc/{pid}/cwd"),
            "holds_marker": marker_path in held(pid),
            "committed": sorted(p.name for p in (work / f"ckpt{step}").iterdir()),
        })
        ck.close()  # tells the persister to quit and waits for it
        seen["jobs"][-1]["exit_code"] = proc.poll()
    events = read_events(work / "events.jsonl")
    seen["committed_by"] = [e["pid"] for e in events if e["event"] == "checkpoint_committed"]
    seen["forked_child_used_it"] = os.waitstatus_to_exitcode(status) != 0
    print(json.dumps(seen))
    """
)

UNCLAIMED = textwrap.dedent(
    """
    import os, sys
    from stalwart.checkpoint.save import forked

    assert forked.prefork()
    print(forked._forker.proc.pid, flush=True)
    os._exit(0)  # the host ends without a job: its forker reads the end of its socket and ends too
    """
)

# A process with a second thread (no fork of it is safe): its first persister's forker is a new interpreter, kept
# for the next job's. It prints the forker's and the last persister's pids, then waits to be killed.
THREADED = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path

    import torch

    from stalwart.checkpoint import Checkpointer
    from stalwart.checkpoint.save import forked
    from stalwart.telemetry.events import EventLog

    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    os.chdir(sys.argv[1])
    assert not forked.prefork(), "two threads: no fork"
    pids = []
    for step in (1, 2):
        ck = Checkpointer.standalone(f"ckpt{step}", events=EventLog(None), token="t", keep_last=3)
        assert ck.save(step, {"objects": {"w": {"weight": torch.ones(8)}}}, wait=True)
        pids.append(ck._bg._proc.pid)
        if step == 1:
            ck.close()
    forker = forked._forker.proc.pid
    cmdline = Path(f"/proc/{forker}/cmdline").read_bytes().split(b"\\0")
    print(forker, *pids, b"stalwart.checkpoint.save.forked" in cmdline, flush=True)
    time.sleep(600)
    """
)


def _run(tmp_path: Path, script: str, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    out = tmp_path / f"{name}.out"
    proc = served_script(path, [str(tmp_path)], child_env(), tmp_path, out)
    code = proc.wait(120)
    text = out.read_text()
    assert code == 0, text
    return text


def _ends(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_state(pid) in ("?", "Z"):  # gone, or ended and waiting for whoever adopted it to reap it
            return True
        time.sleep(0.05)
    return False


def test_each_jobs_persister_is_a_fork_of_the_hosts_forker_in_the_jobs_directory_holding_none_of_its_descriptors(
    tmp_path: Path,
) -> None:
    seen = json.loads(_run(tmp_path, SCRIPT, "host").strip().splitlines()[-1])
    assert seen["forker_comm"] == "stalwart-forker" and not seen["forker_holds_marker"]
    assert not seen["forked_child_used_it"]
    jobs = seen["jobs"]
    assert seen["committed_by"] == [job["pid"] for job in jobs], "each save persisted by its job's forked persister"
    assert len({job["pid"] for job in jobs}) == 2
    for job in jobs:
        assert job["parent"] == seen["forker"], "forked by the host's forker, not started as an interpreter"
        assert job["comm"] == "stalwart-persis"  # 15 bytes of "stalwart-persist"
        # The job's working directory, taken at each request (with its environment: /proc shows only an
        # environment set at exec): the relative checkpoint directory is the job's.
        assert job["cwd"] == str(tmp_path)
        assert not job["holds_marker"]
        assert job["exit_code"] == 0, "ended on close, its exit code as the forker reported it"
    assert "step_00000001" in jobs[0]["committed"] and "step_00000002" in jobs[1]["committed"]


def test_an_unused_forker_ends_with_its_host(tmp_path: Path) -> None:
    pid = int(_run(tmp_path, UNCLAIMED, "bare").split()[0])
    assert _ends(pid), f"forker {pid} outlived its host: {os.popen(f'ps -o pid,stat,cmd -p {pid}').read()}"


def test_a_process_with_threads_starts_one_forker_and_a_kill_ends_it_and_its_persister(tmp_path: Path) -> None:
    path = tmp_path / "threaded.py"
    path.write_text(THREADED)
    out = tmp_path / "threaded.out"
    proc = served_script(path, [str(tmp_path)], child_env(), tmp_path, out)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        forker, first, second, interpreter = out.read_text().split()
        assert interpreter == "True", "the forker of a process with threads is a new interpreter"
        assert first != second
        assert process_state(int(second)) not in ("?", "Z"), "the second job's persister runs"
        os.kill(proc.pid, signal.SIGKILL)
        assert _ends(int(forker)), "the forker ends with its process (its socket's other end closed)"
        assert _ends(int(second)), "and so does the persister it forked"
    finally:
        proc.kill()
        proc.wait(30)


def test_an_answer_to_an_older_request_is_passed_over() -> None:
    """A request that timed out may be answered later: the next request must take its own answer, not that one (a
    forker stands in here, on the other end of the socket)."""
    import socket
    import subprocess
    import threading

    from stalwart.checkpoint.save.forked import Forker
    from stalwart.runtime.process import Forked

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    alive = subprocess.Popen(["sleep", "60"])  # the forker's process, as far as the handle can tell

    def stand_in() -> None:
        data, fds, _, _ = socket.recv_fds(theirs, 1 << 20, 3)
        for fd in fds:
            os.close(fd)
        asked = json.loads(data)["id"]
        theirs.send(json.dumps({"started": 111, "id": asked - 1}).encode())  # the late answer to an older one
        theirs.send(json.dumps({"started": 222, "id": asked}).encode())

    threading.Thread(target=stand_in, daemon=True).start()
    fd = ours.detach()
    try:
        forker = Forker(fd, Forked(alive.pid))
        persister = forker.start({"path": None, "common": {}})
        assert persister is not None and persister.pid == 222
        for stream in (persister.stdin, persister.stdout):
            stream.close()
    finally:
        alive.kill()
        alive.wait()
        theirs.close()
        os.close(fd)
