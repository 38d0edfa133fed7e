#!/usr/bin/env bash
# The GPU check: parity tests, kernel microbenchmarks, end-to-end models; a summary table last.
#
# On the GPU machine, from the repo root:
#
#     source .mlx-cuda/setup.sh && scripts/gpu-check.sh
#
# The defaults fit one 10-minute device call on an H200. Choose what runs with:
#
#     KERNELS_ARGS="--shapes qwen3,mixtral --tokens 1,2048,8192" scripts/gpu-check.sh
#     MODELS_ARGS="--models gpt_oss,deepseek_v3 --prompts 512,2048,8192" scripts/gpu-check.sh
#     SKIP_TESTS=1 SKIP_KERNELS=1 scripts/gpu-check.sh        # models only
#     SAVE_PTX_CACHE=1 scripts/gpu-check.sh    # MLX's compiled kernels back under $OUT, to carry next time
#     SHARDS=8 ALL_GPU=1 REFERENCES_TOO=1 SKIP_KERNELS=1 SKIP_MODELS=1 scripts/gpu-check.sh
#         # every GPU test but the greedy ones, kernels on and (at the same time) off
#     BREADTH=1 SHARDS=8 SKIP_KERNELS=1 SKIP_MODELS=1 scripts/gpu-check.sh   # zoo_breadth's families on the kernels
#     DECODE=1 SKIP_TESTS=1 SKIP_KERNELS=1 SKIP_MODELS=1 scripts/gpu-check.sh   # the decode benchmarks
#     TIMELINE=1 SKIP_TESTS=1 SKIP_KERNELS=1 SKIP_MODELS=1 scripts/gpu-check.sh # batch-1 decode / dense, in bursts
#     BATCHED=1 SKIP_TESTS=1 SKIP_KERNELS=1 SKIP_MODELS=1 scripts/gpu-check.sh  # batched decode / dense, in bursts
#     RATES=1 SKIP_TESTS=1 SKIP_KERNELS=1 SKIP_MODELS=1 scripts/gpu-check.sh    # the prefill GEMMs' own rates
#     FORWARDS=1 SKIP_TESTS=1 SKIP_KERNELS=1 SKIP_MODELS=1 scripts/gpu-check.sh # one forward / dense and stock
#     MEMORY=1 SKIP_TESTS=1 SKIP_KERNELS=1 SKIP_MODELS=1 scripts/gpu-check.sh   # a layer's prefill bytes, stock and ours
#     BUDGET=560 RATES=1 FORWARDS=1 BATCHED=1 SAVE_PTX_CACHE=1 SKIP_KERNELS=1 SKIP_MODELS=1 \
#         TESTS_SELECT="cuda and prefill" scripts/gpu-check.sh   # all within 560 s, in this file's order
#
# (the *_ARGS replace the defaults below; see `python3 -m benchmarks.kernels --help` and
# `python3 -m benchmarks.models --help`). Each part runs under a time limit (TESTS_TIMEOUT,
# KERNELS_TIMEOUT, MODELS_TIMEOUT, seconds); the benchmarks write their JSON as they go, so a
# part cut short keeps what it finished.
#
# Writes tests.log, kernels.json, kernels.log, models.json, models.log and summary.md under
# ${OUT:-/tmp/gpu-check}. Exits non-zero if a part failed or ran out of time.
#
# BUDGET (seconds, from this script's start): a device call's time, which ends the command
# whatever runs then. Each part's limit is cut to what is left of it, less BUDGET_RESERVE (30 s:
# the summary and SAVE_PTX_CACHE's packing), and a part that would get less than 30 s is not run
# (said in the summary, and the exit status is non-zero), so that the parts run so far and the
# saved cache come back whole.
set -u -o pipefail

out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"

# MLX's compiled kernels from an earlier call, if carried (scripts/ptx-cache.sh); SAVE_PTX_CACHE=1
# packs them under $out at the end for the next call (parts of 15 MiB; a call returns 8 files).
# shellcheck source=scripts/ptx-cache.sh
source "$(dirname "${BASH_SOURCE[0]}")/ptx-cache.sh"

