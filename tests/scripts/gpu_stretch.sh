#!/usr/bin/env bash
# GPU check of FSDP2 survivors training on shrunk (recovery/in_loop/sharded_stretch.py), run by
# `bash scripts/gpu_checks.sh stretch`. Two ranks share GPU 0, each linear layer and the model sharded with FSDP2 on
# CUDA, AdamW; rank 1 dies in its forward at step 13 and its replacement's set-up takes 2 s. Expected: the survivor
# shards its modules again in place among itself (2 -> 1), trains on, leaves its shards in node memory at the grow,
# and both ranks shard again (1 -> 2) and resume from memory; every sample seen once, the parameters within 1e-5 of
# a fault-free run (relative to their largest magnitude).
set -u
PY=${PY:-python}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 STALWART_WAIT_FOR_REPLACEMENT=0
# DEVICE_FLAG= (empty) runs the same on the CPU: a dry run of this script where no GPU is.
args=(tests/scripts/train_tiny.py ${DEVICE_FLAG---cuda} --fsdp --no-randomness --steps 24 --step-sleep 0.05)
source "$(dirname "$0")/gpu_runs.sh"
run ref
run kill --setup-s 2 --die-at 13:forward
$PY - "$dir" <<'PY'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
def out(run):
    return {p.stem: json.loads(p.read_text()) for p in sorted((d / run / "out").glob("rank*.json"))}
ref, kill = out("ref"), out("kill")
events = [json.loads(line) for line in (d / "kill" / "events.jsonl").read_text().splitlines()]
def of(name):
    return [e for e in events if e["event"] == name]
scale = max(abs(v) for v in ref["rank0"]["params"])
diff = max(abs(a - b) for r in ref for a, b in zip(kill[r]["params"], ref[r]["params"]))
result = {
    "shrunk": [(e["rank"], e["world_size"]) for e in of("shrunk")],
    "resharded": [(e["rank"], e["world_from"], e["world_to"]) for e in of("resharded_in_place")],
    "grown": sorted((e["rank"], e["tier"]) for e in of("resumed") if "grew back" in e.get("source", "")),
    "shrunk_steps": [e["shrunk_steps"] for e in of("growing")],
    "waiting": [e.get("why") for e in of("waiting_for_replacement")],
    "samples_once": sorted(i for r in kill for i in kill[r]["seen"]) == sorted(i for r in ref for i in ref[r]["seen"]),
    "relative_diff": diff / scale,
    "steps": {r: kill[r]["step"] for r in kill},
}
result["ok"] = (
    result["shrunk"] == [(0, 1)] and result["resharded"] == [(0, 2, 1), (0, 1, 2)]
    and result["grown"] == [(0, "memory"), (1, "memory")] and result["samples_once"] and result["relative_diff"] <= 1e-5
)
print(json.dumps(result))
sys.exit(0 if result["ok"] else 1)
PY
