"""Benchmarks for mlx-moe-fix; run them as modules from the repo root (python3 -m benchmarks.kernels)."""
