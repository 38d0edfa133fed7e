"""Forty-fifth session (H200): a process's one-time cost of our kernels. qwen3_moe's dense
equivalent, then qwen3_moe patched, each: the first benchmarks.decode_timeline.Decoder (a
256-token prompt's prefill and one decode token, evaluated), 4 decode tokens, then a second
Decoder (everything compiled and loaded); seconds. Result: docs/benchmarks.md, forty-fifth session,
item 8. Run from the repo root (`smoke`: tiny models, CPU):
    PYTHONPATH=. python3 docs/experiments/compile_cost_probe.py"""
import argparse, time, sys
import mlx_moe_fix
from benchmarks import models
from benchmarks.decode_timeline import Decoder, prompts_of

smoke = "smoke" in sys.argv
args = argparse.Namespace(model="qwen3_moe", deepseek_layers=4, prompt=12 if smoke else 256, smoke=smoke)
spec, built, tokens = models.build_decode_pair(args)
prompts = prompts_of(tokens, 1, spec.config["vocab_size"])
for label, dense in (("dense equivalent", True), ("MoE, patched", False)):
    if dense:
        mlx_moe_fix.revert()
    else:
        mlx_moe_fix.apply()
    t0 = time.perf_counter(); d = Decoder(built[dense], prompts); t1 = time.perf_counter()
    d.burst(4); t2 = time.perf_counter()
    Decoder(built[dense], prompts); t3 = time.perf_counter()
    print(f"{label}: first prefill + token {t1 - t0:.2f} s, 4 tokens {t2 - t1:.2f} s, second prefill + token {t3 - t2:.2f} s", flush=True)
