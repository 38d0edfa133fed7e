"""Benchmarks for mlx-moe-fix; run them as modules from the repo root (python3 -m benchmarks.kernels).

They compare the package's implementation with stock: where no kernel of ours is on (the CPU),
that is the pure-MLX references, which apply() leaves out unless MLX_MOE_FIX_REFERENCES=1."""

import os

os.environ.setdefault("MLX_MOE_FIX_REFERENCES", "1")
