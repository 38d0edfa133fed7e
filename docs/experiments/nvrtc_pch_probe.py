"""Forty-sixth session (development CPU, NVRTC 13.0 from the nvidia-cuda-nvrtc wheel): NVRTC's
compile time of five of our kernel variants, as kernel_cache.fill compiles them, without and with
automatic PCH (`--pch`), and each cubin's digest (the same both ways). One mode per process (the
PCH lives in the process):
    LD_LIBRARY_PATH=<nvrtc lib> PYTHONPATH=. python3 docs/experiments/nvrtc_pch_probe.py plain|pch
Result: docs/benchmarks.md, forty-sixth session, item 7."""
import hashlib
import sys
import time

import mlx.core as mx

from mlx_moe_fix.kernels import kernel_cache
from mlx_moe_fix.kernels.sources import cuda_kernel_source
from tests.test_cuda_sources import BIAS_INPUTS, FLOAT_INPUTS, INT_INPUTS, PREFILL, ROUTER, WEIGHT_INPUTS


def dtype(name, t):
    if name in INT_INPUTS:
        return mx.uint32 if INT_INPUTS[name] == "uint32_t" else mx.int32
    if name in WEIGHT_INPUTS:
        return mx.uint32
    return mx.float32 if name in FLOAT_INPUTS or name in BIAS_INPUTS else t


CASES = [(PREFILL, "moe_prefill.cu", "grouped", {"BITS": 4, "GROUP": 64, "BM": 64, "PAIRS_IN": True, "ACTIVATE": True,
                                                 "GATED": True, "ACT": 0, "LIMITED": True, "HAS_BIAS": False}),
         (PREFILL, "moe_prefill.cu", "route", {"TILE": 128, "MAX_EXPERTS": PREFILL.ROUTE_MAX_EXPERTS}),
         (PREFILL, "moe_prefill.cu", "combine", {}),
         (ROUTER, "moe_router.cu", "topk", {"SOFTMAX_FIRST": True, "NORMALIZE": True, "LAST_K": True}),
         (ROUTER, "moe_router.cu", "topk", {"SOFTMAX_FIRST": False, "NORMALIZE": False, "LAST_K": True})]
mode = sys.argv[1]
options = kernel_cache.compile_options((9, 0), pch=mode == "pch")
total = 0.0
for module, filename, section, constants in CASES:
    header, body = cuda_kernel_source(filename, section)
    t = mx.bfloat16
    inputs = tuple((n, dtype(n, t)) for n in module.INPUTS[section])
    outputs = tuple((n, dtype(n, t)) for n in module.OUTPUTS[section])
    template = (("T", t), ("S", t), ("SC", mx.float32), ("WT", t)) + tuple(constants.items())
    name = f"custom_kernel_{section}"
    source = kernel_cache.kernel_source(name, header, body, inputs, outputs, template, kernel_cache.PREAMBLE)
    start = time.perf_counter()
    cubin, _ = kernel_cache.compile_cubin(source, f"m_{section}", f"mlx::core::cu::{name}", options)
    took = time.perf_counter() - start
    total += took
    print(f"{mode} {section}: {took:.2f} s, cubin {hashlib.sha1(cubin).hexdigest()[:10]}")
peak = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
print(f"{mode}: {total:.2f} s in all, peak resident {int(peak) // 1024} MiB")
