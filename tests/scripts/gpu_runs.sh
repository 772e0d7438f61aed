# Sourced by the GPU checks that compare a run with a failure to a fault-free one (gpu_live.sh, gpu_stretch.sh).
# Expects PY, `dir` (a temporary directory) and `args` (the training script, then its options).
# run NAME [OPTION...]: `stalwart run` of 2 ranks of the script in $dir/NAME with its options and OPTION..., the
# event log and output there; the output's tail and exit 1 when it fails. The caller's environment passes through.
run() {
    local name=$1
    shift
    mkdir -p "$dir/$name"
    (cd "$dir/$name" && timeout 180 $PY -m stalwart run --nproc-per-node 2 --event-log events.jsonl \
        "$OLDPWD/${args[0]}" --ckpt ckpt --out out "${args[@]:1}" "$@" > output.log 2>&1) \
        || { tail -30 "$dir/$name/output.log"; exit 1; }
}
