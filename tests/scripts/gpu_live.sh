#!/usr/bin/env bash
# GPU check of the survivor's live state with CUDA tensors (job/live.py), run by `bash scripts/gpu_checks.sh live`.
# Two ranks share GPU 0 (gloo carries their CUDA tensors), DDP on CUDA, AdamW; rank 1 is killed at step 13 and the
# survivor waits for its replacement (bitwise mode). Expected: the replacement resumes from the survivor's live
# state (tier "peer", not "memory"), 0 steps lost, and both ranks end bitwise identical to a fault-free run.
set -u
PY=${PY:-python}
dir=$(mktemp -d)
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 STALWART_WAIT_FOR_REPLACEMENT=1
# DEVICE_FLAG= (empty) runs the same on the CPU: a dry run of this script where no GPU is.
args=(tests/scripts/train_tiny.py ${DEVICE_FLAG---cuda} --steps 24 --step-sleep 0.03 --replicated-snapshot-every 20)
source "$(dirname "$0")/gpu_runs.sh"
run ref
STALWART_FAULTS=kill@rank=1,step=13 run kill
$PY - "$dir" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
def out(run):
    return {p.stem: json.loads(p.read_text()) for p in sorted((d / run / "out").glob("rank*.json"))}
ref, kill = out("ref"), out("kill")
events = [json.loads(line) for line in (d / "kill" / "events.jsonl").read_text().splitlines()]
resumed = [e for e in events if e["event"] == "resumed" and e.get("restart") == 1]
kept = [e for e in events if e["event"] == "reforming"]
result = {
    "tiers": sorted({e["tier"] for e in resumed}),
    "kept_live_state": [e.get("kept_live_state") for e in kept],
    "why_not": [e.get("why") for e in kept if e.get("why")],
    "bitwise": all(ref[r]["sha256"] == kill[r]["sha256"] for r in ref),
    "steps": {r: kill[r]["step"] for r in kill},
}
result["ok"] = result["tiers"] == ["peer"] and result["bitwise"] and all(result["kept_live_state"])
print(json.dumps(result))
sys.exit(0 if result["ok"] else 1)
PY
