"""The persister a worker host forks ahead (checkpoint/save/forked.py): a job's first persister is that fork, runs
in the job's working directory, holds none of the host's file descriptors, and is named; a
process forked from the host later cannot take it; an unclaimed one ends with its host."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from conftest import child_env, served_script

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
    marker = socket.socket()  # a connection of the host's: the persister must not hold it
    marker.bind(("127.0.0.1", 0))
    marker.listen()
    os.set_inheritable(marker.fileno(), True)
    assert forked.prefork()
    assert not forked.prefork(), "one at a time"
    ahead = forked._ahead
    child = os.fork()  # a process forked from the host later (a DataLoader worker): it has no claim
    if child == 0:
        os._exit(0 if forked.claim({"path": None, "common": {}}) is None else 1)
    _, status = os.waitpid(child, 0)
    os.chdir(work)  # after the fork: the persister must write where the job is
    ck = Checkpointer.standalone("ckpt", events=EventLog(work / "events.jsonl"), token="t", keep_last=3)
    assert ck.save(1, {"objects": {"w": {"weight": torch.ones(64)}}}, wait=True)
    pid = ahead.pid
    fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    committed = [e for e in read_events(work / "events.jsonl") if e["event"] == "checkpoint_committed"]
    seen = {
        "pid": pid,
        "committed_by": [e["pid"] for e in committed],
        "comm": Path(f"/proc/{pid}/comm").read_text().strip(),
        "cwd": os.readlink(f"/proc/{pid}/cwd"),
        "holds_marker": os.readlink(f"/proc/self/fd/{marker.fileno()}") in fds.values(),
        "fds": sorted(fds),
        "forked_child_claimed": os.waitstatus_to_exitcode(status) != 0,
        "committed": sorted(p.name for p in (work / "ckpt").iterdir()),
    }
    ck.close()  # tells the persister to quit and waits for it
    seen["ended_on_close"] = ahead.poll() is not None
    assert forked.claim({"path": None, "common": {}}) is None, "taken once"
    print(json.dumps(seen))
    """
)

UNCLAIMED = textwrap.dedent(
    """
    import os, sys
    from stalwart.checkpoint.save import forked

    assert forked.prefork()
    print(forked._ahead.pid, flush=True)
    os._exit(0)  # the host ends without a job: its persister reads the end of its pipe and ends too
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


def test_the_first_persister_is_the_fork_in_the_jobs_directory_holding_none_of_the_hosts_descriptors(
    tmp_path: Path,
) -> None:
    seen = json.loads(_run(tmp_path, SCRIPT, "host").strip().splitlines()[-1])
    assert seen["committed_by"] == [seen["pid"]], "the save was persisted by the forked persister"
    assert seen["comm"] == "stalwart-persis"  # 15 bytes of "stalwart-persist"
    # The job's working directory, taken at the claim (with its environment: /proc shows only an environment set
    # at exec): the relative checkpoint directory is the job's.
    assert seen["cwd"] == str(tmp_path)
    assert not seen["holds_marker"] and not seen["forked_child_claimed"]
    assert "step_00000001" in seen["committed"]
    assert seen["ended_on_close"]


def test_an_unclaimed_persister_ends_with_its_host(tmp_path: Path) -> None:
    import time

    pid = int(_run(tmp_path, UNCLAIMED, "bare").split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":  # ended, waiting for whoever adopted it to reap it
            return
        time.sleep(0.05)
    raise AssertionError(f"persister {pid} outlived its host: {os.popen(f'ps -o pid,stat,cmd -p {pid}').read()}")
