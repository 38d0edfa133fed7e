"""Benchmarks for mlx-moe-fix; run them as modules from the repo root (python3 -m benchmarks.kernels).

They compare the package's implementation with stock: where no kernel of ours is on (the CPU),
that is the pure-MLX references, which apply() leaves out unless MLX_MOE_FIX_REFERENCES=1.
MLX_MOE_FIX_BENCH_CPU=1 runs them on the CPU wherever they run (tests/test_benchmarks_smoke.py's
children: their tiny shapes are not all ones MLX's CUDA kernels take)."""

import os

os.environ.setdefault("MLX_MOE_FIX_REFERENCES", "1")
if os.environ.get("MLX_MOE_FIX_BENCH_CPU", "") not in ("", "0"):
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
