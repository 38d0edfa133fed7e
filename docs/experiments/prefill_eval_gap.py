"""Where a timed prefill graph's wall time goes outside its kernels (GPU machine, torch with CUDA):
per callable, the untraced median a launch (benchmarks.timing.bench, `launches` independent
launches a graph, the Python build inside it as in prefill_ab), then one traced evaluation's
CUDA runtime calls and kernels, by start time from the evaluation's start, and the runtime calls'
time summed per evaluation. The callables: the CUDA prefill op's gate+up, down and layer
(benchmarks.prefill_ab's calls at Qwen3-30B-A3B T=2048) and MLX's dense bf16 matmuls of gate+up's
and the down's FLOPs, as a control.

    python3 docs/experiments/prefill_eval_gap.py [LAUNCHES]   # from the repo root, default 4

docs/benchmarks.md, seventy-second stop.
"""

import importlib
import sys

import mlx.core as mx
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.gpu_timeline import exported_trace
from benchmarks.prefill_ab import build_case, part_calls
from benchmarks.switch_glu import experts_of
from benchmarks.timing import bench, repeated, warm_up

RUNTIME = ("cuda_runtime", "cuda_driver")


def traced_evaluations(graph, reps: int = 5) -> list:
    """The trace events of `reps` evaluations of `graph`'s output, each wrapped in an EVAL range."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(reps):
            out = graph()
            with record_function("EVAL"):
                mx.eval(out)
                mx.synchronize()
    return [e for e in exported_trace(profiler)["traceEvents"] if e.get("ph") == "X"]


def main():
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    torch.zeros(1, device="cuda")  # CUDA and CUPTI up before the first trace
    package = importlib.import_module("mlx_moe_fix.kernels")
    prefill = importlib.import_module("mlx_moe_fix.kernels.moe_prefill")
    layer, x, indices, weights = build_case("qwen3", 2048)
    calls = part_calls(prefill, experts_of(layer, package), x, indices, weights)
    gate_up_rows, gate_up_w = mx.random.normal((16384, 2048)).astype(mx.bfloat16), mx.random.normal((2048, 1536)).astype(mx.bfloat16)
    down_rows, down_w = mx.random.normal((16384, 768)).astype(mx.bfloat16), mx.random.normal((768, 2048)).astype(mx.bfloat16)
    mx.eval(gate_up_rows, gate_up_w, down_rows, down_w)
    callables = {"gate_up": calls["gate_up"][0], "down": calls["down"][0], "layer": calls["layer"][0],
                 "matmul 16384x2048x1536": lambda: gate_up_rows @ gate_up_w,
                 "matmul 16384x768x2048": lambda: down_rows @ down_w}
    for name, fn in callables.items():
        graph = repeated(fn, launches)
        warm_up(graph)
        untraced = bench(graph, 2, 9)
        events = traced_evaluations(graph)
        evaluations = sorted((e for e in events if e["name"] == "EVAL" and e.get("cat") == "user_annotation"),
                             key=lambda e: e["ts"])
        last = evaluations[-1]
        start, end = last["ts"], last["ts"] + last["dur"]
        print(f"== {name} x{launches}: untraced median {untraced.median * 1e6 / launches:.1f} µs a launch "
              f"(build {untraced.build_median * 1e6 / launches:.1f}); traced evaluation {last['dur']:.0f} µs")
        for e in sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", *RUNTIME)
                         and start <= e["ts"] <= end), key=lambda e: e["ts"]):
            print(f"  {e['ts'] - start:8.1f} +{e['dur']:8.1f}  {e['cat']:12s} {e['name'][:90]}")
        summed = {}
        for evaluation in evaluations:
            for e in events:
                if e.get("cat") in RUNTIME and evaluation["ts"] <= e["ts"] <= evaluation["ts"] + evaluation["dur"]:
                    summed[e["name"]] = summed.get(e["name"], 0.0) + e["dur"] / len(evaluations)
        top = sorted(summed.items(), key=lambda item: -item[1])[:8]
        print("  runtime calls an evaluation (µs):", ", ".join(f"{n} {t:.1f}" for n, t in top))


if __name__ == "__main__":
    main()
