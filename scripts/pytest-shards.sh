#!/usr/bin/env bash
# pytest-shards.sh N PYTEST_ARGS...: N pytest processes side by side, each with every N-th test
# (MLX_MOE_FIX_SHARD in tests/conftest.py); their logs one after another, then one line with each
# shard's closing line. Exits non-zero if a shard failed. SIGINT / SIGTERM reach every shard.
set -u -m # -m: background shards keep SIGINT (a script's background jobs ignore it otherwise)
count=$1
shift
dir=$(mktemp -d)
pids=()
for ((i = 0; i < count; i++)); do
    MLX_MOE_FIX_SHARD=$i/$count python3 -m pytest "$@" >"$dir/$i.log" 2>&1 &
    pids+=($!)
done
# A shard inside a long C call (MLX compiling a kernel) does not stop at SIGINT until the call
# returns, and one still running when gpu-check.sh's SIGKILL ends this script goes on beside the
# parts that follow, skewing their timings: SHARD_KILL_AFTER seconds (10) after the signal a
# watchdog kills the shards (its own process group under -m: it outlives this script killed first).
# Under -m each shard is a process group too (its pid negated names it): the signals reach its
# children.
groups=("${pids[@]/#/-}")
trap 'kill -INT -- "${groups[@]}" 2>/dev/null; (sleep "${SHARD_KILL_AFTER:-10}"; kill -KILL -- "${groups[@]}" 2>/dev/null) &' INT TERM
failed=0
closing=()
for i in "${!pids[@]}"; do
    while true; do # a trapped signal ends `wait` early; the shard itself is still finishing
        wait "${pids[$i]}"
        rc=$?
        kill -0 "${pids[$i]}" 2>/dev/null || break
    done
    # exit 5: every test of this shard was deselected
    [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && failed=1
    echo "---- shard $i/$count (exit $rc)"
    cat "$dir/$i.log"
    closing+=("shard $i/$count: $(grep -v '^\s*$' "$dir/$i.log" | tail -n 1)")
done
rm -rf "$dir"
(IFS=';'; echo "${closing[*]}")
exit "$failed"