# Stock runs are slow (stock mixtral prefills ~219 tok/s: a 2048-token prompt takes ~9 s a run,
# and MLX's first run at a new shape is slower still), so the default selection skips T = 4 and
# 8192 and 8192-token prompts, and batched decode starts from 256-token prompts (16 of them are
# prefilled once per model). Expected on an H200: tests ~1.5 min, kernels ~1.5-2 min, models
# ~3.5-4.5 min (the first stock call at a new shape can JIT-compile for tens of seconds); all
# three may not fit one 10-minute call: SKIP_* the parts another call covers.
KERNELS_ARGS=${KERNELS_ARGS:---tokens 1,16,128,512,2048 --max-seconds 1.0}
MODELS_ARGS=${MODELS_ARGS:---models qwen3_moe,mixtral --prompts 512,2048 --batch-prompt 256 --batch-tokens 32 --repeats 2}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-150}
KERNELS_TIMEOUT=${KERNELS_TIMEOUT:-160}
MODELS_TIMEOUT=${MODELS_TIMEOUT:-280}

python3 -c 'import mlx.core as mx, sys; sys.exit(0 if mx.cuda.is_available() else 1)' ||
    echo "warning: MLX sees no CUDA GPU here (was .mlx-cuda/setup.sh sourced?)" >&2

statuses=()
failed=0

# budget_part NAME LIMIT: sets part_seconds to LIMIT, or to what is left of BUDGET (less
# BUDGET_RESERVE) where that is less; where that is under 30 s, records NAME as not run and
# returns 1.
budget_part() {
    local left
    part_seconds=$2
    if [ -n "${BUDGET:-}" ]; then
        left=$((BUDGET - SECONDS - ${BUDGET_RESERVE:-30}))
        [ "$left" -lt "$part_seconds" ] && part_seconds=$left
    fi
    if [ "$part_seconds" -lt 30 ]; then
        statuses+=("$1: not run (BUDGET spent)")
        echo "== $1: not run (BUDGET spent)" >&2
        failed=1
        return 1
    fi
}

# run_part NAME LIMIT COMMAND...: COMMAND's output goes to $out/NAME.log only; the console gets
# one status line, and the log's tail when the part fails. Returns 1 where BUDGET left it unrun.
run_part() {
    local name=$1 limit
    budget_part "$name" "$2" || return 1
    limit=$part_seconds
    shift 2
    echo "== $name (limit ${limit}s): $*" >&2
    local start=$SECONDS rc
    rm -f "$out/$name.json" # a JSON left by an earlier run must not pass for this one's
    # SIGINT first: Python stops with KeyboardInterrupt; SIGKILL 15 s later if it does not.
    timeout -s INT -k 15 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    local status="exit $rc"
    [ "$rc" -eq 124 ] && status="TIMED OUT"
    statuses+=("$name: $status after $((SECONDS - start)) s")
    if [ "$rc" -ne 0 ]; then
        failed=1
        echo "-- last lines of $out/$name.log:" >&2
        tail -n 20 "$out/$name.log" >&2
    fi
    return 0
}

# run_per_model NAME LIMIT MODELS COMMAND...: run_part of `COMMAND --model M` for each M of MODELS
# (comma-separated) in turn, stopping at the first that fails.
run_per_model() {
    local name=$1 limit=$2 models=$3
    shift 3
    run_part "$name" "$limit" bash -c 'models=$1; shift; for model in ${models//,/ }; do "$@" --model "$model" || exit 1; done' \
        _ "$models" "$@"
}

