"""supervisor/launch_server.py: `stalwart run` forked from a server that imported it once (what `stalwart chaos`
launches with), in its own session and output, its exit status reported as Popen's."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import child_env, served_python
from stalwart.supervisor.launch_server import LaunchServer

SCRIPT = """
import os, sys, time
print("worker of", os.environ["STALWART_TEST_MARK"], flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.timeout(180)
def test_a_served_run_has_its_session_environment_and_appended_output(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "output.log"
    out.write_text("before\n")
    server = LaunchServer(child_env())
    try:
        env = child_env(STALWART_TEST_MARK="this run")
        run = ["run", "--nproc-per-node", "1", "--max-restarts", "0", str(script)]
        proc = server.start([*run, "3", "0"], env, tmp_path, out, append=True, session=True)
        deadline = time.monotonic() + 120
        while "worker of" not in out.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, out.read_text()
        assert os.getsid(proc.pid) == proc.pid, "a session of its own, as start_new_session gives"
        assert _parent(proc.pid) == server._proc.pid, "forked by the server, not a new interpreter of ours"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        assert proc.wait(timeout=120) == 0
        text = out.read_text()
        assert text.startswith("before\n") and "worker of this run" in text, text

        failed = server.start([*run, "0", "3"], env, tmp_path, tmp_path / "failed.log")
        assert failed.wait(timeout=120) == 1, (tmp_path / "failed.log").read_text()
    finally:
        server.close()


# A client of one thread (as `stalwart chaos` or `stalwart demo` when they start theirs): its server is a fork of it,
# holding none of its client's descriptors but its pipes and stderr. It prints one JSON line of what it saw.
FORKED_CLIENT = """
import json, os, socket, sys
from pathlib import Path

from stalwart.runtime.process import Forked
from stalwart.supervisor.launch_server import LaunchServer

work = Path(sys.argv[1])
env = json.loads(sys.argv[2])
marker = socket.socket()  # a connection of the client's: the server must not hold it
marker.bind(("127.0.0.1", 0))
marker.listen()
server = LaunchServer(env)
pid = server._proc.pid
seen = {
    "forked": isinstance(server._proc, Forked),
    "same_program": Path(f"/proc/{pid}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes(),
}
other = server.start(["ckpt", "list", str(work)], env, work, work / "other.log")
seen["other"] = [other.wait(timeout=120), (work / "other.log").read_text()]
held = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]  # serving by now
seen["holds_marker"] = os.readlink(f"/proc/self/fd/{marker.fileno()}") in held
run = server.start(["run", "--nproc-per-node", "1", "--max-restarts", "0", str(work / "job.py"), "0", "0"],
                   {**env, "STALWART_TEST_MARK": "a forked server"}, work, work / "run.log")
seen["run"] = [run.wait(timeout=120), (work / "run.log").read_text()]
server.close()
seen["closed"] = server._proc.poll()
print(json.dumps(seen))
"""


def test_a_client_of_one_thread_forks_its_server_which_runs_stalwart_run_only(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    done = served_python(FORKED_CLIENT, str(tmp_path), json.dumps(child_env()), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["forked"] and seen["same_program"], "a fork of its client, not a new interpreter"
    assert not seen["holds_marker"], "none of its client's descriptors but its pipes and stderr"
    code, text = seen["other"]
    assert code == 2 and text.count("\n") == 1, "any command but `stalwart run`: one line, status 2"
    code, text = seen["run"]
    assert code == 0 and "worker of a forked server" in text, text
    assert seen["closed"] == 0, "ended when its client closed it"


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


NETNS_SCRIPT = """
import os, socket, sys
print(os.readlink("/proc/self/ns/net"), socket.if_nameindex(), flush=True)
"""


def test_a_run_asked_into_a_network_namespace_runs_in_it(tmp_path: Path) -> None:
    """`netns`: the fork enters the namespace before it runs (as `ip netns exec` would, without a new interpreter);
    one that does not exist ends that run with a line that names it, and the server serves on."""
    from conftest import _launch_server
    from stalwart.chaos import netns
    from stalwart.supervisor.launch_server import split_netns

    assert split_netns(["ip", "netns", "exec", "h0", "python", "-m", "x"]) == ("h0", ["python", "-m", "x"])
    assert split_netns(["python", "-m", "x"]) == (None, ["python", "-m", "x"])
    script = tmp_path / "where.py"
    script.write_text(NETNS_SCRIPT)
    server = _launch_server()
    missing = server.start(["--script", str(script)], child_env(), tmp_path, tmp_path / "missing.log", netns="stw-none")
    assert missing.wait(timeout=60) != 0
    assert "no network namespace 'stw-none'" in (tmp_path / "missing.log").read_text()
    if netns.available() is not None:
        pytest.skip(f"network namespaces: {netns.available()}")
    with netns.Hosts() as hosts:
        host = hosts[0]
        proc = server.start(["--script", str(script)], child_env(), tmp_path, tmp_path / "in.log", netns=host.namespace)
        assert proc.wait(timeout=60) == 0, (tmp_path / "in.log").read_text()
    text = (tmp_path / "in.log").read_text()
    assert text.split()[0] != os.readlink("/proc/self/ns/net"), "another namespace than the server's"
    assert host.device in text, text  # the host's own interface, which only its namespace has
