"""Hosts built from network namespaces: two "machines" with their own addresses on this one, and a cable between
them that can be cut.

Why: a network partition is a fault of the network, not of a process; to inject one for real, the job's nodes
must talk over an interface the harness can take down. Two namespaces joined by a veth pair are exactly that:
each node's launcher and workers run in their own namespace (`ip netns exec`), reach each other only through the
pair, and `ip link set down` on one end cuts them apart (in-flight TCP retransmits until the link is back).
Needs root and iproute2; the namespaces live only as long as the `Hosts` context, and their addresses (a private
/24) are seen by nothing outside them.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType

from stalwart.errors import ConfigError

SUBNET = "10.231.79"
_COUNTER = iter(range(1_000_000))
_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class NetHost:
    namespace: str
    device: str
    address: str

    def prefix(self) -> list[str]:
        """What runs a command on this host."""
        return ["ip", "netns", "exec", self.namespace]


@functools.cache
def available() -> str | None:
    """Why hosts cannot be built here (None: they can). Root and `ip` are not enough in a container without
    CAP_NET_ADMIN or CAP_SYS_ADMIN, so a namespace is made and deleted to find out (once per process)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (the ip command)"
    probe = f"stwprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot create network namespaces here ({made.stderr.strip() or made.returncode})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Hosts:
    """Hosts for a `with` block: `hosts[i]`, `cut(i)`, `mend(i)`, `throttle(i, mbit)`. Two are joined by a veth
    pair; more by a bridge in a namespace of its own (a switch), each host on its own port."""

    def __init__(self, count: int = 2) -> None:
        if not 2 <= count <= 200:
            raise ValueError(f"from 2 to 200 hosts, got {count}")
        with _LOCK:
            tag = f"stw{os.getpid() % 100000}c{next(_COUNTER)}"
        self._hosts = [NetHost(f"{tag}h{i}", f"{tag}v{i}", f"{SUBNET}.{i + 1}") for i in range(count)]
        self._switch = f"{tag}sw" if count > 2 else None
        self._ports = [f"{tag}s{i}" for i in range(count)]  # the switch's end of each host's cable
        self._made: list[str] = []

    def __enter__(self) -> Hosts:
        why = available()
        if why is not None:
            raise ConfigError(f"a run on two hosts (network namespaces) cannot be built here: {why}")
        try:
            for namespace in [h.namespace for h in self._hosts] + ([self._switch] if self._switch else []):
                _ip("netns", "add", namespace)
                self._made.append(namespace)
            if self._switch is None:
                _ip("link", "add", self._hosts[0].device, "type", "veth", "peer", "name", self._hosts[1].device)
            else:
                _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
                _ip("-n", self._switch, "link", "set", "br0", "up")
                for host, port in zip(self._hosts, self._ports, strict=True):
                    _ip("link", "add", host.device, "type", "veth", "peer", "name", port)
                    _ip("link", "set", port, "netns", self._switch)
                    _ip("-n", self._switch, "link", "set", port, "master", "br0")
                    _ip("-n", self._switch, "link", "set", port, "up")
            for host in self._hosts:
                _ip("link", "set", host.device, "netns", host.namespace)
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
                _ip("-n", host.namespace, "link", "set", host.device, "up")
                _ip("-n", host.namespace, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.close()
            raise ConfigError(f"cannot create network namespaces: {(exc.stderr or b'').decode().strip()}") from exc
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __getitem__(self, index: int) -> NetHost:
        return self._hosts[index]

    def __len__(self) -> int:
        return len(self._hosts)

    def __iter__(self) -> Iterator[NetHost]:
        return iter(self._hosts)

    def cut(self, index: int) -> None:
        """Take host `index`'s end of the cable down: it can reach no other host, nor they it."""
        host = self._hosts[index]
        _ip("-n", host.namespace, "link", "set", host.device, "down")

    def mend(self, index: int) -> None:
        host = self._hosts[index]
        _ip("-n", host.namespace, "link", "set", host.device, "up")

    def throttle(self, index: int, mbit: float) -> None:
        """Limit host `index`'s cable to `mbit` megabits per second both ways (a degraded NIC or port); needs tc."""
        host = self._hosts[index]
        if self._switch is not None:
            ends = [(host.namespace, host.device), (self._switch, self._ports[index])]
        else:
            other = self._hosts[1 - index]
            ends = [(host.namespace, host.device), (other.namespace, other.device)]
        for namespace, device in ends:
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    namespace,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    device,
                    "root",
                    "tbf",
                    "rate",
                    f"{mbit}mbit",
                    "burst",
                    "64kb",
                    "latency",
                    "200ms",
                ],
                check=True,
                capture_output=True,
                timeout=30,
            )

    def close(self) -> None:
        """Delete the namespaces (the veth pair goes with them). Processes still inside keep theirs until they end;
        the harness ends them first."""
        for namespace in self._made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        self._made.clear()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)