if [ -z "${SKIP_TESTS:-}" ]; then
    # Default: the kernels against their float32 oracles (computed on the CPU, so no MLX JIT of
    # stock's kernels per shape: ~80 s with 8 examples per hypothesis test on the H200).
    # GREEDY=1: the 14 greedy-token cases on the GPU (~1 min each: MLX compiles stock's kernels
    # per decode shape), best in a call of their own. ALL_GPU=1: every GPU test but the greedy
    # ones, the dispatch-vs-stock tests included (slow for the same reason).
    # fp32 comparisons without TF32, as MLX's own tests; fewer hypothesis examples than on the CPU.
    # BREADTH=1: tests/parity/test_families.py's GPU cases (zoo_breadth's families), also apart.
    default_select="cuda and not greedy"
    [ -n "${ALL_GPU:-}" ] && default_select="(gpu or cuda) and not greedy and not breadth"
    [ -n "${GREEDY:-}" ] && default_select="gpu and greedy"
    [ -n "${BREADTH:-}" ] && default_select="gpu and breadth"
    # SHARDS=n: n pytest processes side by side (the GPU tests wait mostly on MLX's compiles, on
    # the CPU: on the H200 the whole GPU suite took 209 s in 8 shards, where the 14 greedy cases
    # alone take ~1 min each in one process).
    # REFERENCES_TOO=1: the same selection with every CUDA kernel switched off (the references) in
    # SHARDS more processes at the same time, into tests-references.log.
    # timeout's SIGKILL comes 15 s after its SIGINT, after pytest-shards.sh's own kill of shards
    # that outlive the SIGINT (SHARD_KILL_AFTER, 10 s): it still prints their logs.
    references_pid=
    if [ -n "${REFERENCES_TOO:-}" ] && budget_part "tests with the references" "$TESTS_TIMEOUT"; then
        MLX_MOE_FIX_CUDA_DECODE=0 MLX_MOE_FIX_CUDA_PREFILL=0 MLX_MOE_FIX_CUDA_ROUTER=0 MLX_ENABLE_TF32=0 \
            MLX_MOE_FIX_EXAMPLES=${EXAMPLES:-8} timeout -s INT -k 15 "$part_seconds" \
            scripts/pytest-shards.sh "${SHARDS:-1}" tests/parity -q -rfEs -p no:cacheprovider --tb=short \
            -k "${TESTS_SELECT:-$default_select}" >"$out/tests-references.log" 2>&1 &
        references_pid=$!
    fi
    MLX_ENABLE_TF32=0 MLX_MOE_FIX_EXAMPLES=${EXAMPLES:-8} run_part tests "$TESTS_TIMEOUT" \
        scripts/pytest-shards.sh "${SHARDS:-1}" tests/parity -q -rfEs -p no:cacheprovider --tb=short \
        -k "${TESTS_SELECT:-$default_select}"
    if [ -n "$references_pid" ]; then
        wait "$references_pid"
        rc=$?
        statuses+=("tests with the references: exit $rc ($(tail -n 1 "$out/tests-references.log"))")
        [ "$rc" -ne 0 ] && failed=1
    fi
fi
if [ -z "${SKIP_KERNELS:-}" ]; then
    # shellcheck disable=SC2086  # the *_ARGS are word lists
    run_part kernels "$KERNELS_TIMEOUT" python3 -m benchmarks.kernels $KERNELS_ARGS \
        --json "$out/kernels.json"
fi
if [ -n "${RATES:-}" ]; then
    # RATES=1: the prefill GEMMs' own rates (issue 4's TFLOP/s, on our kernels' summed time as
    # CUPTI traces them; benchmarks/gpu_timeline.py) at RATES_CASES, shape:tokens comma-separated.
    run_part rates "${RATES_TIMEOUT:-150}" python3 -m benchmarks.gpu_timeline --parts prefill \
        --cases "${RATES_CASES:-qwen3:2048,mixtral:2048,qwen3:512,mixtral:512,qwen3:8192}" --launches 4 &&
        statuses+=("prefill own rates: $out/rates.log")
