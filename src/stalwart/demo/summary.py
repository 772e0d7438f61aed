"""What the demo measured, computed from the event logs and result files of the two runs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from stalwart.demo.runner import JobRun

TIER_NAMES = {
    "memory": "node memory",
    "peer": "a survivor's live state",
    "replica": "a peer node's copy",
    "durable": "durable checkpoint",
}
"""What the `resumed` events' tiers say, for people (recovery/restore.py)."""


@dataclass(slots=True)
class Summary:
    failures: int
    kill_to_step_s: float | None
    steps_lost: int | None
    final_loss: float
    bitwise_identical: bool
    kill_step: int | None
    resumed_from: int | None
    faulty_run_s: float
    reference_run_s: float
    resumed_tier: str | None = None
    into_spares: bool = False

    def as_json(self) -> str:
        return json.dumps(asdict(self))


def summarize(faulty: JobRun, reference: JobRun) -> Summary:
    ev = faulty.events
    kill = next((e for e in ev if e["event"] == "fault_injected"), None)
    failures = sum(1 for e in ev if e["event"] in ("restarting", "job_stopped"))
    kill_to_step = steps_lost = resumed = None
    kill_step = None
    tier: str | None = None
    spares = False
    if kill is not None:
        kill_step = max(e["step"] for e in ev if e["event"] == "step_done" and e["mono"] <= kill["mono"])
        after = [e for e in ev if e["event"] == "step_done" and e["restart"] > 0]
        if after:
            kill_to_step = min(e["mono"] for e in after) - kill["mono"]
        resumes = [e["step"] for e in ev if e["event"] == "resumed" and e["restart"] > 0]
        tiers = {str(e.get("tier")) for e in ev if e["event"] == "resumed" and e["restart"] > 0}
        tier = TIER_NAMES.get(tiers.pop()) if len(tiers) == 1 else None
        spares = any(e["event"] == "worker_spawned" and e["restart"] > 0 and e.get("spare") for e in ev)
        fresh = any(e["event"] == "fresh_start" and e["restart"] > 0 for e in ev)
        resumed = min(resumes) if resumes else (0 if fresh else None)
        if resumed is not None:  # a survivor may hold a step finished after the last one logged before the kill
            steps_lost = max(0, kill_step - resumed)
    a = json.loads((faulty.out / "result.json").read_text())
    b = json.loads((reference.out / "result.json").read_text())
    pa = torch.load(faulty.out / "final_params.pt", weights_only=True)
    pb = torch.load(reference.out / "final_params.pt", weights_only=True)
    identical = (
        a["params_sha256"] == b["params_sha256"]
        and pa.keys() == pb.keys()
        and all(torch.equal(pa[k], pb[k]) for k in pa)
    )
    return Summary(
        failures=failures,
        kill_to_step_s=kill_to_step,
        steps_lost=steps_lost,
        final_loss=a["final_loss"],
        bitwise_identical=identical,
        kill_step=kill_step,
        resumed_from=resumed,
        faulty_run_s=faulty.seconds,
        reference_run_s=reference.seconds,
        resumed_tier=tier,
        into_spares=spares,
    )
