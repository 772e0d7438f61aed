"""runtime/process.fork_module: `python -m MODULE ARGS...` as a fork of a one-thread process (what the reshard
bench starts its ranks with): its own environment, output files and exit status, atexit handlers of its own
only; and None, for a new interpreter instead, where the process runs another thread."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from conftest import served_python

MODULE = textwrap.dedent(
    """
    import atexit, os, signal, sys
    atexit.register(lambda: print("child's atexit ran", flush=True))
    print("argv", sys.argv[1:], "mark", os.environ.get("MARK"), flush=True)
    print("cwd", os.getcwd(), "sigterm default", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(sys.argv[1]))
    """
)

DRIVER = textwrap.dedent(
    """
    import atexit, json, signal, sys, threading
    from pathlib import Path
    from stalwart.runtime.process import fork_module, single_threaded, start_module

    work = Path(sys.argv[1])
    sys.path.insert(0, str(work))
    atexit.register(lambda: print("parent's atexit ran", flush=True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the parent's own handler (a bench's), not the child's
    seen = {"single": single_threaded()}
    child = fork_module("forkme", ["3"], env={"MARK": "set"}, out=work / "out.log", err=work / "err.log")
    seen["code"] = child.wait(60)
    (work / "elsewhere").mkdir()
    zero = fork_module("forkme", ["0"], env={}, out=work / "zero.log", cwd=work / "elsewhere")
    seen["zero"] = zero.wait(60)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    seen["with_a_thread"] = fork_module("forkme", ["0"], env={}, out=work / "never.log") is None
    spawned = start_module("forkme", ["4"], env={"MARK": "new"}, out=work / "spawned.log", cwd=work)
    seen["spawned"] = [type(spawned).__name__, spawned.wait(60)]
    stop.set()
    thread.join()
    print(json.dumps(seen), flush=True)
    """
)


def test_a_forked_module_has_its_own_environment_output_and_exit_status(tmp_path: Path) -> None:
    (tmp_path / "forkme.py").write_text(MODULE)
    done = served_python(DRIVER, str(tmp_path), cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert seen == {"single": True, "code": 3, "zero": 0, "with_a_thread": True, "spawned": ["Popen", 4]}, seen
    spawned = (tmp_path / "spawned.log").read_text()  # start_module's new interpreter, where a fork cannot be
    assert "argv ['4'] mark new" in spawned and f"cwd {tmp_path} " in spawned and "to stderr" in spawned, spawned
    out = (tmp_path / "out.log").read_text()
    assert "argv ['3'] mark set" in out and "child's atexit ran" in out and "parent's atexit" not in out, out
    assert (tmp_path / "err.log").read_text() == "to stderr\n"
    assert f"cwd {tmp_path} sigterm default True" in out, out
    zero = (tmp_path / "zero.log").read_text()
    assert "to stderr" in zero, "stderr to `out` when no `err`"
    assert f"cwd {tmp_path / 'elsewhere'} " in zero, zero
    assert not (tmp_path / "never.log").exists()
