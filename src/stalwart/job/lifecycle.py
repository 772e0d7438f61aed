"""Process-level safety nets a worker installs when it joins a job.

- Under `stalwart run`, a worker dies with its launcher (Linux parent-death signal), so a launcher killed even
  with SIGKILL leaves no orphaned workers holding ports and GPU memory.
- A user error (bad path, foreign or mismatched checkpoint) ends the process with one line on stderr and
  EXIT_USER_ERROR, which tells `stalwart run` not to spend its restarts on it.
- Under `stalwart run`, a collective that fails because a peer died prints one line instead of a traceback:
  the launcher reports the root cause and restarts the group, so the survivor's traceback is only noise.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

from stalwart.errors import EXIT_PEER_LOST, EXIT_USER_ERROR, PeerError, is_user_error
from stalwart.runtime.env import AGENT_PID_ENV as AGENT_PID_ENV
from stalwart.runtime.env import ELASTIC_ENV as ELASTIC_ENV
from stalwart.runtime.process import die_with_parent, first_line
from stalwart.runtime.torch_compat import is_peer_failure

_installed = False


def install_worker_safety_nets() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    agent_pid = os.environ.get(AGENT_PID_ENV)
    _install_error_hook(under_agent=bool(agent_pid))
    if agent_pid and agent_pid.isdigit() and sys.platform == "linux":
        _die_with_agent(int(agent_pid))


def _install_error_hook(*, under_agent: bool) -> None:
    previous = sys.excepthook

    def hook(tp: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if is_user_error(exc):
            quiet = isinstance(exc, PeerError) or getattr(exc, "quiet", False)  # another rank prints it
            _exit_with_line(None if quiet else f"stalwart: error: {exc}", EXIT_USER_ERROR)
        if under_agent and is_peer_failure(exc):
            rank = os.environ.get("RANK", "?")
            line = f"stalwart: rank {rank}: a collective failed, a peer is likely gone: {first_line(exc)}"
            _exit_with_line(line, EXIT_PEER_LOST)
        previous(tp, exc, tb)

    sys.excepthook = hook


def _exit_with_line(line: str | None, status: int) -> None:
    # torch's init_process_group wraps sys.excepthook and swaps sys.stderr for a buffer it prints afterwards;
    # we exit before that, so write to the real stream.
    sys.stdout.flush()
    stream = sys.__stderr__ or sys.stderr
    if line:
        stream.write(line + "\n")
    stream.flush()
    os._exit(status)


def _die_with_agent(agent_pid: int) -> None:
    if os.getppid() != agent_pid:
        return  # started through a wrapper (--no-python, a shell): its parent is not the agent
    die_with_parent(parent=agent_pid)


def world_size_change_allowed(asked: bool | None) -> bool:
    """`allow_world_size_change` as given, or by default whether the job runs elastically (`stalwart run --nnodes
    MIN:MAX` with MIN < MAX sets ELASTIC_ENV)."""
    return asked if asked is not None else os.environ.get(ELASTIC_ENV) == "1"
