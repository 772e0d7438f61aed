#!/usr/bin/env bash
# GPU check of resharding into CUDA DTensors, run by `bash scripts/gpu_checks.sh reshard`. On the CPU a resharded
# tensor is written straight into the module's own shard (format/sharded.py `_fits`); a CUDA shard is built with
# DTensor.from_local on the device instead, which no CPU test reaches. An FSDP2 job of 2 ranks on the CPU (gloo)
# runs 8 steps, keeping its checkpoint and its node memory (torchrun with STALWART_SNAPSHOT_DIR, as
# tests/test_reshard.py); one rank on GPU 0 then resumes it twice: from the checkpoint (an empty memory directory)
# and from node memory. Expected: `world_resized` 2 -> 1 with tier durable, then memory, and every full parameter and
# AdamW moment at the resume bitwise the saved ones. DEVICE_FLAG= (empty) runs the same on the CPU: a dry run.
set -u
PY=${PY:-python}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
tiny=$PWD/tests/scripts/train_tiny.py
common=(--fsdp --no-randomness --gbs 12 --every 4 --hidden 30 --out out)
run() {  # NAME NPROC MEMORY-DIR ARGS...: the tiny job under torchrun in $dir/NAME
    local name=$1 nproc=$2 memory=$3
    shift 3
    mkdir -p "$dir/$name" "$memory"
    (cd "$dir/$name" && STALWART_SNAPSHOT_DIR=$memory STALWART_EVENT_LOG=$dir/$name/events.jsonl timeout 240 \
        $PY -m torch.distributed.run --standalone --nproc-per-node "$nproc" "$tiny" "${common[@]}" "$@" \
        > output.log 2>&1) || { tail -30 "$dir/$name/output.log"; exit 1; }
}
run saved 2 "$dir/memory" --ckpt "$dir/ckpt" --steps 8 --dump-dir "$dir/dumps/saved"
cp -r "$dir/ckpt" "$dir/ckpt-durable"
run durable 1 "$dir/empty" ${DEVICE_FLAG---cuda} --allow-resize --ckpt "$dir/ckpt-durable" --steps 10 \
    --dump-dir "$dir/dumps/durable"
run memory 1 "$dir/memory" ${DEVICE_FLAG---cuda} --allow-resize --ckpt "$dir/ckpt" --steps 10 \
    --dump-dir "$dir/dumps/memory"
$PY - "$dir" <<'PY'
import json, sys
from pathlib import Path
import torch
d = Path(sys.argv[1])
saved = torch.load(d / "dumps/saved/end-8.pt", map_location="cpu", weights_only=True)
result = {}
for tier in ("durable", "memory"):
    got = torch.load(d / f"dumps/{tier}/resumed-8.pt", map_location="cpu", weights_only=True)
    events = [json.loads(line) for line in (d / tier / "events.jsonl").read_text().splitlines()]
    resized = [(e["from"], e["to"], e["tier"]) for e in events if e["event"] == "world_resized"]
    same = sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    result[tier] = {"world_resized": resized, "bitwise": same, "tensors": len(saved)}
result["ok"] = all(result[t]["bitwise"] and result[t]["world_resized"] == [(2, 1, t)] for t in ("durable", "memory"))
print(json.dumps(result))
sys.exit(0 if result["ok"] else 1)
PY
