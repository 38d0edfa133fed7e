#!/usr/bin/env bash
# Branch `experiments`: one GPU call that judges the two kernel experiments against main's kernels.
#
#     source .mlx-cuda/setup.sh && scripts/gpu-experiments.sh        # on the GPU machine, ~9 min
#
# 1. the kernels against their float32 oracles: both prefill GEMMs (`grouped`, `grouped_registers`)
#    and the decode kernels at 4 rows per warp (tests/parity/test_ops.py, 4 shards);
# 2. benchmarks/prefill_sweep.py: every GEMM variant at the prefill and batched-decode shapes;
# 3. benchmarks/decode_split.py at the Qwen3 and Mixtral expert shapes: 1 vs 4 rows per warp;
# then MLX's compiled kernels packed under $OUT for the next call (scripts/ptx-cache.sh).
# Each part has a time limit (TESTS_TIMEOUT, SWEEP_TIMEOUT, SPLIT_TIMEOUT); logs under $OUT.
set -u -o pipefail
out=${OUT:-/tmp/gpu-experiments}
mkdir -p "$out"
# shellcheck source=scripts/ptx-cache.sh
source "$(dirname "${BASH_SOURCE[0]}")/ptx-cache.sh"
export MLX_MOE_FIX_CUDA_DECODE=1 MLX_MOE_FIX_CUDA_PREFILL=1

MLX_ENABLE_TF32=0 MLX_MOE_FIX_EXAMPLES=${EXAMPLES:-8} timeout -s INT -k 15 "${TESTS_TIMEOUT:-200}" \
    scripts/pytest-shards.sh 4 tests/parity/test_ops.py -q -rs -p no:cacheprovider --tb=short -k cuda \
    >"$out/tests.log" 2>&1
echo "tests: exit $?" | tee "$out/status.txt"
timeout -s INT -k 15 "${SWEEP_TIMEOUT:-200}" python3 -m benchmarks.prefill_sweep >"$out/sweep.log" 2>&1
echo "sweep: exit $?" | tee -a "$out/status.txt"
{
    timeout -s INT -k 15 "${SPLIT_TIMEOUT:-60}" python3 -m benchmarks.decode_split
    timeout -s INT -k 15 "${SPLIT_TIMEOUT:-60}" python3 -m benchmarks.decode_split --hidden 4096 --ffn 14336 --experts 8 --top-k 2 --layers 16
} >"$out/decode.log" 2>&1
echo "decode_split: exit $?" | tee -a "$out/status.txt"
ptx_cache_save "$out"
tail -n 1 "$out/tests.log"
grep -E "^\| " "$out/sweep.log" | tail -n 60
grep -E "^\||expert weights" "$out/decode.log"
