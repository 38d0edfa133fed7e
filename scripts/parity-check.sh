#!/usr/bin/env bash
# A tree's parity on the GPU in one device call, as a stop re-checks it: the greedy-token cases,
# the breadth families (tests/parity/test_families.py) and every other GPU test, one after another
# through scripts/gpu-check.sh, with MLX's compiled kernels carried in and saved back.
#
# On the GPU machine, from the repo root (carry .mlx-cuda and .mlx-ptx-cache):
#
#     source .mlx-cuda/setup.sh && scripts/parity-check.sh
#
# With the PTX cache of an earlier call, on an H200: greedy ~20 s (7 shards), breadth ~30 s (12),
# the suite ~55 s (6); a fresh cache takes minutes more. Writes parity.log (the three test logs),
# summary.md (each part's gpu-check summary: its status and pytest's last line) and the cache's parts
# (mlx-ptx-cache.tar.xz.*) under ${OUT:-/tmp/parity-check}: few files, as a device call returns 8.
# Exits non-zero if a part failed or ran out of time (each part: TESTS_TIMEOUT, default 170 s).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-/tmp/parity-check}
mkdir -p "$out"
export TESTS_TIMEOUT=${TESTS_TIMEOUT:-170}
failed=0
parts=(greedy breadth suite)

# run_part NAME VARIABLE=VALUE...: gpu-check.sh's tests alone, with these settings, into $out/NAME.
run_part() {
    local name=$1
    shift
    env "$@" SKIP_KERNELS=1 SKIP_MODELS=1 OUT="$out/$name" scripts/gpu-check.sh >"$out/$name.console" 2>&1 || failed=1
}
run_part greedy GREEDY=1 SHARDS="${GREEDY_SHARDS:-7}"
run_part breadth BREADTH=1 SHARDS="${BREADTH_SHARDS:-12}"
run_part suite ALL_GPU=1 SHARDS="${SUITE_SHARDS:-6}" SAVE_PTX_CACHE=1

: >"$out/parity.log"
{
    echo "# parity-check summary"
    for name in "${parts[@]}"; do
        { echo "==== $name"; cat "$out/$name/tests.log" "$out/$name.console"; } >>"$out/parity.log" 2>&1
        echo "## $name"
        tail -n +2 "$out/$name/summary.md" 2>/dev/null || echo "(no summary: see parity.log)"
    done
} | tee "$out/summary.md"
mv "$out"/suite/mlx-ptx-cache.tar.xz.* "$out"/ 2>/dev/null
for name in "${parts[@]}"; do rm -rf "${out:?}/$name" "$out/$name.console"; done
exit "$failed"
