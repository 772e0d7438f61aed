"""A survivor that does not leave its failed group in time is replaced, and its stack is in the output first
(supervisor/stack_dump.py): what held it is what needs fixing, and it would be lost with the process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stalwart.supervisor.host_pool import REARM_TIMEOUT_S

SCRIPT = Path(__file__).parent / "scripts" / "stuck_survivor.py"


def test_a_stuck_survivor_shows_where_it_was_stuck_and_is_replaced(launch: Any) -> None:
    job = launch(["--nproc-per-node", "2", "--max-restarts", "2", str(SCRIPT)])
    assert job.wait(120) == 0, job.output()
    out = job.output()
    (rearmed,) = job.events("survivors_rearmed")
    assert rearmed["stuck"] == [0] and rearmed["local_ranks"] == [], rearmed
    assert rearmed["seconds"] >= REARM_TIMEOUT_S, rearmed
    # faulthandler's dump, from the stuck rank: the script's own frame names where.
    dump = out[out.index("most recent call first") :]
    assert "in stuck_in_a_wait_nothing_reaches" in dump, out
    assert f"local rank 0 did not leave the failed group in {REARM_TIMEOUT_S:.0f} s; replaced" in out, out
    assert "rank 0 done" in out and "rank 1 done" in out, out
