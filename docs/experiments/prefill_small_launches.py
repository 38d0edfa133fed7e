"""The CUDA prefill's small launches alone (GPU machine, torch with CUDA), 16 launches a graph
each after the previous one, traced by CUPTI (benchmarks.gpu_timeline.traced): the k-order copy
(our launch and MLX's transpose), the route kernel, and `x + 1` over the same rows as a bandwidth
yardstick, at Qwen3-30B-A3B's T=2048 and T=8192 and Mixtral-8x7B's T=2048 shapes. Per launch the
GPU's busy time and the evaluation's wall time, then the longest kernels by name (mean µs).

    python3 docs/experiments/prefill_small_launches.py   # from the repo root

docs/benchmarks.md, seventy-third stop (run there as scratch/t73/alone.py, its route launches
then chained through mx.depends: their kernel times, not their busy time, are the reading).
"""
import importlib
import statistics

import mlx.core as mx

from benchmarks.gpu_timeline import busy_time, kernel_table, traced
from benchmarks.kernels import random_routing
from benchmarks.timing import after, in_sequence

P = importlib.import_module("mlx_moe_fix.kernels.moe_prefill")
CHAIN, REPS = 16, 5


def report(label, fn):
    phases, kernels = traced(fn, REPS)
    busy = busy_time(kernels) / REPS / CHAIN
    ev = statistics.median(p[1] for p in phases) * 1e6 / CHAIN
    print(f"{label}: busy {busy:.2f} µs a launch, evaluation {ev:.1f}", flush=True)
    for name, count, mean in kernel_table(kernels, REPS * CHAIN)[:3]:
        print(f"    {count:.1f} x {mean:.2f} µs {name[:90]}")


for tokens, hidden, experts, top_k in [(2048, 2048, 128, 8), (8192, 2048, 128, 8), (2048, 4096, 8, 2)]:
    x = (mx.random.normal((tokens, hidden)) * 0.5).astype(mx.bfloat16)
    idx = random_routing(tokens, experts, top_k).reshape(-1).astype(mx.uint32)
    mx.eval(x, idx)
    tile = P.tile_height(idx.size, experts)
    report(f"T={tokens} h={hidden} k_order kernel", in_sequence(lambda prev: P.wgmma_k_order_kernel(x if prev is None else prev), CHAIN))
    report(f"T={tokens} h={hidden} k_order MLX transpose", in_sequence(lambda prev: P.wgmma_k_order(x if prev is None else prev), CHAIN))
    report(f"T={tokens} E={experts} k={top_k} route", in_sequence(lambda prev: P.route_kernel(after(idx, None if prev is None else prev[0]), experts, tile), CHAIN))
    report(f"T={tokens} copy (x + 1, bandwidth yardstick)", in_sequence(lambda prev: (x if prev is None else prev) + 1, CHAIN))
