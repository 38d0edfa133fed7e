"""Forty-seventh session (H200): what a process filling the kernel cache spends its time on. The
first patched qwen3_moe prefill + decode token (kernel_cache_probe.py's model and prompt), with
kernel_cache.compile_cubin timed per variant (NVRTC with MLX's options and `--pch`); run with a
MLX_PTX_CACHE_DIR that holds none of our modules. Result: docs/benchmarks.md, forty-seventh
session, item 5 (run before db17c08; since then its apply() also starts the header's warm-up,
right before the first call). `timed_fills` serves header_warm_up_probe.py too.
    MLX_PTX_CACHE_DIR=<copy without custom_kernel_*> PYTHONPATH=. python3 docs/experiments/fill_time_probe.py"""
import argparse
import functools
import sys
import time

import mlx_moe_fix
from benchmarks import models
from benchmarks.decode_timeline import Decoder, prompts_of
from mlx_moe_fix.kernels import kernel_cache


def timed_fills() -> list:
    """From now on every NVRTC compile of kernel_cache's fills is timed: the list of (module,
    seconds) they are appended to."""
    compiles = []
    compile_cubin = kernel_cache.compile_cubin

    def timed_compile(source, module, kernel, options):
        start = time.perf_counter()
        try:
            return compile_cubin(source, module, kernel, options)
        finally:
            compiles.append((module, time.perf_counter() - start))

    kernel_cache.fill = functools.partial(kernel_cache.fill, compile=timed_compile)  # CacheFilling calls it by name
    return compiles


def main():
    compiles = timed_fills()
    smoke = "smoke" in sys.argv
    args = argparse.Namespace(model="qwen3_moe", deepseek_layers=4, prompt=12 if smoke else 256, smoke=smoke)
    spec, built, tokens = models.build_decode_pair(args)
    prompts = prompts_of(tokens, 1, spec.config["vocab_size"])
    mlx_moe_fix.apply()
    start = time.perf_counter()
    Decoder(built[False], prompts)
    total = time.perf_counter() - start
    for module, seconds in compiles:
        print(f"{seconds:6.2f} s  {module[:110]}")
    print(f"first patched prefill + token {total:.2f} s, of it NVRTC {sum(s for _, s in compiles):.2f} s in "
          f"{len(compiles)} compiles")


if __name__ == "__main__":
    main()
