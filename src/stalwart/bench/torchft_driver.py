"""Runs the bench job under torchft: a lighthouse and two replica groups (torchft_job.py), each restarted by this
driver when it dies, as torchft expects an outside scheduler to do. Exits 0 once both replicas finished.

`python -m stalwart.bench.torchft_driver --out DIR --steps N` (the bench starts it like a launcher).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stalwart.runtime.process import spawn

REPLICAS = 2
MAX_RESTARTS = 100
POLL_S = 0.01


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--until", type=float, help="stop the replicas and exit 0 at this time.time()")
    p.add_argument("--setup-s", type=float, default=0.0, help="as recovery_job.py's")
    p.add_argument("--width", type=int, default=1152, help="as recovery_job.py's")
    args = p.parse_args()
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=10)
    # It listens on loopback only; its address() names the host, which may resolve to another interface.
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    env = {"RUST_LOG": "warn", **os.environ, "TORCHFT_LIGHTHOUSE": address}
    restarts = [0] * REPLICAS

    def start(replica: int) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "stalwart.bench.torchft_job",
            "--out",
            str(args.out),
            "--steps",
            str(args.steps),
            "--replica",
            str(replica),
            "--restart",
            str(restarts[replica]),
            "--setup-s",
            str(args.setup_s),
            "--width",
            str(args.width),
        ]
        return spawn(cmd, env=env, death_signal=signal.SIGKILL)  # replicas die with this driver

    procs = [start(r) for r in range(REPLICAS)]
    done = [False] * REPLICAS
    try:
        while not all(done):
            time.sleep(POLL_S)
            if args.until is not None and time.time() > args.until:
                break
            for r, proc in enumerate(procs):
                code = proc.poll()
                if code is None or done[r]:
                    continue
                if code == 0:
                    done[r] = True
                elif restarts[r] < MAX_RESTARTS:
                    restarts[r] += 1
                    procs[r] = start(r)
                else:
                    sys.exit(1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
