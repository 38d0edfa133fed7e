"""Forty-seventh session (H200): a process that fills the kernel cache, with NVRTC's header warmed
up at apply() (kernel_cache.warm_up_header; `warm`) or not (`cold`): apply() first, then the
models built (as a user applies before loading), then the first patched qwen3_moe prefill + decode
token (kernel_cache_probe.py's model and prompt), each NVRTC compile timed. Run with a
MLX_PTX_CACHE_DIR that holds none of our modules. Result: docs/benchmarks.md, forty-seventh
session, item 6.
    MLX_PTX_CACHE_DIR=<copy without custom_kernel_*> PYTHONPATH=. python3 docs/experiments/header_warm_up_probe.py warm|cold"""
import argparse
import sys
import time
from pathlib import Path

import mlx_moe_fix
from benchmarks import models
from benchmarks.decode_timeline import Decoder, prompts_of
from mlx_moe_fix.kernels import kernel_cache

sys.path.insert(0, str(Path(__file__).parent))
from fill_time_probe import timed_fills  # noqa: E402

mode = sys.argv[1]
compiles = timed_fills()
if mode == "cold":
    kernel_cache.warm_up_header = lambda switched_on: False
start = time.perf_counter()
mlx_moe_fix.apply()
applied = time.perf_counter()
smoke = "smoke" in sys.argv
args = argparse.Namespace(model="qwen3_moe", deepseek_layers=4, prompt=12 if smoke else 256, smoke=smoke)
spec, built, tokens = models.build_decode_pair(args)
prompts = prompts_of(tokens, 1, spec.config["vocab_size"])
ready = time.perf_counter()
Decoder(built[False], prompts)
first = time.perf_counter() - ready
print(f"{mode}: apply() {applied - start:.3f} s, models built {ready - applied:.1f} s, warm-up started "
      f"{bool(kernel_cache._warm_up)}; first patched prefill + token {first:.2f} s, of it NVRTC {sum(c for _, c in compiles):.2f} s "
      f"in {len(compiles)} compiles ({', '.join(f'{c:.2f}' for _, c in compiles)})")
