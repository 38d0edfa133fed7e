"""Forty-fifth session (H200): which model pays a process's first prompt length past 512. One model
per process (`dense`: qwen3_moe's dense equivalent, no kernel of ours; `moe`: qwen3_moe patched),
warm at 512 tokens, then first calls at 513, 514, 1000, 1024, 1025: build and eval ms, and the files
each call added to the CUDA driver's compute cache. Result: docs/benchmarks.md, forty-fifth
session, item 1. Run from the repo root, a fresh driver cache each:
    CUDA_CACHE_PATH=$(mktemp -d) PYTHONPATH=. python3 docs/experiments/first_length_probe.py dense"""
import sys, time, os
from pathlib import Path
import mlx.core as mx, numpy as np
import mlx_moe_fix
from benchmarks import models

which = sys.argv[1]
specs = models.model_specs(False, 4)
spec = specs["qwen3_moe"]
model = models.build_model(spec if which == "moe" else specs[spec.dense])
if which == "moe":
    mlx_moe_fix.apply()
else:
    mlx_moe_fix.revert()
cache = Path(os.environ["CUDA_CACHE_PATH"])
files = lambda: {p for p in cache.rglob("*") if p.is_file()}
rng = np.random.default_rng(0)
for length, calls in ((512, 4), (513, 3), (514, 2), (1000, 2), (1024, 2), (1025, 2)):
    prompt = mx.array(rng.integers(0, spec.config["vocab_size"], (1, length)))
    for call in range(calls):
        before = files()
        t0 = time.perf_counter(); logits = model(prompt); t1 = time.perf_counter(); mx.eval(logits); t2 = time.perf_counter()
        print(f"{which} len {length} call {call}: build {1e3*(t1-t0):.2f} eval {1e3*(t2-t1):.2f} ms, driver cache +{len(files()-before)}", flush=True)
