"""A TCP front door for a test server, which the tests can cut as an outage cuts a store off.

Why: stopping moto's in-process server is no outage. Its listening socket closes, but the handler threads of open
keep-alive connections live on in the test's process, and a client that had one either got answers or waited out
botocore's 60 s read timeout: the S3 failover test flaked on it. A store whose process or host dies refuses new
connections and breaks the open ones at once; `Front.cut()` does exactly that, while the server behind it (and
the buckets moto keeps in its memory) stays up for a new front on the same port.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

_POLL_S = 0.1


class Front:
    """Forwards every connection made to `port` (loopback; 0: one the OS chooses) to the server on `target_port`,
    until cut."""

    def __init__(self, target_port: int, port: int = 0) -> None:
        self._target = target_port
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        listener.settimeout(_POLL_S)  # accept() wakes to see the front cut: closing does not wake it on Linux
        self.port: int = listener.getsockname()[1]
        self._listener: socket.socket | None = listener
        threading.Thread(target=self._accept, args=(listener,), name="front-accept", daemon=True).start()

    def cut(self) -> None:
        """The outage: new connections are refused and every open one is reset, on both sides."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            cut, self._open = self._open, set()
        for sock in cut:
            _reset(sock)

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    _reset(client)
                    _reset(upstream)
                    continue
                self._open |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), name="front-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """One direction of a connection; either side's end or error ends both."""
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._open -= {src, dst}
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with an RST, as a dead peer's kernel answers; shutdown first wakes a thread blocked in recv()."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
