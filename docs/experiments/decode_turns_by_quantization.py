"""Fifty-first session (H200): decode tok/s in rotating turns, one process: a family's MoE model
built once per routed-experts quantization (`benchmarks.models` --experts-mode values), each
stock and patched, and its dense equivalent; after a warm-up turn, TURNS turns of 128 greedy
tokens after a 128-token prompt on every variant, the order rotated each turn; per-turn ratios to
the dense model and to stock, their medians and ranges. Result: docs/benchmarks.md, fifty-first
session, item 3. Run from the repo root (SMOKE=1: the benchmark's tiny configs, on a CPU):
    PYTHONPATH=. python3 docs/experiments/decode_turns_by_quantization.py inkling 2 affine,nvfp4 12"""
import argparse, copy, statistics, sys, time
import numpy as np
import mlx.core as mx
from benchmarks import models as M
import mlx_moe_fix

family, layers, modes, turns = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4])
import os
specs = M.model_specs(bool(os.environ.get("SMOKE")), layers)
models = {}
for mode in modes:
    spec = copy.deepcopy(specs[family])
    spec.experts_mode = mode
    t = time.perf_counter()
    mx.random.seed(0)
    models[mode] = M.build_model(spec)
    print(f"{family} {mode}: built in {time.perf_counter() - t:.1f} s", file=sys.stderr)
mx.random.seed(0)
models["dense"] = M.build_model(specs[specs[family].dense])
args = argparse.Namespace(decode_tokens=129, prefill_step_size=2048)
prompt = mx.array(np.random.default_rng(0).integers(0, specs[family].config["vocab_size"], 128).tolist())
runs = [(m, s) for m in modes for s in ("stock", "patched")] + [("dense", "stock")]
rates = {r: [] for r in runs}
tokens = {}
for turn in range(turns + 1):
    order = runs[turn % len(runs):] + runs[:turn % len(runs)]
    for model_name, switch in order:
        M.set_mode(switch)
        seconds, toks, _ = M.time_decode(models[model_name], prompt, args)
        if turn > 0:
            rates[(model_name, switch)].append((len(toks) - 1) / seconds)
        tokens[(model_name, switch)] = toks
    print(f"turn {turn} done", file=sys.stderr)
dense = rates[("dense", "stock")]
print(f"{family}, {layers} layers, decode tok/s, {turns} turns of 128 tokens after 128 (rotating order), one process")
print("| model | median | min | max | per-turn / dense median (range) | per-turn / stock median (range) |")
print("|---|---|---|---|---|---|")
for r in runs:
    v = rates[r]
    over_dense = sorted(a / b for a, b in zip(v, dense))
    line = f"| {r[0]} {r[1]} | {statistics.median(v):.1f} | {min(v):.1f} | {max(v):.1f} | {statistics.median(over_dense):.3f} ({over_dense[0]:.3f}-{over_dense[-1]:.3f}) |"
    if r[1] == "patched":
        over_stock = sorted(a / b for a, b in zip(v, rates[(r[0], "stock")]))
        line += f" {statistics.median(over_stock):.3f} ({over_stock[0]:.3f}-{over_stock[-1]:.3f}) |"
    else:
        line += " - |"
    print(line)
for m in modes:
    print(f"{m}: stock and patched greedy tokens identical: {tokens[(m, 'stock')] == tokens[(m, 'patched')]}")
print("patched paths:", sorted({(p.layer, p.phase, p.path) for p in mlx_moe_fix.path_counts()}))