fi
if [ -n "${MEMORY:-}" ]; then
    # MEMORY=1: what one layer's prefill allocates above the resident memory, stock's and ours, at
    # MEMORY_CASES (benchmarks/prefill_memory.py; issue 4's "peak memory within stock + O(tokens x
    # hidden)").
    run_part memory "${MEMORY_TIMEOUT:-120}" python3 -m benchmarks.prefill_memory \
        --cases "${MEMORY_CASES:-qwen3:512,qwen3:2048,qwen3:8192,mixtral:512,mixtral:2048}" &&
        statuses+=("prefill memory: $out/memory.log")
fi
if [ -n "${FORWARDS:-}" ]; then
    # FORWARDS=1: one forward of each of FORWARD_MODELS (comma-separated) at FORWARD_PROMPTS against
    # its dense equivalent, and stock up to 512 tokens (benchmarks/prefill_forward.py; issue 4's
    # end to end).
    run_per_model forwards "${FORWARDS_TIMEOUT:-300}" "${FORWARD_MODELS:-qwen3_moe,mixtral}" python3 -m benchmarks.prefill_forward \
        --prompts "${FORWARD_PROMPTS:-512,2048}" --reps 3 --rounds 2 &&
        statuses+=("one forward per model: $out/forwards.log")
fi
if [ -n "${DECODE:-}" ]; then
    # DECODE=1: the decode benchmarks (issue 5): the expert block at the Qwen3 and Mixtral shapes
    # (decode_split), the work primitives per layer of a decode step on this device (decode_graph)
    # and the leave-one-stage-out timing of full-size models (decode_attribution).
    run_part decode "${DECODE_TIMEOUT:-360}" bash -c "python3 -m benchmarks.decode_split &&
        python3 -m benchmarks.decode_split --hidden 4096 --ffn 14336 --experts 8 --top-k 2 --layers 16 &&
        python3 -m benchmarks.decode_graph --models qwen3_moe,mixtral &&
        python3 -m benchmarks.decode_attribution ${ATTRIBUTION_ARGS:---models qwen3_moe --decode-tokens 32}" &&
        statuses+=("decode tables: $out/decode.log")
fi
if [ -n "${TIMELINE:-}" ]; then
    # TIMELINE=1: batch-1 decode of each model against its dense equivalent, the variants taking
    # turns in bursts (benchmarks/decode_timeline.py); TIMELINE_MODELS, comma-separated.
    run_per_model timeline "${TIMELINE_TIMEOUT:-420}" "${TIMELINE_MODELS:-qwen3_moe,inkling,deepseek_v4}" \
        python3 -m benchmarks.decode_timeline --deepseek-layers 6 --cycles "${TIMELINE_CYCLES:-12}" &&
        statuses+=("decode timelines: $out/timeline.log")
fi
if [ -n "${BATCHED:-}" ]; then
    # BATCHED=1: BatchGenerator decode at batch 1, 4 and 16 of each model against its dense
    # equivalent, in turns of bursts (benchmarks/batched_timeline.py); BATCHED_MODELS, comma-separated.
    run_per_model batched "${BATCHED_TIMEOUT:-300}" "${BATCHED_MODELS:-qwen3_moe,mixtral}" python3 -m benchmarks.batched_timeline &&
        statuses+=("batched decode timelines: $out/batched.log")
fi
if [ -z "${SKIP_MODELS:-}" ]; then
    # shellcheck disable=SC2086
    run_part models "$MODELS_TIMEOUT" python3 -m benchmarks.models $MODELS_ARGS \
        --json "$out/models.json"
fi

summary_args=()
[ -z "${SKIP_TESTS:-}" ] && summary_args+=(--tests "$out/tests.log")
[ -z "${SKIP_KERNELS:-}" ] && summary_args+=(--kernels "$out/kernels.json")
[ -z "${SKIP_MODELS:-}" ] && summary_args+=(--models "$out/models.json")
{
    echo "# gpu-check summary"
    printf -- '- %s\n' "${statuses[@]}"
    echo
    python3 -m benchmarks.summary "${summary_args[@]}"
} | tee "$out/summary.md" || failed=1
[ -n "${SAVE_PTX_CACHE:-}" ] && { ptx_cache_save "$out" || failed=1; }
exit "$failed"
