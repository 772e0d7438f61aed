"""The node exclusion list: nodes taken out of service, with the reason, kept across launches.

Why: a node whose GPU fell off the bus or failed to remap a row would take the job down again at every restart.
When the agent's GPU playbook (detect/gpu.py) says a node must be drained, reset or repaired, the agent writes
the node here and stops its workers; `stalwart run` on a listed node refuses to start (one line, the reason),
so the next rendezvous forms without it. A person clears an entry once the node is fixed:
`stalwart nodes clear` on that node (`stalwart nodes list` shows the list).

The file is JSON, `{"nodes": {HOST: {"reason", "action", "time"}}}`, at STALWART_EXCLUDE_FILE (default
~/.stalwart/excluded-nodes.json; point every node at a shared path to keep one list for a cluster). It is
replaced atomically (a temporary file renamed over it).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.errors import ConfigError
from stalwart.runtime.env import EXCLUDE_FILE_ENV, NODE_NAME_ENV


@dataclass(frozen=True, slots=True)
class Exclusion:
    host: str
    reason: str
    action: str
    time: str


def exclusion_file() -> Path:
    return Path(os.environ.get(EXCLUDE_FILE_ENV) or Path.home() / ".stalwart" / "excluded-nodes.json")


def this_host() -> str:
    """This node's name: STALWART_NODE_NAME (a Kubernetes pod's node), else the host name."""
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


def scheduler_commands(e: Exclusion) -> list[str]:
    """What takes the node out of the scheduler's pool too, so that no new job lands on it: the suggestion the
    list prints (stalwart changes nothing outside its own list)."""
    reason = f"stalwart: {e.reason}"[:200].replace('"', "'")
    return [
        f'scontrol update NodeName={e.host} State=DRAIN Reason="{reason}"',
        f"kubectl cordon {e.host}",
        f"kubectl taint nodes {e.host} stalwart.dev/excluded={e.action}:NoSchedule",
    ]


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the node exclusion list {path}: {exc}") from exc
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, dict):
        raise ConfigError(f'the node exclusion list {path} is not stalwart\'s (no "nodes" object)')
    return nodes


def listed(path: Path | None = None) -> list[Exclusion]:
    """Every entry, by host."""
    nodes = _read(path or exclusion_file())
    return [_entry(host, e) for host, e in sorted(nodes.items()) if isinstance(e, dict)]


def _entry(host: str, e: dict[str, Any]) -> Exclusion:
    return Exclusion(host, str(e.get("reason", "")), str(e.get("action", "")), str(e.get("time", "")))


def excluded(host: str | None = None, path: Path | None = None) -> Exclusion | None:
    """This host's entry in the exclusion list, or None."""
    entry = _read(path or exclusion_file()).get(host or this_host())
    return _entry(host or this_host(), entry) if isinstance(entry, dict) else None


def exclude(reason: str, action: str, host: str | None = None, path: Path | None = None) -> Exclusion:
    """Add (or replace) this host's entry."""
    path = path or exclusion_file()
    nodes = _read(path)
    entry = Exclusion(host or this_host(), reason, action, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    nodes[entry.host] = {"reason": entry.reason, "action": entry.action, "time": entry.time}
    _write(path, nodes)
    return entry


def clear(host: str | None = None, path: Path | None = None) -> bool:
    """Remove this host's entry; whether there was one."""
    path = path or exclusion_file()
    nodes = _read(path)
    if nodes.pop(host or this_host(), None) is None:
        return False
    _write(path, nodes)
    return True


def _write(path: Path, nodes: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"nodes": nodes}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
