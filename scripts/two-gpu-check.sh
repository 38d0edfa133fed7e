#!/usr/bin/env bash
# The sharded runs of issue 8 on a machine with two GPUs (nvidia-h200-x2), from the repo root:
#
#     source .mlx-cuda/setup.sh && source scripts/ptx-cache.sh && scripts/two-gpu-check.sh
#
# Each run is two processes, rank r on GPU r, joined by MLX's NCCL backend through the variables
# its nccl init reads (what `mlx.launch --backend nccl` sets on each host). NVLink multicast stays
# off (NCCL_NVLS_ENABLE=0): on shared hosts it can take the GPUs out of service.
#   - benchmarks.sharded_tokens for qwen3_moe and gpt_oss: unsharded vs sharded greedy tokens,
#     stock and patched, teacher-forced agreement, stock's run-to-run reproducibility and the
#     replay of every MoE layer call stock vs patched;
#   - benchmarks.sharded_layers on one GPU, then on two: Mixtral-size layers, tokens/s at each of
#     LAYER_TOKENS (default 2048, a prefill, and 1, a decode step).
# Logs under ${OUT:-/tmp/two-gpu-check}; rank 0's JSON lines are printed.
set -u -o pipefail
export NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp/two-gpu-check}
mkdir -p "$out"
port=${NCCL_PORT_BASE:-29500}

# two_ranks NAME COMMAND...: both ranks of COMMAND; their logs are $out/NAME.rank{0,1}.log.
two_ranks() {
    local name=$1 r
    shift
    port=$((port + 1))
    for r in 0 1; do
        NCCL_HOST_IP=127.0.0.1 NCCL_PORT=$port MLX_WORLD_SIZE=2 MLX_RANK=$r CUDA_VISIBLE_DEVICES=$r \
            timeout "${RUN_TIMEOUT:-240}" "$@" >"$out/$name.rank$r.log" 2>&1 &
    done
    wait
    echo "== $name"
    grep '^{' "$out/$name.rank0.log" || tail -n 20 "$out/$name.rank0.log" "$out/$name.rank1.log"
}

for family in ${FAMILIES:-qwen3_moe gpt_oss}; do
    two_ranks "tokens-$family" python3 -m benchmarks.sharded_tokens --backend nccl --family "$family"
done
for tokens in ${LAYER_TOKENS:-2048 1}; do
    CUDA_VISIBLE_DEVICES=0 timeout "${RUN_TIMEOUT:-240}" python3 -m benchmarks.sharded_layers --tokens "$tokens" \
        >"$out/layers-1gpu-$tokens.log" 2>&1
    echo "== layers-1gpu-$tokens"
    grep '^{' "$out/layers-1gpu-$tokens.log" || tail -n 20 "$out/layers-1gpu-$tokens.log"
    two_ranks "layers-2gpu-$tokens" python3 -m benchmarks.sharded_layers --backend nccl --tokens "$tokens"
done
