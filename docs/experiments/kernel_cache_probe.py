"""Forty-fifth session (H200): MLX_MOE_FIX_KERNEL_CACHE on the GPU (run at call 10 with the
precompiled-kernel design of that session's branch; on main the switch fills MLX's PTX cache,
as run in the forty-sixth session).
A process's first patched prefill + token (qwen3_moe, a 256-token prompt), and its first
token's log-probabilities and 8 greedy tokens saved as
OUT_logprobs.npy / OUT_tokens.npy for comparison between processes (run it with the cache off
twice too: MLX's own spread between processes). Result: docs/benchmarks.md, forty-fifth session,
item 9. Run from the repo root (give each process the same MLX_PTX_CACHE_DIR):
    MLX_MOE_FIX_KERNEL_CACHE=1 PYTHONPATH=. python3 docs/experiments/kernel_cache_probe.py /tmp/on"""
import argparse, sys, time
import numpy as np
import mlx.core as mx
import mlx_moe_fix
from mlx_moe_fix.kernels import kernel_cache
from benchmarks import models
from benchmarks.decode_timeline import Decoder, prompts_of

out = sys.argv[1]
smoke = "smoke" in sys.argv
args = argparse.Namespace(model="qwen3_moe", deepseek_layers=4, prompt=12 if smoke else 256, smoke=smoke)
spec, built, tokens = models.build_decode_pair(args)
prompts = prompts_of(tokens, 1, spec.config["vocab_size"])
mlx_moe_fix.revert()
t0 = time.perf_counter(); Decoder(built[True], prompts); t1 = time.perf_counter()
mlx_moe_fix.apply()
t2 = time.perf_counter(); d = Decoder(built[False], prompts); t3 = time.perf_counter()
first = np.array(d.logprobs.astype(mx.float32))
ys = []
for _ in range(8):
    d.burst(1); ys.append(int(d.y.item()))
t4 = time.perf_counter(); Decoder(built[False], prompts); t5 = time.perf_counter()
np.save(out + "_logprobs.npy", first); np.save(out + "_tokens.npy", np.array(ys))
print(f"dense first prefill+token {t1-t0:.2f} s; patched first {t3-t2:.2f} s, second {t5-t4:.2f} s; tokens {ys}")
print("kernel cache:", mlx_moe_fix.status()["cuda_kernel_cache"], "includes:", kernel_cache.include_directories(), "written:", len(kernel_cache.written),
      "failures:", len(kernel_cache.failures), kernel_cache.failures[:2])
