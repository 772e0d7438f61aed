#!/usr/bin/env bash
# torchtitan's own Trainer under stalwart, checked by hand (not in the suite: torchtitan's Trainer needs triton,
# datasets and tensorboard, which scripts/setup.sh does not install, and on CPU the shims in
# tests/scripts/torchtitan_tiny.py). Runs `torchtitan.train` with the tiny config on 2 ranks: once as the baseline
# (plain torchrun on CPU; on a GPU machine, `stalwart run` without a failure, since 2 ranks share its one GPU), then
# under `stalwart run -m stalwart.integrations.torchtitan --wait-for-replacement` with rank 1 SIGKILLed at step 13
# in each PHASE (begin, backward, optimizer), and says whether each run's parameters are the baseline's, bit for bit.
# Usage: bash scripts/torchtitan_check.sh [PHASE...]; PY (default .venv/bin/python, else python3) runs it, and the
# missing packages go to $TITAN_EXTRA (default /tmp/stalwart-titan-extra) from PyPI, or from .whl/ where it exists.
# Exit status: 0 when every run ended bitwise as the baseline.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3)}
case "$PY" in  # the runs below start in their own directories
    /*) ;;
    */*) PY="$PWD/$PY" ;;
    *) PY=$(command -v "$PY") ;;
esac
extra=${TITAN_EXTRA:-/tmp/stalwart-titan-extra}
phases=${*:-begin backward optimizer}
export PYTHONPATH="$PWD/tests/scripts:$PWD/src:$extra" PYTHONUNBUFFERED=1
if ! "$PY" -c "import torchtitan.train" >/dev/null 2>&1; then
    echo "== installing what torchtitan's Trainer imports into $extra"
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --target "$extra" .whl/*.whl
    else
        "$PY" -m pip install -q --no-deps --target "$extra" triton tensorboard tensorboard-data-server datasets \
            pyarrow pandas dill multiprocess xxhash absl-py markdown werkzeug grpcio protobuf
    fi
    "$PY" -c "import torchtitan.train" || { echo "torchtitan_check: torchtitan.train does not import"; exit 1; }
fi
work=$(mktemp -d /tmp/titan-check.XXXX)
gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
titan=(-m torchtitan.train --module torchtitan_tiny --config tiny)
digests() { cat "$1"/out/rank*.json 2>/dev/null | tr '\n' ' '; }
mkdir -p "$work/baseline"
echo "== baseline ($work/baseline)"
if [ "$gpu" = 1 ]; then
    (cd "$work/baseline" && TINY_OUT=out timeout 600 "$PY" -m stalwart run --nproc-per-node 2 \
        -m stalwart.integrations.torchtitan --module torchtitan_tiny --config tiny >out.txt 2>&1)
else
    (cd "$work/baseline" && TINY_OUT=out timeout 600 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        "${titan[@]}" >out.txt 2>&1)
fi
echo "exit $?: $(digests "$work/baseline")"
want=$(digests "$work/baseline")
[ -n "$want" ] || { tail -20 "$work/baseline/out.txt"; exit 1; }
failed=0
for phase in $phases; do
    mkdir -p "$work/$phase"
    echo "== rank 1 killed at step 13 ($phase), --wait-for-replacement ($work/$phase)"
    start=$SECONDS
    (cd "$work/$phase" && TINY_DIE_AT="13:$phase" TINY_OUT=out timeout 600 "$PY" -m stalwart run \
        --nproc-per-node 2 --wait-for-replacement -m stalwart.integrations.torchtitan --module torchtitan_tiny \
        --config tiny >out.txt 2>&1)
    code=$?
    grep -E '^stalwart: (rank|resumed)|^\[stalwart run' "$work/$phase/out.txt" | head -6
    got=$(digests "$work/$phase")
    if [ "$code" = 0 ] && [ "$got" = "$want" ]; then
        echo "bitwise as the baseline (exit 0, $((SECONDS - start)) s)"
    else
        echo "DIFFERS from the baseline (exit $code): $got"; failed=1
    fi
    grep -q '"event": "reformed_in_loop"' "$work/$phase"/stalwart-logs/events.jsonl 2>/dev/null \
        && echo "the survivor re-formed in its loop" || { echo "NOT re-formed in the loop"; failed=1; }
done
exit $failed
