"""Ninety-fifth stop (docs/benchmarks.md, items 1-2): what the CUDA prefill path's graph allocates
on the CPU, each kernel replaced by tests/parity/test_prefill_memory.py's stand-in (its launch's outputs,
allocated while its inputs are alive), against stock's prefill of the same layer, with the GEMMs
on mma.sync and on wgmma. A case is shape:tokens, the shape a name of
benchmarks.prefill_memory.CASE_SHAPES or hidden x intermediate x experts x top-k.
    PYTHONPATH=. python3 docs/experiments/prefill_memory_stand_ins.py qwen3:512 512x256x256x8:16"""
import sys
import time

import mlx.core as mx

mx.set_default_device(mx.cpu)
import mlx_moe_fix.kernels  # noqa: E402,F401
from benchmarks import prefill_memory  # noqa: E402
from tests.parity.test_prefill_memory import AllocatingKernel  # noqa: E402

PREFILL = sys.modules["mlx_moe_fix.kernels.moe_prefill"]
PREFILL.cuda_kernel_object = AllocatingKernel
for spec in sys.argv[1:]:
    shape, tokens = spec.split(":")
    if shape not in prefill_memory.CASE_SHAPES:
        prefill_memory.CASE_SHAPES[shape] = tuple(int(n) for n in shape.split("x"))
    for wgmma in (False, True):
        PREFILL.wgmma_device = lambda: wgmma
        start = time.time()
        case = prefill_memory.build_case(shape, int(tokens))
        stock, ours = prefill_memory.stock_and_patched_bytes(case, PREFILL.moe_prefill_kernel)
        pairs, experts = case.indices.size, case.experts.num_experts
        tile = PREFILL.tile_height(pairs, experts)
        print(f"{shape} T={tokens} {'wgmma' if wgmma else 'mma.sync'}: stock {stock / 1e6:.2f} MB, CUDA path "
              f"{ours / 1e6:.2f} MB, tile {tile}, {PREFILL.grid_tiles(pairs, experts, tile)} tiles, expert weights "
              f"{case.weight_bytes / 1e6:.1f} MB, {time.time() - start:.0f} s", flush=True)
