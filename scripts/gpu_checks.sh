#!/usr/bin/env bash
# The checks that need a GPU, run on a lent device machine (docs/benchmarks.md records what they printed).
# Usage, from the repository root there: bash scripts/gpu_checks.sh [what...]; results go to $OUT (default ./gpu-out).
# what: info nvml preflight run overhead checkpoint overlap first_save sync group restore live reshard inplace stretch titan (default: all). Wheels missing there travel in .whl/.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
PY=python3
what=${*:-info nvml preflight run overhead checkpoint overlap first_save sync group restore live reshard inplace stretch titan}
step() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
for w in $what; do
case $w in
info)
    step info
    nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
    $PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name())"
    nproc; free -g | head -2 ;;
nvml)
    step "nvml provider"
    $PY - <<'PY'
from stalwart.detect.gpu import NvmlProvider, GpuMonitor, sample_dict, nvml_device_count
print("nvml_device_count", nvml_device_count())
p = NvmlProvider()
print("device_count", p.device_count())
for i in range(p.device_count()):
    print("sample", i, sample_dict(p.sample(i)))
print("xids", p.xids())
p.close()
PY
    ;;
preflight)
    step "preflight on this node"
    $PY -m stalwart.detect.preflight --seconds 2 | tee "$OUT/preflight.json" ;;
run)
    step "stalwart run on the GPU: pre-flight (auto), the GPU watch, 300 steps of a 400M MLP"
    rm -rf /tmp/gck /tmp/glogs
    timeout 300 $PY -m stalwart run --nproc-per-node 1 --event-log /tmp/glogs/events.jsonl \
        src/stalwart/bench/overhead_job.py --mode stalwart --result /tmp/gck-result.json --params 400000000 \
        --batch 1024 --steps 300 --warmup 20 --device cuda --ckpt /tmp/gck; echo "exit $?"
    ev=/tmp/glogs/events.jsonl; cp "$ev" "$OUT/run-events.jsonl"
    grep -E '"(preflight|gpu|checkpoint_snapshot|snapshot_interval)' "$ev" | head -40
    $PY -m stalwart report "$ev" --no-html 2>&1 | tail -30 ;;
overhead)
    step "bench overhead, cuda, 400M"
    timeout 540 $PY -m stalwart bench overhead --device cuda --params 400M ${OVERHEAD_ARGS:---rounds 2} --json \
        > "$OUT/overhead.json"; echo "exit $?"
    $PY -c "
import json; r = json.load(open('$OUT/overhead.json'))
def strip(v):
    if isinstance(v, dict): return {k: strip(x) for k, x in v.items() if k not in ('samples', 'steps', 'times')}
    return v if not isinstance(v, list) or len(v) < 8 else f'[{len(v)} values]'
print(json.dumps(strip(r), indent=1)[:8000])" ;;
checkpoint)
    step "bench checkpoint, cuda"
    timeout 420 $PY -m stalwart bench checkpoint --device cuda ${CHECKPOINT_ARGS:---size 4GB --saves 3} \
        --json > "$OUT/checkpoint.json"; echo "exit $?"
    $PY -c "
import json; r = json.load(open('$OUT/checkpoint.json'))
print(json.dumps({k: r[k] for k in ('state_bytes', 'floor', 'ratios', 'machine')}, indent=1))
for n, s in r['systems'].items(): print(n, {k: v for k, v in s.items() if k != 'samples'}, s.get('samples'))" ;;
overlap)
    step "overlapped copies: GPU tests"
    $PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'" || continue
    # -rs names any skip: on a GPU none of these may be skipped
    timeout 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_gpu_overlap.py 2>&1 | tail -25 ;;
first_save)
    step "the first save after a start, with staging prepared in the background (4 GB)"
    timeout 300 $PY -m stalwart.bench.first_save --device cuda --size 4GB > "$OUT/first_save.json"; echo "exit $?"
    cat "$OUT/first_save.json" ;;
sync)
    step "host reads: at most one synchronisation a step with the defaults, none with the checks off"
    timeout 300 $PY tests/scripts/gpu_host_reads.py | tee "$OUT/host_reads.json"; echo "exit $?" ;;
group)
    step "the re-formable group: NCCL init/abort/re-init cycles on one rank; two ranks over gloo on CUDA tensors, one killed"
    timeout 240 $PY tests/scripts/gpu_group_cycles.py | tee "$OUT/group.json"; echo "exit $?" ;;
restore)
    step "a memory-tier restore of 4 GB into CUDA tensors: pageable against pinned reads (target 10 GB/s)"
    SIZE_GB=${RESTORE_GB:-4} timeout 240 $PY tests/scripts/gpu_restore.py | tee "$OUT/restore.json"; echo "exit $?" ;;
live)
    step "the survivor's live state with CUDA tensors: 2 ranks on GPU 0, DDP, a kill; expect tier peer, bitwise"
    PY=$PY timeout 400 bash tests/scripts/gpu_live.sh | tee "$OUT/live.json"; echo "exit $?" ;;
reshard)
    step "FSDP2 state of 2 CPU ranks resumed by 1 rank on GPU 0 (CUDA DTensors), from the checkpoint and from memory"
    PY=$PY timeout 300 bash tests/scripts/gpu_reshard.sh | tee "$OUT/reshard.json"; echo "exit $?" ;;
inplace)
    step "FSDP2 modules on GPU 0 sharded again in place on a new NCCL group; expect loaded_equal, trained, device cuda:0"
    d=$(mktemp -d); timeout 120 $PY tests/scripts/torch_compat_child.py reshard "$d" cuda | tee "$OUT/inplace.json"
    echo "exit $?"; rm -rf "$d" ;;
stretch)
    step "FSDP2 survivors training on shrunk: 2 ranks on GPU 0, one killed; expect shrunk 2 -> 1 -> 2, within 1e-5"
    PY=$PY timeout 400 bash tests/scripts/gpu_stretch.sh | tee "$OUT/stretch.json"; echo "exit $?" ;;
titan)
    step "torchtitan's own Trainer (tiny llama3) on 2 ranks on GPU 0, rank 1 killed in its backward; expect bitwise"
    # Needs torchtitan 0.3 and its imports (datasets, tensorboard) as wheels in .whl/; triton comes with torch.
    PY=$PY TITAN_EXTRA=/tmp/site timeout 560 bash scripts/torchtitan_check.sh backward | tee "$OUT/titan.txt"
    echo "exit $?" ;;
esac
done
